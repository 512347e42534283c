"""Every option of the ``grader`` command, in one place (documented in docs/commands.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from grader.course.config import CONFIG_ENV


class UsageError(Exception):
    """Bad arguments: one line on stderr, exit status 2."""


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _add_world_sizes(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument(
        "--world-size", dest="world_sizes", metavar="N", type=int, action="append", help=help
    )


def _add_sandbox(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--sandbox",
        choices=("auto", "namespaces", "uid", "none"),
        default="auto",
        help="how the student's code is isolated (default: the strongest this machine allows)",
    )


def parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog="grader",
        description="Grade distributed-training assignments with real multi-process jobs.",
        epilog="exit status: 0 every graded test passed, 1 some test did not, "
        "2 the grader could not grade, 130 interrupted",
    )
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help=f"the grading configuration (default: ${CONFIG_ENV}, else the nearest "
        "tests/graded/grading.yaml from the current directory upward, else the one next to "
        "the installed package)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _add_run(commands)
    _add_bench(commands)
    _add_course_commands(commands)
    _add_batch(commands)
    return parser


Commands = argparse._SubParsersAction


def _add_run(commands: Commands) -> None:
    run = commands.add_parser("run", help="grade a submission")
    run.add_argument("parts", nargs="*", metavar="PART", help="parts to grade (default: all)")
    run.add_argument("--submission", metavar="DIR", help="default: the repository's assignments/")
    run.add_argument(
        "--results",
        metavar="FILE",
        type=Path,
        help="write results.json (Gradescope's format, mode 0644) here; its folder must exist",
    )
    run.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="where the ranks keep their tensors: nccl = each rank's GPU, gloo = the CPU, "
        "auto = a GPU when there is one (messages always pass through the grader's broker)",
    )
    _add_sandbox(run)
    run.add_argument(
        "-k",
        dest="keyword",
        metavar="TEXT",
        help="grade only the tests whose name contains TEXT, as `grader list` shows them: "
        "-k all_reduce (its correctness and cost tests), -k communication[all_reduce] (one)",
    )
    run.add_argument(
        "--verbose",
        action="store_true",
        help="print every test's row, and every failure, not only the first of each function",
    )
    _add_world_sizes(run, "grade only at world size N (repeatable)")
    run.add_argument(
        "--watch",
        action="store_true",
        help="regrade the selection each time a file of the submission changes (Ctrl-C stops)",
    )
    # grader batch's own: grade the students it sends on stdin (grader.commands.worker)
    run.add_argument("--batch-worker", type=int, metavar="FD", help=argparse.SUPPRESS)
    across = run.add_argument_group(
        "a job across nodes (torchrun's c10d rendezvous; the same command on every node)"
    )
    across.add_argument("--nnodes", type=int, metavar="N", help="nodes the job spans")
    across.add_argument(
        "--node-rank",
        type=int,
        metavar="R",
        help="this node: 0 grades and writes the results, the others lend it their ranks",
    )
    across.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT", help="node 0's address, and a free port there"
    )


def _add_bench(commands: Commands) -> None:
    bench = commands.add_parser(
        "bench",
        help="sweep message and world sizes: yours, the reference's and torch's collectives",
    )
    bench.add_argument("parts", nargs="*", metavar="PART", help="only 'collectives' is benchmarked")
    bench.add_argument("--submission", metavar="DIR", help="default: the repository's assignments/")
    bench.add_argument(
        "-k", dest="keyword", metavar="TEXT", help="only collectives containing TEXT"
    )
    _add_world_sizes(bench, "world sizes to sweep (repeatable; default: 2 and 4)")
    bench.add_argument(
        "--max-bytes", type=int, default=64 << 20, help="largest message (default: 64 MiB)"
    )
    bench.add_argument("--iterations", type=int, default=3, help="timed calls per point")
    bench.add_argument(
        "--output", type=Path, default=Path("bench-collectives.png"), help="where the plot goes"
    )


def _add_course_commands(commands: Commands) -> None:
    """``doctor``, ``list``, ``gradescope`` and ``release``: what an instructor runs."""
    doctor = commands.add_parser(
        "doctor", help="the sandbox levels this machine offers, and what fixes the others"
    )
    _add_sandbox(doctor)
    listing = commands.add_parser(
        "list", help="list the parts, their tests, points and Gradescope visibility"
    )
    listing.add_argument("parts", nargs="*", metavar="PART")
    zipped = commands.add_parser(
        "gradescope", help="build Gradescope's autograder zip (setup.sh, run_autograder, source)"
    )
    zipped.add_argument("output", metavar="OUT.zip", type=Path)
    release = commands.add_parser(
        "release", help="write the repository students get: no reference, no hidden tests"
    )
    release.add_argument("output", metavar="OUT", type=Path, help="a folder absent or empty")


def _add_batch(commands: Commands) -> None:
    batch = commands.add_parser(
        "batch", help="grade every student's folder into OUT/<student>/ and OUT/gradebook.csv"
    )
    batch.add_argument(
        "submissions", nargs="?", metavar="SUBMISSIONS_DIR", type=Path, help="a folder per student"
    )
    batch.add_argument("parts", nargs="*", metavar="PART", help="parts to grade (default: all)")
    batch.add_argument("--out", metavar="DIR", type=Path, required=True, help="results go here")
    batch.add_argument("--jobs", metavar="N", type=int, default=1, help="students side by side")
    batch.add_argument("--shard", metavar="I/N", help="only the students whose index is I mod N")
    batch.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=1800,
        help="one student's limit (default 1800)",
    )
    batch.add_argument("-k", dest="keyword", metavar="TEXT", help="passed to each grader run")
    _add_sandbox(batch)
    _add_world_sizes(batch, "passed to each grader run")
    batch.add_argument(
        "--merge", nargs="+", metavar="DIR", type=Path, help="join shards' OUT folders into --out"
    )
