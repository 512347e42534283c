"""The reference's message patterns, which the cost tests compare the student's with.

They are made by running the reference in a clean job of its own, through
the broker, as ``grader run`` runs a submission, and kept as data
(``reference_traces.json``), so that grading never runs the reference beside
a submission and a student release, which has no reference, grades the same.
The patterns depend only on the sizes, never on the values, so one file
serves every submission::

    python -m grader.judge.reference_traces          # rebuild after changing the reference
    python -m grader.judge.reference_traces --check  # exit 1 if the shipped file is stale

A self-test (``tests/selftests/test_reference_traces.py``) rebuilds them and
fails when the shipped file no longer matches what the reference does.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from grader.broker.traffic import Message
from grader.course.config import ConfigError
from grader.device import Device
from grader.failures import GraderFailure, RankFailure

TRACES_FILE = Path(__file__).with_name("reference_traces.json")
# The cost tests of the collectives, and the option that gives each its element count.
COST_TESTS = {"communication": "communication_elements", "performance": "performance_elements"}
_CALL_SECONDS = 120.0  # one reference call, on a loaded machine; the trusted reference never hangs

Traces = dict[str, list[list[dict[str, Any]]]]  # as in the file: Message.to_json()


def key(function: str, world_size: int, n: int) -> str:
    return f"{function}/ws{world_size}/n{n}"


@cache
def _load() -> dict[str, Any]:
    try:
        return json.loads(TRACES_FILE.read_text())
    except (OSError, ValueError):
        return {}


def reference_messages(function: str, world_size: int, n: int) -> list[list[Message]]:
    found = _load().get(key(function, world_size, n))
    try:
        if not isinstance(found, list):
            raise ValueError("no such trace")
        return [[Message.from_json(entry) for entry in rank] for rank in found]
    except (TypeError, ValueError) as err:
        raise GraderFailure(
            f"no reference trace of {function} at world size {world_size} on {n} elements "
            f"({err}): rebuild them with `python -m grader.judge.reference_traces`"
        ) from None


def graded_sizes() -> dict[int, set[int]]:
    """{world size: element counts} of every cost test in grading.yaml: what must be traced."""
    from grader.course.config import load_config

    part = load_config().part("collectives")
    sizes: dict[int, set[int]] = {}
    for test, option in COST_TESTS.items():
        settings = part.settings_for(test)
        for world_size in settings.world_sizes:
            sizes.setdefault(world_size, set()).add(int(settings.options.need(option)))
    return sizes


def build(sizes: dict[int, set[int]]) -> Traces:
    """Run the reference through the broker: {world size: element counts} -> traces.

    One job of the largest world size serves every smaller one, exactly as a
    grading run's does (:class:`grader.launch.world.RankPool`), unsandboxed:
    the reference is the course's own code.
    """
    from grader import sandbox
    from grader.course.config import REPO_ROOT
    from grader.course.submission import stage
    from grader.launch.job import job_settings
    from grader.launch.world import CallLimits, RankPool, World
    from grader.testkit import data
    from grader.testkit.calls import COLLECTIVES, collective_call

    data.configure(b"reference traces", "sizes only")  # the values never matter here
    limits = CallLimits(timeout=_CALL_SECONDS, forbid_collectives=True)
    work = Path(tempfile.mkdtemp(prefix="grader-traces-")).resolve()
    traces: Traces = {}
    try:
        stage(REPO_ROOT / "reference", work / "import")
        pool = RankPool(max(sizes), job_settings(work, sandbox.Level.NONE, Device.CPU))
        try:
            for world_size, counts in sorted(sizes.items()):
                world = World(world_size, pool, limits)
                for n in sorted(counts):
                    for function in COLLECTIVES:
                        args, _ = collective_call(function, world_size, n)
                        out = world.call(f"collectives.{function}", args)
                        logs = out.traffic.messages()
                        traces[key(function, world_size, n)] = [
                            [entry.to_json() for entry in log] for log in logs
                        ]
        finally:
            pool.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return traces


def differences(shipped: dict[str, Any], rebuilt: Traces) -> list[str]:
    """What the shipped traces get wrong, one line per trace (none: they are current)."""
    lines = [f"{name}: missing" for name in rebuilt if name not in shipped]
    lines += [f"{name}: not graded any more" for name in shipped if name not in rebuilt]
    for name, ranks in rebuilt.items():
        if name in shipped and shipped[name] != ranks:
            lines.append(f"{name}: {_first_difference(shipped[name], ranks)}")
    return lines


def _first_difference(shipped: list[list[dict]], rebuilt: list[list[dict]]) -> str:
    if len(shipped) != len(rebuilt):
        return f"{len(shipped)} ranks shipped, the reference has {len(rebuilt)}"
    for rank, (old, new) in enumerate(zip(shipped, rebuilt, strict=True)):
        for i in range(max(len(old), len(new))):
            was = old[i] if i < len(old) else "nothing"
            now = new[i] if i < len(new) else "nothing"
            if was != now:
                return f"rank {rank}'s message {i} is {was} shipped, {now} in the reference"
    return "different"  # not reached: the lists differ somewhere


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m grader.judge.reference_traces", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare with the shipped file instead of writing it; exit 1 if it is stale",
    )
    parser.add_argument(
        "--output", type=Path, default=TRACES_FILE, help=f"where to write (default: {TRACES_FILE})"
    )
    args = parser.parse_args(argv)
    try:
        traces = build(graded_sizes())
    except (ConfigError, GraderFailure, RankFailure) as err:
        print(f"the reference could not be traced: {err}", file=sys.stderr)
        return 2
    if args.check:
        stale = differences(_load(), traces)
        for line in stale:
            print(f"stale: {line}")
        if stale:
            print("rebuild with `python -m grader.judge.reference_traces`")
            return 1
        print(f"{TRACES_FILE.name}: all {len(traces)} traces match the reference")
        return 0
    args.output.write_text(json.dumps(traces, separators=(",", ":")) + "\n")
    print(f"{len(traces)} reference traces written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
