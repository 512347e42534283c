"""The reference's communication against the classic lower bounds, for p = 2..8 ranks.

    python benchmarks/communication_bounds.py [--max-world-size 8]

Runs every reference collective through the broker (which counts every byte)
on 192 KB of float32 and prints, per collective and world size, the bytes
the busiest rank moved over the bound, and the rounds against ceil(log2 p).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

N = 49152  # elements (192 KB of float32): divisible by every p from 2 to 8


def main() -> None:
    from grader.judge.communication import bound_bytes, figures, min_rounds
    from grader.judge.reference_traces import build, key
    from grader.testkit.calls import COLLECTIVES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-world-size", type=int, default=8)
    args = parser.parse_args()
    sizes = range(2, args.max_world_size + 1)
    traces = build({p: {N} for p in sizes})
    print(f"{'collective':<15}{'p':>3}{'busiest/bound':>15}{'rounds':>8}{'>= log2 p':>11}")
    for p in sizes:
        for function in COLLECTIVES:
            result = figures(traces[key(function, p, N)])
            ratio = result.busiest_bytes / bound_bytes(function, p, N * 4)
            print(f"{function:<15}{p:>3}{ratio:>15.2f}{result.rounds:>8}{min_rounds(p):>11}")


if __name__ == "__main__":
    main()
