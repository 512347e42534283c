"""The reference's ring all-reduce against torch.distributed.all_reduce, side by side.

    python benchmarks/all_reduce_vs_torch.py [--world-size 4] [--megabytes 16] [--pairs 15]

One torchrun job alternates the two (reference first, then torch first, and
so on) on the same float32 tensor, each call after a barrier; an iteration
lasts as long as its slowest rank; the figure is the median of the paired
ratios reference / torch (wall-clock over gloo: the performance tests replay message
patterns instead, see grader/testkit/costs.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path


def worker(megabytes: int, pairs: int) -> None:
    import torch
    import torch.distributed as dist

    import reference.collectives as reference
    from grader.bench.timing import time_call

    dist.init_process_group("gloo")
    tensor = torch.randn(megabytes * (1 << 20) // 4)
    calls = {
        "reference": lambda: reference.all_reduce(tensor),
        "torch": lambda: dist.all_reduce(tensor),
    }
    times: dict[str, list[float]] = {"reference": [], "torch": []}
    for i in range(pairs + 2):
        for name in ("reference", "torch") if i % 2 == 0 else ("torch", "reference"):
            dist.barrier()
            times[name].append(time_call(calls[name], torch.device("cpu")))
    slowest = {name: torch.tensor(t[2:], dtype=torch.float64) for name, t in times.items()}
    for t in slowest.values():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        ratios = (slowest["reference"] / slowest["torch"]).tolist()
        print(
            f"all_reduce of {megabytes} MB on {dist.get_world_size()} ranks: "
            f"reference {statistics.median(slowest['reference'].tolist()) * 1e3:.1f} ms, "
            f"torch {statistics.median(slowest['torch'].tolist()) * 1e3:.1f} ms, "
            f"median paired ratio {statistics.median(ratios):.2f} ({pairs} pairs)",
            flush=True,
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--megabytes", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=15)
    args = parser.parse_args()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.world_size}",
            "--log-dir=/tmp/all_reduce_vs_torch",
            __file__,
            "--worker",
            str(args.megabytes),
            str(args.pairs),
        ],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        },
    )
    print("\n".join(line for line in done.stdout.splitlines() if "all_reduce of" in line))
    if done.returncode:
        print(done.stderr[-2000:], file=sys.stderr)
        sys.exit(done.returncode)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
