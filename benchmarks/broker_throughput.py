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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RING = '''
import time
import torch
import torch.distributed as dist


def ring(tensor, iterations):
    """Send to the next rank, receive from the previous, ``iterations`` times."""
    rank, p = dist.get_rank(), dist.get_world_size()
    incoming = torch.empty_like(tensor)
    start = time.perf_counter()
    for _ in range(iterations):
        requests = [dist.isend(tensor, (rank + 1) % p), dist.irecv(incoming, (rank - 1) % p)]
        for request in requests:
            request.wait()
    return time.perf_counter() - start
'''

GLOO = (
    RING
    + """
if __name__ == "__main__":
    import json, os, sys
    dist.init_process_group("gloo")
    tensor = torch.ones(int(sys.argv[1]))
    ring(tensor, 2)  # warm-up
    seconds = [ring(tensor, int(sys.argv[2])) for _ in range(int(sys.argv[3]))]
    if dist.get_rank() == 0:
        print(json.dumps({"seconds": seconds}))
    dist.destroy_process_group()
"""
)


def through_broker(
    work: Path, p: int, elements: int, iterations: int, repeats: int
) -> dict[bool, tuple[float, float]]:
    """Median seconds of the ring through the broker, the loop alone (rank 0's clock) and the
    whole call (the grader's), with the payloads kept in the call's record (True: as in the tests
    that read them) and without (False: as in performance tests)."""
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
        seconds = {}
        for keep in (True, False):
            world.call("collectives.ring", [(tensor, 2)] * p, keep_payloads=keep)  # warm-up
            loops, calls = [], []
            for _ in range(repeats):
                start = time.monotonic()
                done = world.call(
                    "collectives.ring", [(tensor, iterations)] * p, keep_payloads=keep
                )
                calls.append(time.monotonic() - start)
                loops.append(done.returned[0])
            seconds[keep] = (statistics.median(loops), statistics.median(calls))
        return seconds
    finally:
        pool.close()


def over_gloo(work: Path, p: int, elements: int, iterations: int, repeats: int) -> float:
    """Median seconds of the ring over gloo (rank 0's clock, the loop alone)."""
    script = work / "gloo_ring.py"
    script.write_text(GLOO)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={p}",
         f"--log-dir={work / 'logs'}", str(script), str(elements), str(iterations), str(repeats)],
        capture_output=True, text=True, check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    return statistics.median(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--megabytes", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    elements = int(args.megabytes * 2**20 / 4)
    payload = elements * 4 * args.iterations  # bytes each rank receives
    work = Path(tempfile.mkdtemp(prefix="grader-bench-"))
    work.chmod(0o711)
    try:
        print(f"{args.iterations} ring steps of {args.megabytes:g} MB messages")
        for p in (2, 4):
            brokers, gloos = [], []
            for turn in range(args.rounds):
                place = work / f"p{p}-{turn}"
                place.mkdir(mode=0o711)
                brokers.append(through_broker(place, p, elements, args.iterations, args.repeats))
                gloos.append(over_gloo(place, p, elements, args.iterations, args.repeats))
            gloo = statistics.median(gloos)
            rounds = list(zip(gloos, brokers, strict=True))
            for keep, how in ((True, "payloads recorded"), (False, "payloads not recorded")):
                loop = statistics.median(b[keep][0] for b in brokers)
                call = statistics.median(b[keep][1] for b in brokers)
                ratio = statistics.median(g / b[keep][0] for g, b in rounds)
                whole = statistics.median(g / b[keep][1] for g, b in rounds)
                print(
                    f"{p} ranks, {how:>21}: broker {payload / loop / 1e6:8.1f} MB/s "
                    f"per rank, gloo {payload / gloo / 1e6:8.1f} MB/s per rank: "
                    f"the broker at {ratio:.2f}x gloo's throughput "
                    f"({whole:.2f}x counting the whole call, {call:.2f} s)"
                )
            spread = ", ".join(f"{g / b[False][0]:.2f}" for g, b in rounds)
            print(f"{p} ranks, payloads not recorded, each round's ratio: {spread}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
