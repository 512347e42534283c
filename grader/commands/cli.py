"""The ``grader`` command (documented in docs/commands.md).

    grader [--config FILE] run [PART ...] [--submission DIR] [--results FILE] [-k TEXT] ...
    grader [--config FILE] run [PART ...] --watch [-k TEXT] ...
                               [--nnodes N --node-rank R --rdzv-endpoint HOST:PORT]
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
(``--config``): they read the course's paths from :mod:`grader.course.config`, and
``grader --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from grader import sandbox
from grader.commands import batch as batching
from grader.commands import interrupts
from grader.commands.options import UsageError, parser
from grader.course.config import ConfigError, GradingConfig, activate, find_config, load_config
from grader.course.submission import SubmissionError, resolve
from grader.device import Device, detect
from grader.launch import orphans, tmpdir
from grader.launch.workspace import Workspace
from grader.nodes import Nodes, NodesError

if TYPE_CHECKING:
    from grader.commands.grading import GradingRun, Session
    from grader.course.catalog import GradedTest

EXIT_PASSED, EXIT_FAILED, EXIT_CANNOT_GRADE = 0, 1, 2
EXIT_INTERRUPTED = 130
#: The ranks' device for each ``--backend`` (None: a GPU when there is one).
_BACKEND_DEVICE = {"auto": None, "gloo": Device.CPU, "nccl": Device.CUDA}
# Not a terminal (a CI log, a pipe, a batch's grader.log): no window to fit, and a cell cut
# at rich's default 80 columns ("communication…") loses the very word a reader looks for.
LOG_WIDTH = 200


def main(argv: list[str] | None = None) -> int:
    """The command line. SIGTERM ends every command as Ctrl-C does, from here on: what was
    started is ended, what was made is removed, and the exit status is 130.

    Everything the grader and its children make in the temporary directory (torch too,
    whose compiler makes a cache there as soon as an optimizer first steps) lies in one
    folder of this process's, removed when it exits; one that a killed grader left is
    removed here (:mod:`grader.launch.tmpdir`). What it starts and is orphaned becomes its
    child, and is ended before it exits (:mod:`grader.launch.orphans`)."""
    claim = None
    orphans.adopt()
    try:
        with interrupts.sigterm_is_ctrl_c():
            try:
                with interrupts.held():  # made and held at once: an interrupt finds both or neither
                    claim = tmpdir.Claim()
                return _main(argv)
            finally:
                with interrupts.held():  # removed whole, even if a signal comes
                    try:
                        orphans.end()
                    finally:
                        if claim is not None:
                            claim.release()
    except KeyboardInterrupt:  # before a command could stop what it started, or after
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None) -> int:
    console = make_console()
    try:
        args = _arguments(argv)
        activate(find_config(args.config))
        return _command(console, args, load_config())
    except (
        NodesError,
        UsageError,
        ConfigError,
        SubmissionError,
        sandbox.SandboxError,
        batching.BatchError,
    ) as err:
        print(f"grader: error: {err}", file=sys.stderr)
        return EXIT_CANNOT_GRADE
    except KeyboardInterrupt:  # before grading began
        console.print("[bold red]interrupted[/]: every worker was stopped")
        return EXIT_INTERRUPTED


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    args, extra = parser().parse_known_args(argv)
    if extra and (args.command != "batch" or any(e.startswith("-") for e in extra)):
        raise UsageError(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.parts += extra  # batch's PARTs may follow its options (as in the sbatch recipe)
    return args


def _command(console: Console, args: argparse.Namespace, config: GradingConfig) -> int:
    """Run the command ``args`` name, under ``config``; its exit status."""
    if args.command == "gradescope":
        from grader.commands.gradescope import build_zip

        console.print(f"autograder zip written to {build_zip(config, args.output)}")
        return EXIT_PASSED
    if args.command == "release":
        from grader.commands.release import build_release

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
        from grader.commands.listing import list_tests

        return list_tests(console, config, parts)
    if args.command == "doctor":
        from grader.commands.doctor import doctor

        level = doctor(console, config, sandbox.requested(args.sandbox))
        return EXIT_CANNOT_GRADE if level is None else EXIT_PASSED
    modules = [f"{part}.py" for part in config.parts]
    if args.command == "bench":
        from grader.commands.listing import bench

        return bench(console, args, modules)
    if args.command == "batch":
        return batching.command(args, config, parts)
    return _grade_run(console, args, config, parts, modules)


def _grade_run(
    console: Console,
    args: argparse.Namespace,
    config: GradingConfig,
    parts: list[str],
    modules: list[str],
) -> int:
    """``grader run``: check the arguments, settle the workspace (its first line says the
    level), then grade, watch, or serve a batch."""
    began = time.monotonic()  # the printed time counts the start-up
    nodes = Nodes.from_options(args.nnodes, args.node_rank, args.rdzv_endpoint)
    request = sandbox.requested(args.sandbox)  # $GRADER_SANDBOX too
    if nodes is not None and not nodes.head:
        return _lend(nodes, request)
    submission = resolve(args.submission, modules)
    _check_run(args, nodes)
    for_course = args.results is not None or args.batch_worker is not None
    with interrupts.after():  # torch's import, where there is a GPU it might use
        ranks_device = detect(_BACKEND_DEVICE[args.backend])
    workspace: Workspace | None = None
    session: Session | None = None
    try:
        # On a terminal, what the start-up does, from its first second; the first line
        # (the level, and why no stronger one) as soon as a rank has started at that level.
        with console.status("starting: a rank in the sandbox") as status:
            workspace = Workspace(config, request, for_course, ranks_device)
            if nodes is None:  # its torchrun and ranks import torch while this process does
                workspace.start(_first_job_size(config, parts, args.world_sizes))
                if args.batch_worker is None:
                    _header(console, submission, workspace)
            status.update("starting: importing torch, collecting the graded tests")
            with interrupts.after():  # torch's import
                from grader.commands.grading import Session
            session = Session(workspace, nodes, warm=args.watch)
            tests = _selected(args, config, parts, nodes)
        if args.watch:
            from grader.commands.watch import watch

            watch(console, session, tests, submission, args.verbose)
            return EXIT_INTERRUPTED  # watching ends only so
        if args.batch_worker is not None:
            return _serve(session, tests, args, modules)
        told = nodes is None
        return _run(console, session, tests, submission, args.results, args.verbose, began, told)
    except KeyboardInterrupt:  # before the grading began, or while its results were told
        console.print("[bold red]interrupted[/]: every worker was stopped")
        return EXIT_INTERRUPTED
    finally:
        if session is not None:
            session.close()
        if workspace is not None:
            workspace.close()


def _check_run(args: argparse.Namespace, nodes: Nodes | None) -> None:
    from grader.report.results import ResultsPathError, check_writable

    if args.backend == "nccl" and not _has_cuda():
        raise UsageError("--backend nccl needs CUDA GPUs, and none is visible")
    if args.results is not None:
        try:
            check_writable(args.results)
        except ResultsPathError as err:
            raise UsageError(str(err)) from err
    alone = (args.watch, args.batch_worker is not None, args.results is not None, nodes)
    if (args.watch or args.batch_worker is not None) and sum(map(bool, alone)) > 1:
        raise UsageError("--watch grades for the terminal: not with --results or --nnodes")


def _selected(
    args: argparse.Namespace, config: GradingConfig, parts: list[str], nodes: Nodes | None
) -> list[GradedTest]:
    """Collect and select the tests."""
    from grader.course.catalog import collect

    with interrupts.after():  # pytest takes an interrupt for its own failure
        collected = collect(config, parts)
    tests = select(collected, args.keyword, args.world_sizes)
    if nodes is not None:
        nodes.per_node(max(t.world_size for t in tests))
    return tests


def _serve(
    session: Session, tests: list[GradedTest], args: argparse.Namespace, modules: list[str]
) -> int:
    """A batch's worker: grade each student it is sent (:mod:`grader.commands.worker`)."""
    from grader.commands.worker import serve

    def grade(submission: Path, results: Path) -> int:
        console = make_console()
        return _run(console, session, tests, submission, results, args.verbose, time.monotonic())

    return serve(sys.stdin, args.batch_worker, session.workspace, grade, modules)


def _header(console: Console, submission: Path, workspace: Workspace, count: str = "") -> None:
    """The first line: what is graded, and the level that isolates it and why."""
    console.print(
        f"Grading [bold]{escape(str(submission))}[/]{count}" + escape(_level_line(workspace)),
        highlight=False,
    )


def _level_line(workspace: Workspace) -> str:
    """What isolates the student's code, and why no stronger level, where it is known."""
    if workspace.level is None:  # across nodes: each node's, told at the end
        return ""
    refused = "; ".join(f"{lv.value}: {why}" for lv, why in workspace.refused.items())
    return f", sandbox {workspace.level.value}" + (f" ({refused})" if refused else "")


def _first_job_size(config: GradingConfig, parts: list[str], world_sizes: list[int] | None) -> int:
    """The ranks the run's first job needs, known before the tests are collected: the
    largest world size of the parts, or of ``--world-size`` if smaller. The workspace starts
    that job at once: its ranks import torch while this process imports it and collects the
    tests."""
    largest = max(config.part(part).largest_world_size() for part in parts)
    return min(largest, max(world_sizes or [largest]))


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
        raise UsageError("no graded test matches the selection (-k / --world-size)")
    return kept


def _run(
    console: Console,
    session: Session,
    tests: list[GradedTest],
    submission: Path,
    results_file: Path | None,
    verbose: bool = False,
    start: float | None = None,
    told: bool = False,
) -> int:
    """Grade and tell: the time printed is from ``start`` (default: now); ``told``: the
    first line was printed already."""
    from grader.commands.grading import Listener
    from grader.report.terminal import ProgressDisplay, print_summary

    start = time.monotonic() if start is None else start
    if not told:
        _header(console, submission, session.workspace, f" ({len(tests)} tests)")
    with ProgressDisplay(console, len(tests)) as display:
        listener = Listener(display.on_start, display.on_verdict)
        run = session.grade(tests, submission, listener)
    results, interrupted = run.results, run.interrupted
    seconds = time.monotonic() - start
    # The results file first: nothing that follows may lose it.
    if results_file is not None:
        status = _write(run, seconds, results_file, session.config)
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
    from grader.report.ring import draw_failed_rings
    from grader.report.timeline import draw_failed_schedules

    try:
        results = draw_failed_schedules(run.results, results_file.parent)
        results = draw_failed_rings(results, results_file.parent)
        document = to_gradescope(
            results,
            seconds,
            student_summary(results),
            config.gradescope,
            run.sandbox,
            run.review,
            run.sandbox_per_node,
        )
        write_results(results_file, document)
    except OSError as err:
        print(f"grader: error: cannot write {results_file}: {err.strerror}", file=sys.stderr)
        return EXIT_CANNOT_GRADE
    return None


def _lend(nodes: Nodes, sandbox_request: sandbox.Level | None) -> int:
    """A node other than node 0: lend ranks to node 0's jobs until grading is over."""
    with interrupts.after():  # torch's import
        from grader.nodes.lend import lend_ranks

    try:
        return lend_ranks(nodes, sandbox_request)
    except KeyboardInterrupt:
        print(f"node {nodes.rank}: interrupted: every worker was stopped", file=sys.stderr)
        return EXIT_INTERRUPTED


def _has_cuda() -> bool:
    with interrupts.after():
        import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
