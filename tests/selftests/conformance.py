"""Runs the conformance table (``submissions/conformance/variants.py``) on real gloo and on the
broker, and says where the two disagree (tests/selftests/test_conformance.py).

On gloo every rank is a process of its own (``python conformance.py RANK ...``), and every
variant gets a fresh default process group, so that a variant one rank refused and the
others waited in cannot shift the next one. A variant that ends a process (gloo aborts on
some mismatches) or hangs it past gloo's timeout is recorded as refused, and the ranks
start again after it. On the broker every variant is one call of the grader's real path.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
TABLE = HERE / "submissions" / "conformance"
GLOO_TIMEOUT = 8.0  # seconds gloo waits for a peer before it raises
STALL = 2 * GLOO_TIMEOUT + 12  # no variant finished for this long: the ranks hang
STARTUP = 300.0  # seconds the ranks may take to import torch (a busy machine is slow)
DYING = 3.0  # seconds without progress once a rank died


class Outcome(NamedTuple):
    """One variant on one backend: every rank's tensors, or why it was refused."""

    refused: str  # "": accepted
    results: tuple[tuple[torch.Tensor, ...], ...] = ()  # rank by rank


class Expected(Protocol):
    """What the table says of a variant (``variants.Variant``)."""

    cause: str
    stricter: str


def disagreement(variant: Expected, gloo: Outcome, broker: Outcome) -> str | None:
    """Why the broker's outcome is not what the table says of ``variant`` (None: as it says):
    gloo's results; or, where gloo refuses, a refusal naming ``variant.cause``; or, where the
    grader is stricter than gloo on purpose (``variant.stricter``), gloo's acceptance and
    the broker's refusal."""
    cause, stricter = variant.cause, variant.stricter
    if gloo.refused and (stricter or not cause):
        return f"gloo refuses a variant the table says it takes: {gloo.refused}"
    if cause and not (gloo.refused or stricter):
        return f"gloo takes a variant the table says it refuses ({cause!r})"
    if cause:
        if not broker.refused:
            return f"gloo refuses ({gloo.refused}), the broker takes it"
        if cause.lower() not in broker.refused.lower():
            return f"the broker's refusal does not name {cause!r}: {broker.refused}"
        return None
    if broker.refused:
        return f"gloo takes it, the broker refuses: {broker.refused}"
    return _differs(gloo.results, broker.results)


def _differs(want: tuple, got: tuple) -> str | None:
    for rank, (w, g) in enumerate(zip(want, got, strict=True)):
        if len(w) != len(g):
            return f"rank {rank}: {len(g)} tensors, gloo {len(w)}"
        for a, b in zip(w, g, strict=True):
            facts = (a.dtype, tuple(a.shape), a.requires_grad)
            if facts != (b.dtype, tuple(b.shape), b.requires_grad) or not torch.equal(a, b):
                return f"rank {rank}: broker {_show(b)}, gloo {_show(a)}"
    return None


def _show(t: torch.Tensor) -> str:
    grad = ", requires_grad" if t.requires_grad else ""
    return f"{t.dtype}{list(t.shape)}{grad} {t.detach().tolist()}"


# -- on the broker: one call of the grader's real path per variant -------------------------------


def on_broker(names: list[str], world: int, work: Path) -> dict[str, Outcome]:
    from grader import failures, sandbox
    from grader.course.submission import stage
    from grader.device import Device
    from grader.launch.job import job_settings
    from grader.launch.world import CallLimits, RankPool
    from grader.protocol import CallRequest

    stage(TABLE, work / "import")
    pool = RankPool(world, job_settings(work, sandbox.Level.NONE, Device.CPU))
    outcomes = {}
    try:
        for name in names:
            try:
                request = CallRequest(world, "variants.run", [(name,)] * world, case=name)
                out = pool.call(request, CallLimits(timeout=30))
            except (failures.RankFailure, failures.GraderFailure) as err:
                outcomes[name] = Outcome(str(err))
            else:
                outcomes[name] = Outcome("", tuple(tuple(r) for r in out.returned))
    finally:
        pool.close()
    return outcomes


# -- on gloo: a process per rank, started again after a variant that ends or hangs it ------------


def on_gloo(count: int, world: int, work: Path) -> list[Outcome]:
    """Variants 0..count-1 on real gloo: ``world`` processes, replaced past a fatal variant
    by a set started beforehand (importing torch takes the most time of all)."""
    outcomes: list[Outcome] = []
    sets, idle = [_Ranks.spawn(0, world, work)], 0
    try:
        while len(outcomes) < count:
            sets.append(_Ranks.spawn(len(sets), world, work))  # the standby
            ended = sets[-2].run(len(outcomes))
            done = _read(len(outcomes), count, world, work)
            outcomes += done
            idle = 0 if done else idle + 1
            # The next variant ended or hung a rank, if one began it (a rank can also die
            # between two variants, or setting one up: then the next set starts it again).
            began = list(work.glob(f"{len(outcomes)}.*.began"))
            if len(outcomes) < count and (began or idle > 1):
                outcomes.append(Outcome(f"gloo ended the ranks: {ended or 'they hung'}"))
                idle = 0
    finally:
        for ranks in sets:
            ranks.end()
    return outcomes


class _Ranks(NamedTuple):
    """One set of rank processes: they import torch, then wait for the variant to start at."""

    number: int
    store: dist.TCPStore
    processes: list[subprocess.Popen]
    logs: list[Path]

    @classmethod
    def spawn(cls, number: int, world: int, work: Path) -> _Ranks:
        store = dist.TCPStore("127.0.0.1", 0, world + 1, True, wait_for_workers=False)
        command = [sys.executable, __file__, str(world), str(store.port), str(work), str(number)]
        logs = [work / f"log{number}.{r}" for r in range(world)]
        processes = []
        for rank, log in enumerate(logs):
            with log.open("w") as out:
                command_line = [*command, str(rank)]
                processes.append(subprocess.Popen(command_line, stdout=out, stderr=out))
        return cls(number, store, processes, logs)

    def run(self, start: int) -> str:
        """Run the variants from ``start`` until the ranks finish, die or stall; how they
        ended (empty if well)."""
        self.store.set("start", str(start))
        try:
            _watch(self.processes, self.logs[0].parent, self.number)
        finally:
            self.end()
        return "; ".join(
            f"rank {r}: killed, stuck" if p.returncode == -9
            else f"rank {r}: exit status {p.returncode}, {_last_line(self.logs[r])}"
            for r, p in enumerate(self.processes)
            if p.returncode
        )  # fmt: skip

    def end(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()


def _watch(ranks: list[subprocess.Popen], work: Path, number: int) -> None:
    """Return when the ranks ended, or made no progress for too long: STARTUP until all
    started, STALL once they run, DYING once one died (the others save what they saw of
    the variant it died in, and cannot start the next one without it)."""
    seen, since = -1, time.monotonic()
    while any(r.poll() is None for r in ranks):
        ready = len(list(work.glob(f"ready{number}.*")))
        files = len(list(work.glob("*.pt"))) + ready
        seen, since = (files, time.monotonic()) if files != seen else (seen, since)
        died = any(r.poll() not in (None, 0) for r in ranks)  # the others cannot go on
        limit = DYING if died else STALL if ready == len(ranks) else STARTUP
        if time.monotonic() - since > limit:
            return
        time.sleep(0.1)


def _last_line(path: Path) -> str:
    """The last words of a rank's output, without torch's "[rank0]: " prefixes."""
    text = re.sub(r"(\[rank\d+\]:\s*)+", "", path.read_text(errors="replace"))
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def _read(start: int, count: int, world: int, work: Path) -> list[Outcome]:
    """The outcomes every rank saved, from variant ``start`` to the first one missing."""
    outcomes = []
    for i in range(start, count):
        paths = [work / f"{i}.{r}.pt" for r in range(world)]
        if not all(p.exists() for p in paths):
            break
        saved = [torch.load(p) for p in paths]
        refusals = [f"rank {r}: {s}" for r, s in enumerate(saved) if isinstance(s, str)]
        outcomes.append(Outcome("; ".join(refusals)) if refusals else Outcome("", tuple(saved)))
    return outcomes


def _rank(world: int, port: int, work: Path, number: int, rank: int) -> None:
    """One rank of set ``number`` on gloo: once told where to start, every variant from
    there, each in a fresh default group."""
    sys.path.insert(0, str(TABLE))
    import variants

    store = dist.TCPStore("127.0.0.1", port, world + 1, False, timedelta(seconds=60))
    (work / f"ready{number}.{rank}").touch()
    while not store.check(["start"]):  # a standby set waits until the set before it died
        time.sleep(0.02)
    for i in range(int(store.get("start")), len(variants.VARIANTS)):
        _barrier(store, f"start{i}", world)  # a rank still waiting in the last variant is late
        _init(store, f"v{i}", rank, world)
        (work / f"{i}.{rank}.began").touch()
        try:
            result: Any = tuple(variants.VARIANTS[i].call(world, rank))
        except Exception as err:  # gloo's refusal, whatever its type: recorded, not raised
            result = f"{type(err).__name__}: {err}".splitlines()[0][:500]
        torch.save(result, work / f"{i}.{rank}.pt.part")
        (work / f"{i}.{rank}.pt.part").rename(work / f"{i}.{rank}.pt")
        dist.destroy_process_group()


def _init(store: dist.Store, key: str, rank: int, world: int, tries: int = 3) -> None:
    """A fresh default gloo group, tried again by every rank where one rank's setup failed (on
    a busy machine gloo's connections sometimes fail; that is no variant's outcome)."""
    for attempt in range(tries):
        prefix = f"{key}.{attempt}"
        try:
            dist.init_process_group(
                "gloo", store=dist.PrefixStore(f"{prefix}/", store), rank=rank,
                world_size=world, timeout=timedelta(seconds=GLOO_TIMEOUT),
            )  # fmt: skip
            store.add(f"{prefix}.up", 1)
        except (RuntimeError, dist.DistError):
            store.add(f"{prefix}.up", 0)
        _barrier(store, f"{prefix}.tried", world)
        if store.add(f"{prefix}.up", 0) == world:
            return
        if dist.is_initialized():
            dist.destroy_process_group()
    raise RuntimeError(f"gloo could not set up a group of {world} ranks {tries} times")


def _barrier(store: dist.Store, key: str, world: int, timeout: float = STARTUP) -> None:
    """Wait until ``world`` ranks reached ``key``."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout
    while store.add(key, 0) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank reached {key}")
        time.sleep(0.01)


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    _rank(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
