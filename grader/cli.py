"""The ``grader`` command (CONTRACT section 3).

    grader run [PART ...] [--submission DIR] [--results FILE] [--backend auto|gloo|nccl]
    grader list [PART ...]

Exit status: 0 every graded test passed; 1 some test did not pass; 2 the
grader could not grade (bad arguments, bad configuration, no such directory).
Anything wrong with the input is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from grader.bench.runner import DEFAULT_SIZES, plot, print_tables, run_bench
from grader.catalog import GradedTest, collect
from grader.config import DEFAULT_CONFIG, ConfigError, load_config
from grader.grading import Listener, grade
from grader.report.results import GradedResult, to_gradescope, write_results
from grader.report.terminal import ProgressDisplay, print_summary
from grader.report.timeline import draw_failed_schedules
from grader.submission import SubmissionError, resolve
from grader.testkit.calls import COLLECTIVES

EXIT_PASSED, EXIT_FAILED, EXIT_CANNOT_GRADE = 0, 1, 2
EXIT_INTERRUPTED = 130


class _UsageError(Exception):
    pass


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="grader", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="grade a submission")
    run.add_argument("parts", nargs="*", metavar="PART", help="parts to grade (default: all)")
    run.add_argument("--submission", metavar="DIR", help="default: the repository's assignments/")
    run.add_argument("--results", metavar="FILE", type=Path, help="write results.json here")
    run.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    run.add_argument(
        "-k",
        dest="keyword",
        metavar="TEXT",
        help="grade only the tests whose name contains TEXT (e.g. -k all_reduce)",
    )
    run.add_argument(
        "--world-size",
        dest="world_sizes",
        metavar="N",
        type=int,
        action="append",
        help="grade only at world size N (repeatable)",
    )
    bench = commands.add_parser(
        "bench",
        help="sweep message and world sizes: yours, the reference's and torch's collectives",
    )
    bench.add_argument("parts", nargs="*", metavar="PART", help="only 'collectives' is benchmarked")
    bench.add_argument("--submission", metavar="DIR", help="default: the repository's assignments/")
    bench.add_argument(
        "-k", dest="keyword", metavar="TEXT", help="only collectives containing TEXT"
    )
    bench.add_argument(
        "--world-size",
        dest="world_sizes",
        metavar="N",
        type=int,
        action="append",
        help="world sizes to sweep (repeatable; default: 2 and 4)",
    )
    bench.add_argument(
        "--max-bytes", type=int, default=64 << 20, help="largest message (default: 64 MiB)"
    )
    bench.add_argument("--iterations", type=int, default=3, help="timed calls per point")
    bench.add_argument(
        "--output", type=Path, default=Path("bench-collectives.png"), help="where the plot goes"
    )
    listing = commands.add_parser("list", help="list the parts, their tests and points")
    listing.add_argument("parts", nargs="*", metavar="PART")
    return parser


def main(argv: list[str] | None = None) -> int:
    console = Console(stderr=False)
    try:
        args = _parser().parse_args(argv)
        config = load_config(args.config)
        parts = args.parts or list(config.parts)
        for part in parts:
            config.part(part)  # an unknown part is a usage error
        if args.command == "list":
            return _list(console, config, parts)
        if args.command == "bench":
            return _bench(console, args)
        submission = resolve(args.submission)
        if args.backend == "nccl" and not _has_cuda():
            raise _UsageError("--backend nccl needs CUDA GPUs, and none is visible")
        tests = select(collect(config, parts), args.keyword, args.world_sizes)
    except (_UsageError, ConfigError, SubmissionError) as err:
        print(f"grader: error: {err}", file=sys.stderr)
        return EXIT_CANNOT_GRADE
    return _run(console, tests, submission, args.backend, args.results)


def select(
    tests: list[GradedTest], keyword: str | None, world_sizes: list[int] | None
) -> list[GradedTest]:
    """The tests ``-k`` and ``--world-size`` keep; keeping none is a usage error."""
    kept = [
        t
        for t in tests
        if (keyword is None or keyword in t.name)
        and (not world_sizes or t.world_size in world_sizes)
    ]
    if not kept:
        raise _UsageError("no graded test matches the selection (-k / --world-size)")
    return kept


def _run(
    console: Console,
    tests: list[GradedTest],
    submission: Path,
    backend: str,
    results_file: Path | None,
) -> int:
    start = time.monotonic()
    console.print(
        f"Grading [bold]{escape(str(submission))}[/] ({len(tests)} tests)", highlight=False
    )
    with _terminate_as_interrupt(), ProgressDisplay(console, len(tests)) as display:
        listener = Listener(display.on_start, display.on_verdict)
        results, interrupted = grade(tests, submission, backend, listener)
    seconds = time.monotonic() - start
    # The results file first: nothing that follows may lose it.
    if results_file is not None:
        status = _write(results, seconds, results_file)
        if status is not None:
            return status
    print_summary(console, results, seconds)
    failures = [r.verdict.message for r in results if r.verdict.extra.get("grader_failure")]
    if failures:
        print(f"grader: error: {failures[0]}", file=sys.stderr)
        return EXIT_CANNOT_GRADE
    if results_file is not None:
        console.print(f"results written to {escape(str(results_file))}", highlight=False)
    if interrupted:
        console.print("[bold red]interrupted[/]: every worker was stopped")
        return EXIT_INTERRUPTED
    return EXIT_PASSED if all(r.verdict.passed for r in results) else EXIT_FAILED


def _write(results: list[GradedResult], seconds: float, results_file: Path) -> int | None:
    total = sum(r.score for r in results)
    maximum = sum(r.max_score for r in results)
    passed = sum(r.verdict.passed for r in results)
    summary = f"{total:g} / {maximum:g} points; {passed} of {len(results)} tests passed"
    try:
        draw_failed_schedules(results, results_file.parent)
        write_results(results_file, to_gradescope(results, seconds, summary))
    except OSError as err:
        print(f"grader: error: cannot write {results_file}: {err.strerror}", file=sys.stderr)
        return EXIT_CANNOT_GRADE
    return None


def _list(console: Console, config, parts: list[str]) -> int:
    try:
        tests = collect(config, parts)
    except ConfigError as err:
        print(f"grader: error: {err}", file=sys.stderr)
        return EXIT_CANNOT_GRADE
    for part in parts:
        table = Table(title=Text(part, style="bold"), title_justify="left")
        for column in ("test", "target", "kind", "world sizes", "points each"):
            table.add_column(column)
        seen: dict[str, list[int]] = {}
        rows = {}
        for test in (t for t in tests if t.part == part):
            seen.setdefault(test.name, []).append(test.world_size)
            rows[test.name] = test
        for name, sizes in seen.items():
            test = rows[name]
            table.add_row(
                Text(name),
                Text(test.target),
                test.kind,
                ", ".join(map(str, sizes)),
                f"{test.settings.points:g}",
            )
        total = sum(t.settings.points for t in tests if t.part == part)
        table.caption = f"{total:g} points in all"
        console.print(table)
    return EXIT_PASSED


def _bench(console: Console, args: argparse.Namespace) -> int:
    if any(part != "collectives" for part in args.parts):
        raise _UsageError("grader bench measures the collectives part only")
    functions = [f for f in COLLECTIVES if args.keyword is None or args.keyword in f]
    if not functions:
        raise _UsageError(f"no collective matches -k {args.keyword}")
    sizes = [s for s in DEFAULT_SIZES if s <= args.max_bytes] or [args.max_bytes]
    submission = resolve(args.submission)
    try:
        with _terminate_as_interrupt():
            results = run_bench(
                console,
                submission,
                functions,
                args.world_sizes or [2, 4],
                sizes,
                max(1, args.iterations),
            )
    except KeyboardInterrupt:
        console.print("[bold red]interrupted[/]: every worker was stopped")
        return EXIT_INTERRUPTED
    print_tables(console, results)
    if any(r.records for r in results):
        console.print(f"bus bandwidth plotted in {plot(results, args.output)}", highlight=False)
    return EXIT_PASSED if not any(r.problem for r in results) else EXIT_FAILED


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM ends a run the way Ctrl-C does: every job killed, what was graded kept."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
