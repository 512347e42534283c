"""The ``grader`` command (documented in docs/commands.md).

    grader [--config FILE] run [PART ...] [--submission DIR] [--results FILE] [-k TEXT] ...
    grader [--config FILE] list [PART ...]
    grader [--config FILE] bench [-k TEXT] [--submission DIR]
    grader [--config FILE] gradescope OUT.zip
    grader [--config FILE] release OUT
    grader [--config FILE] batch SUBMISSIONS_DIR --out DIR [--jobs N] [--shard I/N] ...
    grader [--config FILE] batch --merge DIR [DIR ...] --out DIR

Exit status: 0 every graded test passed; 1 some test did not pass; 2 the
grader could not grade (bad arguments, bad configuration, no such directory).
Anything wrong with the input is one line on stderr, never a traceback.

The modules that grade are imported only once the configuration is chosen
(``--config``): they read the course's paths from :mod:`grader.config`, and
``grader --help`` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from grader import batch as batching
from grader import sandbox
from grader.config import CONFIG_ENV, ConfigError, GradingConfig, activate, find_config, load_config
from grader.submission import SubmissionError, resolve

if TYPE_CHECKING:
    from grader.catalog import GradedTest
    from grader.grading import GradingRun

EXIT_PASSED, EXIT_FAILED, EXIT_CANNOT_GRADE = 0, 1, 2
EXIT_INTERRUPTED = 130
# Not a terminal (a CI log, a pipe, a batch's grader.log): no window to fit, and a cell cut
# at rich's default 80 columns ("communication…") loses the very word a reader looks for.
LOG_WIDTH = 200


class _UsageError(Exception):
    pass


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _add_world_sizes(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument(
        "--world-size", dest="world_sizes", metavar="N", type=int, action="append", help=help
    )


def _parser() -> argparse.ArgumentParser:
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
    run.add_argument(
        "--sandbox",
        choices=("auto", "namespaces", "uid", "none"),
        default="auto",
        help="how the student's code is isolated (default: the strongest this machine allows)",
    )
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
    _add_world_sizes(batch, "passed to each grader run")
    batch.add_argument(
        "--merge", nargs="+", metavar="DIR", type=Path, help="join shards' OUT folders into --out"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    console = make_console()
    try:
        args, extra = _parser().parse_known_args(argv)
        if extra and (args.command != "batch" or any(e.startswith("-") for e in extra)):
            raise _UsageError(f"unrecognized arguments: {' '.join(extra)}")
        if extra:
            args.parts += extra  # batch's PARTs may follow its options (as in the sbatch recipe)
        activate(find_config(args.config))
        config = load_config()
        if args.command == "gradescope":
            from grader.gradescope import build_zip

            console.print(f"autograder zip written to {build_zip(config, args.output)}")
            return EXIT_PASSED
        if args.command == "release":
            from grader.release import build_release

            made = build_release(config, args.output)
            for name in made.partly_hidden:
                console.print(f"[yellow]warning[/]: {name} is released whole with hidden tests")
            left_out = f" (hidden, left out: {', '.join(made.left_out)})" if made.left_out else ""
            console.print(f"student release written to {made.path}{left_out}", highlight=False)
            return EXIT_PASSED
        parts = getattr(args, "parts", None) or list(config.parts)
        for part in parts:
            config.part(part)  # an unknown part is a usage error
        if args.command == "list":
            return _list(console, config, parts)
        modules = [f"{part}.py" for part in config.parts]
        if args.command == "bench":
            return _bench(console, args, modules)
        if args.command == "batch":
            return _batch(args, config, parts)
        from grader.catalog import collect
        from grader.report.results import ResultsPathError, check_writable

        submission = resolve(args.submission, modules)
        if args.backend == "nccl" and not _has_cuda():
            raise _UsageError("--backend nccl needs CUDA GPUs, and none is visible")
        if args.results is not None:
            try:
                check_writable(args.results)
            except ResultsPathError as err:
                raise _UsageError(str(err)) from err
        tests = select(collect(config, parts), args.keyword, args.world_sizes)
        sandbox.detect(args.sandbox)  # a level this machine cannot give is a usage error
    except (
        _UsageError,
        ConfigError,
        SubmissionError,
        sandbox.SandboxError,
        batching.BatchError,
    ) as err:
        print(f"grader: error: {err}", file=sys.stderr)
        return EXIT_CANNOT_GRADE
    if args.backend != "auto":
        os.environ["GRADER_DEVICE"] = "cuda" if args.backend == "nccl" else "cpu"
    return _run(console, config, tests, submission, args.sandbox, args.results, args.verbose)


def make_console() -> Console:
    """As wide as the terminal; LOG_WIDTH when stdout is not one (rich would assume 80)."""
    return Console(width=None if sys.stdout.isatty() else LOG_WIDTH)


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
    config: GradingConfig,
    tests: list[GradedTest],
    submission: Path,
    sandbox_request: str,
    results_file: Path | None,
    verbose: bool = False,
) -> int:
    from grader.grading import Listener, grade
    from grader.report.terminal import ProgressDisplay, print_summary

    start = time.monotonic()
    console.print(
        f"Grading [bold]{escape(str(submission))}[/] ({len(tests)} tests)", highlight=False
    )
    with _terminate_as_interrupt(), ProgressDisplay(console, len(tests)) as display:
        listener = Listener(display.on_start, display.on_verdict)
        run = grade(config, tests, submission, listener, sandbox_request)
    results, interrupted = run.results, run.interrupted
    seconds = time.monotonic() - start
    # The results file first: nothing that follows may lose it.
    if results_file is not None:
        status = _write(run, seconds, results_file, config)
        if status is not None:
            return status
    print_summary(console, results, seconds, run.sandbox, run.review, verbose)
    if run.grader_failure:
        print(f"grader: error: {run.grader_failure}", file=sys.stderr)
        return EXIT_CANNOT_GRADE
    if results_file is not None:
        console.print(f"results written to {escape(str(results_file))}", highlight=False)
    if interrupted:
        console.print("[bold red]interrupted[/]: every worker was stopped")
        return EXIT_INTERRUPTED
    return EXIT_PASSED if all(r.verdict.passed for r in results) else EXIT_FAILED


def _write(
    run: GradingRun, seconds: float, results_file: Path, config: GradingConfig
) -> int | None:
    from grader.report.results import student_summary, to_gradescope, write_results
    from grader.report.timeline import draw_failed_schedules

    try:
        results = draw_failed_schedules(run.results, results_file.parent)
        document = to_gradescope(
            results, seconds, student_summary(results), config.gradescope, run.sandbox, run.review
        )
        write_results(results_file, document)
    except OSError as err:
        print(f"grader: error: cannot write {results_file}: {err.strerror}", file=sys.stderr)
        return EXIT_CANNOT_GRADE
    return None


def _list(console: Console, config: GradingConfig, parts: list[str]) -> int:
    from grader.catalog import collect

    try:
        tests = collect(config, parts)
    except ConfigError as err:
        print(f"grader: error: {err}", file=sys.stderr)
        return EXIT_CANNOT_GRADE
    for part in parts:
        table = Table(title=Text(part, style="bold"), title_justify="left")
        for column in ("test", "target", "kind", "world sizes", "points each", "visibility"):
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
                test.settings.visibility,
            )
        total = sum(t.settings.points for t in tests if t.part == part)
        table.caption = f"{total:g} points in all"
        console.print(table)
    return EXIT_PASSED


def _bench(console: Console, args: argparse.Namespace, modules: list[str]) -> int:
    from grader.bench.runner import DEFAULT_SIZES, plot, print_tables, run_bench
    from grader.testkit.calls import COLLECTIVES

    if any(part != "collectives" for part in args.parts):
        raise _UsageError("grader bench measures the collectives part only")
    functions = [f for f in COLLECTIVES if args.keyword is None or args.keyword in f]
    if not functions:
        raise _UsageError(f"no collective matches -k {args.keyword}")
    sizes = [s for s in DEFAULT_SIZES if s <= args.max_bytes] or [args.max_bytes]
    submission = resolve(args.submission, modules)
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


def _batch(args: argparse.Namespace, config: GradingConfig, parts: list[str]) -> int:
    """Check the whole selection once, here, rather than fail it once per student."""
    from grader.catalog import collect

    if args.merge:
        if args.submissions is not None or args.parts or args.shard:
            raise _UsageError("--merge takes only shard folders and --out")
        return batching.merge(args.merge, args.out)
    if args.submissions is None:
        raise _UsageError("grader batch needs SUBMISSIONS_DIR (or --merge DIR ...)")
    shard = batching.parse_shard(args.shard or "0/1")
    if not args.submissions.is_dir():
        raise _UsageError(f"no such directory: {args.submissions}")
    select(collect(config, parts), args.keyword, args.world_sizes)
    run_args = [*args.parts, *(["-k", args.keyword] if args.keyword else [])]
    run_args += [f"--world-size={n}" for n in args.world_sizes or []]
    grader_args = ["--config", str(config.path.resolve())]  # every student graded by this course
    batch = batching.Batch(
        args.submissions,
        args.out,
        parts,
        run_args,
        grader_args,
        jobs=batching.usable_jobs(args.jobs),
        shard=shard,
        timeout=args.timeout,
    )
    with _terminate_as_interrupt():
        return batching.run_batch(batch)


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
