"""The reference's communication against the classic bounds, at world sizes 2 to 8.

    python benchmarks/communication_bounds.py [--max-world-size 8]

For each world size, one torchrun job calls every reference collective once on
n = 840 * 1024 float32 elements (divisible by 1..8) with the grader's message
log on, and this script prints, per collective, the bytes moved by the busiest
rank over the bound, and the rounds beside ceil(log2 p). Deterministic: the
same figures on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

N = 840 * 1024


def worker(out_dir: Path) -> None:
    import torch.distributed as dist

    import reference.collectives as reference
    from grader.rank import p2p
    from grader.rank.accounting import recording
    from grader.testkit.calls import COLLECTIVES, collective_call

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    p2p.install(out_dir / f"waiting{rank}")
    dist.init_process_group("gloo")
    logs = {}
    for function in COLLECTIVES:
        call = collective_call(reference, function, rank, world_size, N)
        with recording() as log:
            call()
        logs[function] = log.messages()
        dist.barrier()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(logs))
    dist.destroy_process_group()


def main() -> None:
    from grader.judge.communication import bound_bytes, figures, min_rounds
    from grader.testkit.calls import COLLECTIVES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-world-size", type=int, default=8)
    args = parser.parse_args()
    print(f"{'collective':<15}{'p':>3}{'busiest/bound':>15}{'rounds':>8}{'>= log2 p':>11}")
    for world_size in range(2, args.max_world_size + 1):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={world_size}",
                    f"--log-dir={out / 'logs'}",
                    __file__,
                    "--worker",
                    str(out),
                ],
                check=True,
                capture_output=True,
                env={
                    **os.environ,
                    "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
                },
            )
            per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
        for function in COLLECTIVES:
            result = figures([logs[function] for logs in per_rank])
            ratio = result.busiest_bytes / bound_bytes(function, world_size, N * 4)
            print(
                f"{function:<15}{world_size:>3}{ratio:>15.2f}{result.rounds:>8}"
                f"{min_rounds(world_size):>11}"
            )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        worker(Path(sys.argv[2]))
    else:
        main()
