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
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from grader import protocol, sandbox
from grader.course import config as course
from grader.course.catalog import GradedTest, WorldSizes, graded_pytest
from grader.course.config import GradingConfig
from grader.course.secret import secret, secret_path
from grader.course.submission import problem_with, stage
from grader.judge.audit import audit
from grader.judge.plugin import GradingPlugin
from grader.judge.verdict import Verdict
from grader.launch.job import JobSettings, job_settings, probe
from grader.nodes import Nodes, NodesError, node_key, pack_folder
from grader.nodes.head import Head
from grader.report.results import GradedResult
from grader.sandbox import identity as uids
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
    sandbox: str  # the level that isolated the student's code
    grader_failure: str | None = None
    review: list[str] = field(default_factory=list)  # constructs a TA should look at
    sandbox_per_node: list[str] = field(default_factory=list)  # across nodes: node 0 first


def grade(
    config: GradingConfig,
    tests: list[GradedTest],
    submission: Path,
    listener: Listener,
    sandbox_request: str = "auto",
    nodes: Nodes | None = None,
    for_course: bool = False,
) -> GradingRun:
    """Grade ``tests``: one result per test, in their order.

    ``for_course``: the results are a course's (a results file): never at ``none`` unless
    that was asked for by name. A level that cannot run the ranks here raises
    :class:`sandbox.SandboxError` before any test. On Ctrl-C or SIGTERM, every job is killed
    and the tests not yet judged are reported as not run.
    """
    verdicts: dict[str, Verdict] = {}
    level = sandbox.Level.NONE
    identity: Identity | None = None

    def record(test: GradedTest, verdict: Verdict) -> None:
        verdicts[test.nodeid] = verdict
        listener.on_verdict(test, verdict)

    work = Path(tempfile.mkdtemp(prefix="grader-")).resolve()
    interrupted, failure, review, per_node = False, None, [], []
    try:
        work.chmod(0o711)  # the sandbox's uid may pass through to its own socket and scratch
        import_dir = work / "import"
        left_out = stage(submission, import_dir)
        staged = import_dir / "assignments"
        review = [f"left out of the submission: {line}" for line in left_out] + audit(staged)
        if os.geteuid() == 0 and sys.platform == "linux":
            identity = uids.reserve()
        level = choose_level(
            sandbox_request, for_course, lambda lv: job_settings(work, lv, "cpu", identity=identity)
        )
        if level is sandbox.Level.NONE and for_course:
            review.insert(0, UNSANDBOXED)
        parts = dict.fromkeys(t.part for t in tests)
        problems = {part: problem_with(staged, part) for part in parts}
        runnable = []
        for test in tests:
            problem = problems[test.part]
            if problem is None:
                runnable.append(test)
            else:
                record(test, Verdict(*problem))
        if runnable:
            settings = job_settings(work, level, _device(), None, config.limits, identity)
            interrupted, failure = _run(
                config, runnable, settings, listener.on_start, record, nodes, per_node
            )
    except KeyboardInterrupt:
        interrupted = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if identity is not None:
            identity.release()
    for test in tests:
        if test.nodeid not in verdicts:
            reason = "grading was interrupted" if interrupted else "the grader stopped early"
            verdicts[test.nodeid] = Verdict(protocol.NOT_RUN, f"not run: {reason}")
    results = [
        GradedResult(t, v := verdicts[t.nodeid], t.settings.points * v.share()) for t in tests
    ]
    return GradingRun(results, interrupted, level.value, failure, review, per_node)


#: The review line of a course's run graded at ``none``, asked for by name.
UNSANDBOXED = (
    "graded WITHOUT a sandbox (--sandbox none was asked for): the submission's code could "
    "read the reference, the graded tests and the secret"
)
#: How to get each level going, told when it cannot run the ranks.
_FIXES = {
    sandbox.Level.NAMESPACES: "run the grader as root, or where bubblewrap may bind the "
    "course's paths read-only",
    sandbox.Level.UID: "install Python and the grader where every user may read them (not "
    "under a 0700 home), or install bubblewrap (apt-get install bubblewrap)",
}


def choose_level(
    request: str, for_course: bool, settings_for: Callable[[sandbox.Level], JobSettings]
) -> sandbox.Level:
    """The strongest level asked for that really runs a rank here (:func:`probe`, with
    the settings of this run); ``none`` for a course's run only when asked for by name.

    Raises :class:`sandbox.SandboxError`, one line naming each level's cause and fix.
    """
    named = sandbox.requested(request)
    tried: list[str] = []
    for level in sandbox.candidates(request):
        if level is sandbox.Level.NONE and for_course and named != "none":
            tried.append(
                "a run that writes results for a course does not grade unsandboxed "
                "unless --sandbox none is given"
            )
            break
        why = sandbox.unavailable(level)
        if why is None and level is not sandbox.Level.NONE:
            settings = settings_for(level)
            why = probe(settings)
            why = why and f"a rank cannot start: {why} ({_FIXES[level]})"
            if why is None and level is sandbox.Level.UID:
                why = _exposed(settings)
        if why is None:
            return level
        tried.append(f"{level.value}: {why}")
    raise sandbox.SandboxError("cannot sandbox the ranks here: " + "; ".join(tried))


def _exposed(settings: JobSettings) -> str | None:
    """At ``uid`` only permissions hide the course: which part a rank could read, if any."""
    course_files = [course.REPO_ROOT / "reference", course.GRADED_DIR, secret_path()]
    assert settings.identity is not None
    uid = settings.identity.uid(0)
    readable = uids.readable_by([p for p in course_files if p.exists()], uid, uid)
    if not readable:
        return None
    return (
        f"the ranks' uid can read {readable[0]} (make the course unreadable to others: "
        f"chmod -R o-rwx {course.REPO_ROOT})"
    )


def _run(
    config: GradingConfig,
    tests: list[GradedTest],
    settings: JobSettings,
    on_start: Callable[[GradedTest], None],
    on_verdict: Callable[[GradedTest, Verdict], None],
    nodes: Nodes | None,
    per_node: list[str],
) -> tuple[bool, str | None]:
    """Run the tests; across nodes, ``per_node`` gets the sandbox level each node applied."""
    data.configure(secret(), _digest(settings.import_dir))
    head = None
    if nodes is not None:
        level = sandbox.Level(settings.sandbox)
        try:
            head = _start_head(nodes, tests, settings.import_dir, level, settings.device)
        except NodesError as err:
            return False, str(err)
        settings = dataclasses.replace(settings, head=head)
    try:
        return _run_tests(config, tests, settings, on_start, on_verdict)
    finally:
        if head is not None:
            head.finish()
            per_node += [level.value, *(head.levels[n] for n in sorted(head.levels))]


def _run_tests(
    config: GradingConfig,
    tests: list[GradedTest],
    settings: JobSettings,
    on_start: Callable[[GradedTest], None],
    on_verdict: Callable[[GradedTest, Verdict], None],
) -> tuple[bool, str | None]:
    plugin = GradingPlugin(tests, settings, on_start, on_verdict, _reference_job(config, settings))
    files = [str(course.GRADED_DIR / t.nodeid.split("::")[0]) for t in tests]
    arguments = [*dict.fromkeys(files), *course.GRADED_PYTEST_ARGS, "-p", "no:terminal"]
    said = io.StringIO()
    interrupts: list[int] = []

    def interrupt(signum: int, frame: object) -> None:
        interrupts.append(signum)  # remembered: pytest may report it in any way
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with graded_pytest(), contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            code = pytest.main(arguments, plugins=[WorldSizes(config), plugin])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        plugin.close()
    if interrupts:
        raise KeyboardInterrupt
    failure = plugin.grader_failure
    if code in _BROKEN and failure is None:
        last = [line for line in said.getvalue().splitlines() if line.strip()][-1:]
        failure = f"pytest could not run the graded tests ({code.name}): {' '.join(last)}"
    # A grader failure stops the session too (the plugin): then the run broke, not paused.
    return code == pytest.ExitCode.INTERRUPTED and failure is None, failure


def _reference_job(config: GradingConfig, settings: JobSettings) -> JobSettings | None:
    """How to run the reference beside the submission, for the performance tests to time its
    local work on this machine, in this run: its own job, in a sandbox of the submission's
    level where that sandbox keeps the two jobs apart (``namespaces``), else unsandboxed (it
    is the course's code; at ``uid`` the submission's ranks could signal a process of their
    own uids). None where there is none: a student's release, or a run across nodes (whose
    ranks the broker cannot time)."""
    reference = course.REPO_ROOT / "reference"
    if settings.head is not None or not reference.is_dir():
        return None
    work = settings.work_dir / "reference"
    stage(reference, work / "import")
    level = sandbox.Level(settings.sandbox)
    if level is not sandbox.Level.NAMESPACES:
        level = sandbox.Level.NONE
    return job_settings(work, level, settings.device, None, config.limits)


def _start_head(
    nodes: Nodes, tests: list[GradedTest], import_dir: Path, level: sandbox.Level, device: str
) -> Head:
    """Node 0 of a run across nodes: host the rendezvous, wait for the other nodes' graders,
    and hand each the staged submission and how to sandbox it."""
    world_size = max(t.world_size for t in tests)
    run = Frame(
        {"type": protocol.RUN, "world_size": world_size, "level": level.value, "device": device},
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


def _device() -> str:
    """Where the ranks keep their tensors: the choice of ``--backend``, else a GPU if any."""
    if os.environ.get("GRADER_DEVICE") in ("cpu", "cuda"):
        return os.environ["GRADER_DEVICE"]
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
