"""Where a run's jobs run: what every grading of one run shares and needs no torch for.

The work folder, the run's uids (as root) and the sandbox level, probed once, are settled
here, before the grader imports torch; and so the run's first job starts here too
(:meth:`Workspace.start`; not for a run across nodes, which starts its jobs through its
head). Its torchrun and then its ranks import torch while the grader does, instead of after
it: on a laptop that is a second and more of every cold ``grader run``. Only where there may
be a GPU does the grader import torch first, to ask it for the ranks' device
(:func:`grader.device.detect`).
:class:`grader.commands.grading.Session` takes the job over with the rest.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from grader import sandbox
from grader.course import config as course
from grader.course.config import GradingConfig
from grader.course.secret import secret_path
from grader.device import Device
from grader.launch import orphans
from grader.launch.job import (
    RANK_WRAPPER,
    JobSettings,
    Launched,
    job_settings,
    launch,
    prepare_job,
)
from grader.launch.plan import JOB_ENV
from grader.launch.sandboxed import last_words
from grader.sandbox import identity as uids
from grader.sandbox.identity import Identity

#: The review line of a course's run graded at ``none``, asked for by name.
UNSANDBOXED = (
    "graded WITHOUT a sandbox (--sandbox none was asked for): the submission's code could "
    "read the reference, the graded tests and the secret"
)
#: How to get each level going, told when it cannot run the ranks.
_FIXES = {
    sandbox.Level.NAMESPACES: "run the grader as root, or where bubblewrap may bind the "
    "course's paths read-only",
    sandbox.Level.UID: "use an interpreter every user may run, not one under a 0700 home: "
    "Debian's /usr/bin/python3 or a venv made from it; or install bubblewrap (apt-get install "
    "bubblewrap)",
}


class Workspace:
    """The work folder, uids, sandbox level and first job of one run.

    ``sandbox_request``: the level asked for (None: the strongest that runs here).
    ``for_course``: the results are a course's (a results file): never at ``none`` unless
    that was asked for by name. A level that cannot run the ranks here raises
    :class:`sandbox.SandboxError` where the level is first needed (the first job, or across
    nodes the first grading), before any test.
    """

    def __init__(
        self,
        config: GradingConfig,
        sandbox_request: sandbox.Level | None = None,
        for_course: bool = False,
        device: Device = Device.CPU,
    ) -> None:
        self.config, self.sandbox_request, self.for_course = config, sandbox_request, for_course
        self.device = device  # the ranks' (grader.device.detect)
        self.work = Path(tempfile.mkdtemp(prefix="grader-")).resolve()
        self.level: sandbox.Level | None = None  # chosen at the first job
        self.refused: dict[sandbox.Level, str] = {}  # why each stronger level was not taken
        self.identity: Identity | None = None  # the submission's ranks'
        self.reference_identity: Identity | None = None  # the reference's: never a student's
        self.started: Launched | None = None  # the first job, until a session takes it
        try:
            self.work.chmod(0o711)  # a rank's uid passes through to its scratch, and no further
            (self.work / "import").mkdir()  # bound into every job; staged into at each grading
            if os.geteuid() == 0 and sys.platform == "linux":
                self.identity = uids.reserve(leftovers=False)
                self.reference_identity = uids.reserve(leftovers=False)
                uids.remove_files([self.identity, self.reference_identity])  # one pass for both
                self.identity.share(self.work / "import")
        except BaseException:  # an interrupt before the caller holds the workspace
            shutil.rmtree(self.work, ignore_errors=True)
            raise

    def start(self, size: int) -> None:
        """Choose the level and start the first job, of ``size`` ranks of this machine."""
        self.started = launch(self.settings(), size)

    def renew_identity(self) -> None:
        """A new block of uids for the next submission's ranks, the last one's given back
        (its processes ended, its files in shared folders removed): a batch's students
        share none."""
        if self.identity is None:
            return
        old, self.identity = self.identity, None
        new = uids.reserve(leftovers=False)
        try:
            uids.release_all([old], clear_too=[new])
        except BaseException:
            uids.release_all([new])
            raise
        self.identity = new
        self.identity.share(self.work / "import")

    def chosen_level(self) -> sandbox.Level:
        if self.level is None:
            identity = self.identity
            self.level = choose_level(
                self.sandbox_request,
                self.for_course,
                lambda lv: job_settings(self.work, lv, Device.CPU, identity=identity),
                self.refused,
            )
        return self.level

    def settings(self) -> JobSettings:
        level = self.chosen_level()
        return job_settings(self.work, level, self.device, None, self.config.limits, self.identity)

    def close(self) -> None:
        """End the first job if no session took it, and remove the work folder; idempotent."""
        if self.started is not None:
            self.started.end()
            self.started = None
        shutil.rmtree(self.work, ignore_errors=True)
        held = [i for i in (self.identity, self.reference_identity) if i is not None]
        self.identity = self.reference_identity = None
        uids.release_all(held)


def choose_level(
    request: sandbox.Level | None,
    for_course: bool,
    settings_for: Callable[[sandbox.Level], JobSettings],
    refused: dict[sandbox.Level, str] | None = None,
) -> sandbox.Level:
    """The strongest level asked for that really runs a rank here (:func:`why_not`, with
    the settings of this run); ``none`` for a course's run only when asked for by name.
    ``refused`` gets why each stronger level was not taken.

    Raises :class:`sandbox.SandboxError`, one line naming each level's cause and fix.
    """
    refused = {} if refused is None else refused
    for level in sandbox.candidates(request):
        why = why_not(level, request, for_course, settings_for)
        if why is None:
            return level
        refused[level] = why
    tried = "; ".join(
        why if level is sandbox.Level.NONE else f"{level.value}: {why}"
        for level, why in refused.items()
    )
    raise sandbox.SandboxError("cannot sandbox the ranks here: " + tried)


def why_not(
    level: sandbox.Level,
    request: sandbox.Level | None,
    for_course: bool,
    settings_for: Callable[[sandbox.Level], JobSettings],
) -> str | None:
    """Why ``level`` cannot grade here (with its fix), or None: the machine's tools and
    privileges, then a real rank started with this run's settings (:func:`probe`), then, at
    ``uid``, whether a rank could read the course."""
    if level is sandbox.Level.NONE:
        if for_course and request is not sandbox.Level.NONE:
            return (
                "a run that writes results for a course does not grade unsandboxed "
                "unless --sandbox none is given"
            )
        return None
    why = sandbox.unavailable(level)
    if why is not None:
        return why
    settings = settings_for(level)
    started = probe(settings)
    if started is not None:
        return f"a rank cannot start: {started} ({_FIXES[level]})"
    return _exposed(settings) if level is sandbox.Level.UID else None


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


PROBE_SECONDS = 60.0  # a sandboxed interpreter's start, on a loaded machine


def probe(settings: JobSettings) -> str | None:
    """Why a rank of a job with ``settings`` cannot start here, or None when it can.

    Rank 0's wrapper runs as torchrun would start it, in probe mode: the same sandbox
    command, paths, uid, limits and allow-list as a graded job, opening the sources of torch
    and of the grader's rank side instead of serving calls (:mod:`grader.rank.__main__`).
    A fifth of a second, once per run.
    """
    job_dir = settings.work_dir / "probe"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", JOB_ENV: str(job_dir)}
    command = [sys.executable, "-m", RANK_WRAPPER, "--probe"]
    socket_dir = None
    try:
        socket_dir = prepare_job(settings, job_dir, {})
        with orphans.start(  # its own child: never taken for a killed job's orphan
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        ) as wrapper:  # fmt: skip
            try:
                _, stderr = wrapper.communicate(timeout=PROBE_SECONDS)
            except BaseException:  # a timeout, or an interrupt: the wrapper ends with it
                wrapper.kill()
                wrapper.wait()
                raise
    except subprocess.TimeoutExpired:
        return f"a rank did not start within {PROBE_SECONDS:.0f} s"
    finally:
        if settings.identity is not None:
            settings.identity.end_jobs()
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)
    if wrapper.returncode == 0:
        shutil.rmtree(job_dir, ignore_errors=True)
        return None
    said = [line.strip() for line in stderr.decode(errors="replace").splitlines()]
    words = last_words(job_dir, 0) or next((line for line in reversed(said) if line), "")
    shutil.rmtree(job_dir, ignore_errors=True)
    return words or f"the rank's wrapper exited with status {wrapper.returncode}"
