"""The broker's payload throughput against gloo's, for 4 MB messages, side by side.

    python benchmarks/broker_throughput.py [--iterations 20] [--repeats 5] [--megabytes 4]
                                           [--rounds 3]

Every rank sends a message to the next rank and receives one from the
previous, ``--iterations`` times (a ring, as in a ring all-reduce), first
through the grader's broker (sandboxed ranks, as in grading), then over gloo
in a plain torchrun job. Both sides run the same ring function, and its time is
the same clock: rank 0's own, around the loop alone, the median of ``--repeats``
loops after a warm-up. Prints the payload each
rank receives per second and the ratio, at 2 and 4 ranks, for the broker twice:
keeping every payload in the call's record (a fresh copy of each message, as for
the tests that read what was sent) and not (as for performance tests, whose 4 MB
calls judge only sizes and times). For the broker it also prints the whole call
as the grader waits for it: the loop, plus handing each rank its arguments (the
4 MB tensor), starting and ending the call.

Each side's CPU a ring step is printed beside it: every rank process's CPU time
during the loop (all its threads, ``time.process_time``), and for the broker the
grader's process during the whole call (the broker's threads), with the share
of the machine's cores that kept busy. Where both sides keep the cores busy
alike, the throughput ratio is their CPU ratio: the broker's side is as fast as
its CPU a message allows, not slowed by waiting.

The two sides take turns, ``--rounds`` times at each world size, and the figures
are the medians over the rounds, the ratio that of each round's own: on a shared
machine, gloo's throughput alone went from 930 to 1789 MB/s a rank from one job
to the next at 2 ranks, and a single side-by-side pair said little.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RING = '''
import time
import torch
import torch.distributed as dist


def ring(tensor, iterations):
    """Send to the next rank, receive from the previous, ``iterations`` times: the loop's
    seconds, and the CPU seconds this rank's process used in it (every thread's)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    incoming = torch.empty_like(tensor)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(iterations):
        requests = [dist.isend(tensor, (rank + 1) % p), dist.irecv(incoming, (rank - 1) % p)]
        for request in requests:
            request.wait()
    return time.perf_counter() - start, time.process_time() - cpu
'''

GLOO = (
    RING
    + """
if __name__ == "__main__":
    import json, os, sys
    dist.init_process_group("gloo")
    tensor = torch.ones(int(sys.argv[1]))
    ring(tensor, 2)  # warm-up
    loops = [ring(tensor, int(sys.argv[2])) for _ in range(int(sys.argv[3]))]
    cpu = [None] * dist.get_world_size()
    dist.all_gather_object(cpu, [c for _, c in loops])
    if dist.get_rank() == 0:
        print(json.dumps({"seconds": [s for s, _ in loops], "cpu": [sum(c) for c in zip(*cpu)]}))
    dist.destroy_process_group()
"""
)


class Timing(NamedTuple):
    """One side's ring, one loop of it or the medians of several (:meth:`median`): the loop's
    seconds (rank 0's clock), the whole call's as the grader waits for it (the loop's, for
    gloo), and the CPU seconds the side used for it: every rank's process during the loop, and
    for the broker the grader's process (the broker's threads) during the whole call."""

    loop: float
    call: float
    cpu: float

    @classmethod
    def median(cls, timings: list[Timing]) -> Timing:
        """Each figure's median over ``timings``."""
        return cls(*(statistics.median(figures) for figures in zip(*timings, strict=True)))


def through_broker(
    work: Path, p: int, elements: int, iterations: int, repeats: int
) -> dict[bool, Timing]:
    """The ring through the broker, with the payloads kept in the call's record (True: as in
    the tests that read them) and without (False: as in performance tests)."""
    from grader import sandbox
    from grader.course.submission import stage
    from grader.launch.world import CallLimits, JobSettings, RankPool, World

    submission = work / "submission"
    submission.mkdir(exist_ok=True)
    (submission / "collectives.py").write_text(RING)
    import_dir = work / f"import{p}"
    stage(submission, import_dir)
    package = REPO / "grader"
    level = sandbox.detect("auto")
    settings = JobSettings(
        work_dir=work,
        import_dir=import_dir,
        sandbox=level.value,
        hidden=(REPO, Path.home()),
        readable=(package, import_dir, Path(sys.base_prefix), Path(sys.prefix)),
        pythonpath=str(REPO),
        memory_bytes=sandbox.DEFAULT_MEMORY,
    )
    pool = RankPool(p, settings)
    try:
        world = World(p, pool, CallLimits(timeout=600))
        import torch

        tensor = torch.ones(elements)
        timings = {}
        for keep in (True, False):
            world.call("collectives.ring", [(tensor, 2)] * p, keep_payloads=keep)  # warm-up
            loops, calls, cpus = [], [], []
            for _ in range(repeats):
                start, grader_cpu = time.monotonic(), time.process_time()
                done = world.call(
                    "collectives.ring", [(tensor, iterations)] * p, keep_payloads=keep
                )
                calls.append(time.monotonic() - start)
                ranks_cpu = sum(cpu for _, cpu in done.returned)
                cpus.append(ranks_cpu + time.process_time() - grader_cpu)
                loops.append(done.returned[0][0])
            timings[keep] = Timing.median(list(map(Timing, loops, calls, cpus)))
        return timings
    finally:
        pool.close()


def over_gloo(work: Path, p: int, elements: int, iterations: int, repeats: int) -> Timing:
    """The ring over gloo."""
    script = work / "gloo_ring.py"
    script.write_text(GLOO)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={p}",
         f"--log-dir={work / 'logs'}", str(script), str(elements), str(iterations), str(repeats)],
        capture_output=True, text=True, check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    loop = statistics.median(measured["seconds"])
    return Timing(loop, loop, statistics.median(measured["cpu"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--megabytes", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    elements = int(args.megabytes * 2**20 / 4)
    payload = elements * 4 * args.iterations  # bytes each rank receives
    cores = len(os.sched_getaffinity(0))

    def busy(cpu: float, seconds: float) -> float:
        """The share of this machine's cores that ``cpu`` seconds kept busy for ``seconds``."""
        return cpu / seconds / cores

    work = Path(tempfile.mkdtemp(prefix="grader-bench-"))
    work.chmod(0o711)
    try:
        print(f"{args.iterations} ring steps of {args.megabytes:g} MB messages, {cores} cores")
        for p in (2, 4):
            brokers, gloos = [], []
            for turn in range(args.rounds):
                place = work / f"p{p}-{turn}"
                place.mkdir(mode=0o711)
                brokers.append(through_broker(place, p, elements, args.iterations, args.repeats))
                gloos.append(over_gloo(place, p, elements, args.iterations, args.repeats))
            gloo = Timing.median(gloos)
            rounds = list(zip(gloos, brokers, strict=True))
            for keep, how in ((True, "payloads recorded"), (False, "payloads not recorded")):
                broker = Timing.median([b[keep] for b in brokers])
                ratio = statistics.median(g.loop / b[keep].loop for g, b in rounds)
                whole = statistics.median(g.loop / b[keep].call for g, b in rounds)
                print(
                    f"{p} ranks, {how:>21}: broker {payload / broker.loop / 1e6:8.1f} MB/s "
                    f"per rank, gloo {payload / gloo.loop / 1e6:8.1f} MB/s per rank: "
                    f"the broker at {ratio:.2f}x gloo's throughput "
                    f"({whole:.2f}x counting the whole call, {broker.call:.2f} s)"
                )
                print(
                    f"{p} ranks, {how:>21}: CPU a ring step, every process of the side: "
                    f"broker {broker.cpu / args.iterations * 1e3:5.2f} ms, "
                    f"gloo {gloo.cpu / args.iterations * 1e3:5.2f} ms "
                    f"(gloo's over the broker's: {gloo.cpu / broker.cpu:.2f}); "
                    f"the {cores} cores busy {busy(broker.cpu, broker.call):.0%} and "
                    f"{busy(gloo.cpu, gloo.loop):.0%}"
                )
            spread = ", ".join(f"{g.loop / b[False].loop:.2f}" for g, b in rounds)
            print(f"{p} ranks, payloads not recorded, each round's ratio: {spread}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
