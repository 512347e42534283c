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
import hashlib
import io
import os
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from grader import config as course
from grader import protocol, sandbox
from grader.catalog import GradedTest, WorldSizes, graded_pytest
from grader.config import GradingConfig
from grader.judge.audit import audit
from grader.judge.plugin import GradingPlugin
from grader.judge.verdict import Verdict
from grader.launch.world import JobSettings
from grader.report.results import GradedResult
from grader.submission import problem_with, stage
from grader.testkit import data

SECRET_ENV = "GRADER_SECRET"
_BROKEN = (
    pytest.ExitCode.USAGE_ERROR,
    pytest.ExitCode.INTERNAL_ERROR,
    pytest.ExitCode.NO_TESTS_COLLECTED,
)
MEMORY_PER_RANK = sandbox.DEFAULT_MEMORY


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


def grade(
    config: GradingConfig,
    tests: list[GradedTest],
    submission: Path,
    listener: Listener,
    sandbox_request: str = "auto",
) -> GradingRun:
    """Grade ``tests``: one result per test, in their order.

    On Ctrl-C or SIGTERM, every job is killed and the tests not yet judged are
    reported as not run.
    """
    level = sandbox.detect(sandbox_request)
    verdicts: dict[str, Verdict] = {}

    def record(test: GradedTest, verdict: Verdict) -> None:
        verdicts[test.nodeid] = verdict
        listener.on_verdict(test, verdict)

    work = Path(tempfile.mkdtemp(prefix="grader-")).resolve()
    interrupted, failure, review = False, None, []
    try:
        work.chmod(0o711)  # the sandbox's uid may pass through to its own socket and scratch
        import_dir = work / "import"
        left_out = stage(submission, import_dir)
        staged = import_dir / "assignments"
        review = [f"left out of the submission: {line}" for line in left_out] + audit(staged)
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
            interrupted, failure = _run(config, runnable, work, level, listener.on_start, record)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if level is sandbox.Level.UID:
            sandbox.kill_uid(sandbox.NOBODY)
        shutil.rmtree(work, ignore_errors=True)
    for test in tests:
        if test.nodeid not in verdicts:
            reason = "grading was interrupted" if interrupted else "the grader stopped early"
            verdicts[test.nodeid] = Verdict(protocol.NOT_RUN, f"not run: {reason}")
    results = [
        GradedResult(t, v := verdicts[t.nodeid], t.settings.points * v.share()) for t in tests
    ]
    return GradingRun(results, interrupted, level.value, failure, review)


def _run(
    config: GradingConfig,
    tests: list[GradedTest],
    work: Path,
    level: sandbox.Level,
    on_start: Callable[[GradedTest], None],
    on_verdict: Callable[[GradedTest, Verdict], None],
) -> tuple[bool, str | None]:
    import_dir = work / "import"
    data.configure(_secret(), _digest(import_dir))
    package = Path(__file__).resolve().parent
    settings = JobSettings(
        work_dir=work,
        import_dir=import_dir,
        sandbox=level.value,
        hidden=tuple(p for p in _hidden(work) if p.exists()),
        readable=(package, import_dir, *_interpreter()),
        pythonpath=str(package.parent),
        memory_bytes=MEMORY_PER_RANK,
        device=_device(),
    )
    plugin = GradingPlugin(tests, settings, on_start, on_verdict)
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
    return code == pytest.ExitCode.INTERRUPTED, failure


# What the ranks see of the machine's root: the system, nothing else (another checkout of the
# course, with its reference, may lie anywhere outside these).
_SYSTEM = {"bin", "boot", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "run", "sbin",
           "sys", "tmp", "usr"}  # fmt: skip


def _hidden(work: Path) -> list[Path]:
    """What the ranks must not see: every top-level directory but the system's (the course's
    checkouts, with the reference, the hidden tests and the configuration; home directories;
    the secret), the grader's work directory, and the course wherever it lies."""
    tops = [Path("/") / name for name in sorted(os.listdir("/")) if name not in _SYSTEM]
    return [*tops, course.REPO_ROOT, work, Path.home(), _secret_path().parent]


def _interpreter() -> list[Path]:
    """What the ranks need back: Python, and the directories it imports packages from (torch),
    but not the directory the grader was started in, nor anything inside the course."""
    found = [Path(sys.base_prefix), Path(sys.prefix)]
    for entry in sys.path[1:]:
        path = Path(entry).resolve() if entry else None
        if path and path.is_dir() and not path.is_relative_to(course.REPO_ROOT.resolve()):
            found.append(path)
    return list(dict.fromkeys(found))


def _secret_path() -> Path:
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config_home / "grader" / "secret"


def _secret() -> bytes:
    """The key the inputs are derived from: set by the instructor, or made once per machine."""
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV].encode()
    path = _secret_path()
    try:
        return path.read_bytes()
    except OSError:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        value = secrets.token_bytes(32)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as f:
            f.write(value)
        return value


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
