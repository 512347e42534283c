"""The reference's message patterns, which the cost tests compare the student's with.

They are made by running the reference in clean jobs of its own, through the
broker, and kept as data (``reference_traces.json``), so that grading never
runs the reference beside a submission and a student release, which has no
reference, grades the same. The patterns depend only on the sizes, never on
the values, so one file serves every submission::

    python -m grader.judge.reference_traces     # rebuild after changing the reference
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from grader.failures import GraderFailure

TRACES_FILE = Path(__file__).with_name("reference_traces.json")


def key(function: str, world_size: int, n: int) -> str:
    return f"{function}/ws{world_size}/n{n}"


@cache
def _load() -> dict[str, Any]:
    try:
        return json.loads(TRACES_FILE.read_text())
    except (OSError, ValueError):
        return {}


def reference_messages(function: str, world_size: int, n: int) -> list[list[dict[str, Any]]]:
    found = _load().get(key(function, world_size, n))
    if found is None:
        raise GraderFailure(
            f"no reference trace of {function} at world size {world_size} on {n} elements: "
            "rebuild them with `python -m grader.judge.reference_traces`"
        )
    return found


def build(sizes: dict[int, set[int]]) -> dict[str, Any]:
    """Run the reference through the broker: {world size: element counts} -> traces."""
    from grader import sandbox
    from grader.config import REPO_ROOT
    from grader.launch.world import JobSettings, World
    from grader.submission import stage
    from grader.testkit import data
    from grader.testkit.calls import COLLECTIVES, collective_call

    data.configure(b"reference traces", "sizes only")  # the values never matter here
    work = Path(tempfile.mkdtemp(prefix="grader-traces-"))
    traces: dict[str, Any] = {}
    try:
        stage(REPO_ROOT / "reference", work / "import")
        package = Path(__file__).resolve().parents[1]
        settings = JobSettings(
            work, work / "import", sandbox.Level.NONE.value, (), (), str(package.parent), 4 << 30
        )
        for world_size, counts in sorted(sizes.items()):
            world = World(world_size, settings)
            try:
                for n in sorted(counts):
                    for function in COLLECTIVES:
                        args, _ = collective_call(function, world_size, n)
                        out = world.call(f"collectives.{function}", args)
                        traces[key(function, world_size, n)] = out.traffic.messages()
            finally:
                world.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return traces


def main() -> int:
    from grader.config import load_config

    options = load_config().part("collectives")
    sizes: dict[int, set[int]] = {}
    for name, option in (
        ("communication", "communication_elements"),
        ("performance", "performance_elements"),
    ):
        settings = options.settings_for(name)
        for world_size in settings.world_sizes:
            sizes.setdefault(world_size, set()).add(int(settings.options[option]))
    traces = build(sizes)
    TRACES_FILE.write_text(json.dumps(traces, separators=(",", ":")) + "\n")
    print(f"{len(traces)} reference traces written to {TRACES_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
