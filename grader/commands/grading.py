"""One grading run: the selected graded tests, run in this process, driving sandboxed ranks.

Parts that cannot run at all (a missing or syntactically broken file) get
their verdicts here, without a job. The rest run under pytest in this very
process, with :class:`GradingPlugin`: the graded tests make the inputs from
the secret seed, drive the ranks through the broker, and are judged here.
Nothing the ranks do can make a verdict; whatever happens, every selected
test ends with one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from grader import protocol
from grader.commands import interrupts
from grader.course import config as course
from grader.course.catalog import GradedTest, WorldSizes, graded_pytest
from grader.course.config import TIMED, GradingConfig
from grader.course.secret import secret
from grader.course.submission import problem_with, stage
from grader.device import Device
from grader.failures import Cause
from grader.judge.audit import audit
from grader.judge.plugin import GradingPlugin
from grader.judge.verdict import Verdict
from grader.launch.job import JobSettings, job_settings
from grader.launch.workspace import UNSANDBOXED, Workspace
from grader.launch.world import RankPool
from grader.nodes import Nodes, NodesError, node_key, pack_folder
from grader.nodes.head import Head
from grader.report.results import GradedResult
from grader.sandbox import Level
from grader.sandbox.identity import Identity
from grader.testkit import data
from grader.wire import Frame

_BROKEN = (
    pytest.ExitCode.USAGE_ERROR,
    pytest.ExitCode.INTERNAL_ERROR,
    pytest.ExitCode.NO_TESTS_COLLECTED,
)


@dataclass
class Listener:
    """What the terminal wants to hear while grading runs."""

    on_start: Callable[[GradedTest], None] = lambda test: None
    on_verdict: Callable[[GradedTest, Verdict], None] = lambda test, verdict: None


@dataclass
class GradingRun:
    results: list[GradedResult]
    interrupted: bool
    sandbox: Level  # the level that isolated the student's code
    grader_failure: str | None = None
    review: list[str] = field(default_factory=list)  # constructs a TA should look at
    sandbox_per_node: list[Level] = field(default_factory=list)  # across nodes: node 0 first


class Session:
    """What the gradings of one run share: its workspace (work folder, sandbox level, uids:
    :class:`grader.launch.workspace.Workspace`) and the reference's job. ``grader run``
    grades once; watch mode grades every edit in one session, each time on a fresh job of
    ranks (nothing of one grading is left for the next), which it starts ahead (``warm``),
    while the student edits. The first grading's job is the one the workspace started,
    if it did.
    """

    def __init__(self, workspace: Workspace, nodes: Nodes | None = None, warm: bool = False):
        # The graded tests' own tensors (inputs, expected values, comparisons) on one thread,
        # as the ranks' are: a second one spins after each parallel operation, on a CPU the
        # ranks need (4.6 s of CPU in a whole grading of the reference on 2 cores).
        torch.set_num_threads(1)
        self.workspace, self.config = workspace, workspace.config
        self.nodes, self.warm = nodes, warm
        self._reference: RankPool | None = None
        self._next: RankPool | None = None  # the next grading's job, started ahead
        launched = workspace.started
        if launched is not None:  # held by both a moment: ending a job twice is harmless
            self._next = RankPool(launched.job.per_node, workspace.settings(), launched)
            workspace.started = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End every job; idempotent. The workspace is its maker's to close."""
        for pool in (self._next, self._reference):
            if pool is not None:
                pool.close()
        self._next = self._reference = None

    def grade(self, tests: list[GradedTest], submission: Path, listener: Listener) -> GradingRun:
        """Grade ``tests``: one result per test, in their order. On Ctrl-C or SIGTERM, every
        job is killed and the tests not yet judged are reported as not run."""
        verdicts: dict[str, Verdict] = {}

        def record(test: GradedTest, verdict: Verdict) -> None:
            verdicts[test.nodeid] = verdict
            listener.on_verdict(test, verdict)

        interrupted, failure, review, per_node = False, None, [], []
        try:
            import_dir = self.workspace.work / "import"
            shutil.rmtree(import_dir / "assignments", ignore_errors=True)  # the last grading's
            left_out = stage(submission, import_dir)
            staged = import_dir / "assignments"
            review = [f"left out of the submission: {line}" for line in left_out] + audit(staged)
            level = self.workspace.chosen_level()
            if level is Level.NONE and self.workspace.for_course:
                review.insert(0, UNSANDBOXED)
            parts = dict.fromkeys(t.part for t in tests)
            problems = {part: problem_with(staged, part) for part in parts}
            runnable = []
            for test in tests:
                problem = problems[test.part]
                if problem is None:
                    runnable.append(test)
                else:
                    outcome, message, cause = problem
                    record(test, Verdict(outcome, message, cause=cause))
            if runnable:
                interrupted, failure = self._run(runnable, listener.on_start, record, per_node)
        except KeyboardInterrupt:
            interrupted = True
        for test in tests:
            if test.nodeid not in verdicts:
                reason = "grading was interrupted" if interrupted else "the grader stopped early"
                verdicts[test.nodeid] = Verdict(
                    protocol.NOT_RUN, f"not run: {reason}", cause=Cause.NOT_RUN
                )
        results = [
            GradedResult(t, v := verdicts[t.nodeid], t.settings.points * v.share()) for t in tests
        ]
        chosen = self.workspace.level
        level = chosen if chosen is not None else Level.NONE
        return GradingRun(results, interrupted, level, failure, review, per_node)

    def _run(
        self,
        tests: list[GradedTest],
        on_start: Callable[[GradedTest], None],
        on_verdict: Callable[[GradedTest, Verdict], None],
        per_node: list[Level],
    ) -> tuple[bool, str | None]:
        """Run the tests; across nodes, ``per_node`` gets the sandbox level each node applied."""
        settings = self.workspace.settings()
        data.configure(secret(), _digest(settings.import_dir))
        head = None
        if self.nodes is not None:
            level = settings.level
            try:
                head = _start_head(self.nodes, tests, settings.import_dir, level, settings.device)
            except NodesError as err:
                return False, str(err)
            settings = dataclasses.replace(settings, head=head)
        size = max(t.world_size for t in tests)
        pool, self._next = self._next, None
        if pool is None or pool.size < size:
            if pool is not None:
                pool.close()
            pool = RankPool(size, settings)
        pool.start_ahead()  # its ranks import torch while pytest collects the graded tests
        reference = self._reference_pool(settings, size)
        if reference is not None and any(t.kind == TIMED for t in tests):
            # Else the first timed test waits for its torch imports; not before the
            # submission's ranks have theirs, which the first test waits for.
            pool.when_started(reference.start_ahead)
        try:
            outcome = _run_tests(self.config, tests, pool, reference, on_start, on_verdict)
        finally:
            pool.close()  # it ran the submission: never used again
            if head is not None:
                head.finish()
                per_node += [level, *(head.levels[n] for n in sorted(head.levels))]
        if self.warm:
            identity = self.workspace.identity
            if identity is not None:  # what the uids left in /tmp is not the next's
                identity.clear()
            self._next = RankPool(pool.size, settings)
            self._next.start_ahead()
        return outcome

    def _reference_pool(self, settings: JobSettings, size: int) -> RankPool | None:
        """The reference's job, kept for the whole session (started ahead when timed tests are
        selected, else at its first use)."""
        if self._reference is not None and self._reference.size < size:
            self._reference.close()
            self._reference = None
        if self._reference is None:
            reference = _reference_job(self.config, settings, self.workspace.reference_identity)
            if reference is not None:
                self._reference = RankPool(size, reference)
        return self._reference


def _run_tests(
    config: GradingConfig,
    tests: list[GradedTest],
    pool: RankPool,
    reference: RankPool | None,
    on_start: Callable[[GradedTest], None],
    on_verdict: Callable[[GradedTest, Verdict], None],
) -> tuple[bool, str | None]:
    plugin = GradingPlugin(tests, pool, on_start, on_verdict, reference)
    files = [str(course.GRADED_DIR / t.nodeid.split("::")[0]) for t in tests]
    arguments = [*dict.fromkeys(files), *course.GRADED_PYTEST_ARGS, "-p", "no:terminal"]
    said = io.StringIO()
    came: list[int] = []  # pytest may report an interrupt in any way: remembered here
    with (
        interrupts.sigterm_is_ctrl_c(came),
        graded_pytest(),
        contextlib.redirect_stdout(said),
        contextlib.redirect_stderr(said),
    ):
        code = pytest.main(arguments, plugins=[WorldSizes(config), plugin])
    if came:
        raise interrupts.Interrupted
    failure = plugin.grader_failure
    if code in _BROKEN and failure is None:
        last = [line for line in said.getvalue().splitlines() if line.strip()][-1:]
        failure = f"pytest could not run the graded tests ({code.name}): {' '.join(last)}"
    # A grader failure stops the session too (the plugin): then the run broke, not paused.
    return code == pytest.ExitCode.INTERRUPTED and failure is None, failure


def _reference_job(
    config: GradingConfig, settings: JobSettings, identity: Identity | None
) -> JobSettings | None:
    """How to run the reference beside the submission, for the performance tests to time its
    local work on this machine, in this run: its own job, in a sandbox of the submission's
    level, under uids of its own (``identity``: no student rank shares them, so none can
    signal it or read its folder). None where there is none: a student's release, or a run
    across nodes (whose ranks the broker cannot time)."""
    reference = course.REPO_ROOT / "reference"
    if settings.head is not None or not reference.is_dir():
        return None
    work = settings.work_dir / "reference"
    shutil.rmtree(work, ignore_errors=True)
    stage(reference, work / "import")
    if identity is not None and settings.level is not Level.NONE:
        identity.share(work)
    return job_settings(work, settings.level, settings.device, None, config.limits, identity)


def _start_head(
    nodes: Nodes, tests: list[GradedTest], import_dir: Path, level: Level, device: Device
) -> Head:
    """Node 0 of a run across nodes: host the rendezvous, wait for the other nodes' graders,
    and hand each the staged submission and how to sandbox it."""
    world_size = max(t.world_size for t in tests)
    run = Frame(
        {
            "type": protocol.RUN,
            "world_size": world_size,
            "level": level.value,
            "device": device.value,
        },
        [pack_folder(import_dir / "assignments")],
    )
    head = Head(nodes, node_key(), world_size, run)
    try:
        head.wait_for_nodes()
    except BaseException:
        head.finish()
        raise
    return head


def _digest(import_dir: Path) -> str:
    """The submission's fingerprint: a rerun of the same files sees the same inputs."""
    digest = hashlib.sha256()
    for path in sorted(import_dir.rglob("*.py")):
        digest.update(str(path.relative_to(import_dir)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
