"""Sandboxes for the ranks of a student's job, at the strongest level the machine allows.

Torchrun starts, for each rank, a small trusted wrapper (the grader's user, outside any
sandbox, :mod:`grader.launch.sandboxed`) that starts the worker with
``Sandbox(...).popen(argv, log)``, waits for it, and dies with torchrun; the sandbox
dies with the wrapper.

Three levels, strongest first:

* ``namespaces``: bubblewrap. As root, bwrap runs privileged and the command inside
  drops to the unprivileged uid with ``setpriv``: bwrap's own ``--unshare-user --uid``
  would map the sandbox's uid onto host root, which still owns (and reads) root's 0600
  files, and an unprivileged bwrap could not reach sources under a 0700 home (this
  machine's interpreter lives in /root/.pyenv). Hide the home and bind the interpreter's
  prefix back readable. Not root: bwrap maps the caller's uid in a user namespace.
* ``uid``: no namespaces (Docker's default seccomp profile refuses them to unprivileged
  containers, Gradescope's among them) but root: a dedicated uid, rlimits, and
  permissions for hiding (checked with :func:`grader.sandbox.identity.readable_by`), and every
  process of the job's uids killed at job end (:func:`grader.sandbox.identity.kill_uid`).
  None of it needs an exec: a job's ranks are forked by its zygote, which imported torch
  once (:mod:`grader.launch.zygote`), and each enters its sandbox in place
  (:meth:`Sandbox.enter`).
* ``none``: a student's laptop: run as is.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import IO

from grader.sandbox import landlock, syscall_filter

__all__ = [
    "Level",
    "Sandbox",
    "SandboxError",
    "detect",
    "die_with",
    "limit_reached",
    "unavailable_landlock",
    "walled",
]

GiB = 1 << 30
MiB = 1 << 20
NOBODY = 65534
#: Address space per rank (``memory_per_rank_mib`` in grading.yaml overrides it). A rank
#: with torch imported maps ~580 MiB of which ~220 MiB is resident, so under a cap C it
#: holds at most about C - 360 MiB resident, plus its tmpfs mounts (112 MiB): 4 ranks at
#: 1 GiB hold ~3.1 GB and leave the grader ~0.9 GB of a 4 GB container. At 768 MiB the
#: reference ran out of memory in all_to_all's 4 MB performance test (world size 2).
DEFAULT_MEMORY = 1024 * MiB
DEFAULT_SCRATCH = 64 * MiB
ENV_VAR = "GRADER_SANDBOX"
#: Private tmpfs mounts each rank gets besides its scratch, with their modes; each holds
#: at most _PRIVATE_BYTES (tmpfs is RAM outside RLIMIT_AS: part of the memory budget).
_PRIVATE = {"/tmp": "1777", "/dev/shm": "1777", "/var/tmp": "1777", "/run": "0755"}
_PRIVATE_BYTES = 12 * MiB
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_DUMPABLE = 4


#: What a rank's exception says when it ran into a limit of its sandbox, and that limit.
_LIMITS_SEEN = (
    ("MemoryError", "memory (limits.memory_per_rank_mib in grading.yaml)"),
    ("No space left on device", "scratch space (limits.scratch_per_rank_mib in grading.yaml)"),
    (
        "File too large",
        "the size of one file, what it prints included "
        "(limits.scratch_per_rank_mib in grading.yaml)",
    ),
    ("Too many open files", "open files and sockets"),
    ("can't start new thread", "processes and threads"),
    ("Resource temporarily unavailable", "processes and threads"),
)


def limit_reached(error: str) -> str | None:
    """The sandbox's limit that ``error`` (a rank's ``Type: message``) tells of, if any."""
    return next((limit for seen, limit in _LIMITS_SEEN if seen in error), None)


class SandboxError(RuntimeError):
    """A sandbox that was asked for cannot be provided or used; the message is one line."""


class Level(str, Enum):
    NAMESPACES = "namespaces"
    UID = "uid"
    NONE = "none"


def _base_flags(uid: int, gid: int) -> list[str]:
    """The bwrap flags every rank gets, whatever its paths."""
    flags = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    for path, mode in _PRIVATE.items():
        flags += ["--perms", mode, "--size", str(_PRIVATE_BYTES), "--tmpfs", path]
    flags += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
    if os.geteuid() == 0:  # what setpriv needs to drop, and --chdir into a 0700 scratch
        caps = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_DAC_READ_SEARCH")
        flags += ["--cap-drop", "ALL", *(f for cap in caps for f in ("--cap-add", cap))]
    else:
        flags += ["--unshare-user", "--uid", str(uid), "--gid", str(gid), "--disable-userns"]
    # A hostname that resolves (gloo looks its own up), and only to loopback.
    return [*flags, "--hostname", "localhost", "--die-with-parent", "--new-session", "--clearenv"]


def _inner(uid: int, gid: int, processes: int) -> list[str]:
    """What bwrap runs before the command: as root, the drop to uid/gid for good; otherwise
    the process cap, which counts per user namespace (the rank's own) only inside it."""
    tool = "setpriv" if os.geteuid() == 0 else "prlimit"
    path = shutil.which(tool)
    if path is None:
        raise SandboxError(f"sandbox level 'namespaces' needs {tool} (apt-get install util-linux)")
    if os.geteuid() != 0:
        return [path, f"--nproc={processes}", "--"]
    ids = ["--reuid", str(uid), "--regid", str(gid), "--clear-groups"]
    return [path, *ids, "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]


def drop_to(uid: int, gid: int) -> None:
    """Become uid/gid for good (no supplementary groups); a no-op unless we are root."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value})")


def requested(request: str = "auto") -> Level | None:
    """The level asked for on the command line (``request``), or with ``auto`` in
    ``$GRADER_SANDBOX``; None: the strongest there is. A SandboxError of one line if unknown."""
    if request == "auto":
        request = os.environ.get(ENV_VAR, "auto") or "auto"
    if request == "auto":
        return None
    try:
        return Level(request)
    except ValueError:
        choices = "auto, " + ", ".join(lv.value for lv in Level)
        raise SandboxError(f"unknown sandbox level {request!r} (choose {choices})") from None


def candidates(request: Level | None = None) -> list[Level]:
    """The levels to try, strongest first: the one asked for, or with None every one."""
    return list(Level) if request is None else [request]


@functools.cache
def unavailable(level: Level) -> str | None:
    """Why this machine cannot give ``level`` at all (no tool, no privilege), else None.

    Cheap and path-free: whether the level runs the grader's interpreter on the course's
    paths is the real probe's to say (``grader.launch.workspace.probe``).
    """
    if level is Level.NONE:
        return None
    if sys.platform != "linux":
        return f"sandbox level {level.value!r} needs Linux"
    if level is Level.UID and os.geteuid() != 0:
        return "sandbox level 'uid' needs the grader to run as root"
    if level is Level.NAMESPACES and shutil.which("bwrap") is None:
        return "bwrap is not installed (apt-get install bubblewrap)"
    if level is Level.UID and (why := unavailable_landlock()):
        return f"{why}: the ranks' allow-list needs it"
    try:
        syscall_filter.program()
        if level is Level.NAMESPACES:
            _inner(NOBODY, NOBODY, 1)
    except (syscall_filter.FilterUnavailable, SandboxError) as exc:
        return str(exc)
    return None


@functools.cache
def unavailable_landlock() -> str | None:
    """Why this kernel cannot give the ranks their Landlock allow-list, else None."""
    try:
        landlock.abi()
    except landlock.LandlockUnavailable as err:
        return str(err)
    return None


def walled(level: Level) -> bool:
    """Whether the ranks apply the Landlock allow-list: at ``uid`` always (it is the wall;
    the level is refused without it), at ``namespaces`` where the kernel has Landlock."""
    if level is Level.NAMESPACES:
        return unavailable_landlock() is None
    return level is Level.UID


def detect(request: Level | None = None) -> Level:
    """The strongest level asked for that this machine offers, by :func:`unavailable`."""
    reasons = []
    for level in candidates(request):
        why = unavailable(level)
        if why is None:
            return level
        reasons.append(why)
    raise SandboxError(reasons[0])


@dataclass(frozen=True)
class Sandbox:
    """One rank's sandbox. Paths are absolute; ``hidden`` ones that do not exist are skipped.

    ``hidden`` directories are masked by an empty read-only tmpfs, hidden files by
    /dev/null; ``readable`` paths are then bound back read-only (the grader's rank side,
    the submission, the interpreter); ``scratch`` is the only writable path, and the
    rank's cwd, HOME and TMPDIR: at ``namespaces`` a tmpfs of ``scratch_bytes`` of its own
    (nothing it writes reaches the host's disk), at ``uid`` the host's folder, where no
    file may exceed ``max_file_bytes``. ``connection`` is the rank's one way out: a
    descriptor, connected to the broker (or its node's relay) by the trusted wrapper and
    inherited at the same number, since a rank may open no socket of its own.
    ``allow``: the Landlock allow-list (:mod:`grader.sandbox.landlock`) the rank applies
    to itself before anything else runs in it, scratch and ``/proc/self`` added; empty:
    none (a level whose kernel has no Landlock, where the mounts are the wall).

    The limits are per rank: ``uid`` is the rank's own (``grader.sandbox.identity``), so the
    process cap counts its processes and threads alone.
    """

    level: Level
    scratch: Path
    hidden: tuple[Path, ...] = ()
    readable: tuple[Path, ...] = ()
    connection: int | None = None
    allow: tuple[landlock.Rule, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    memory_bytes: int = DEFAULT_MEMORY
    uid: int = NOBODY
    gid: int = NOBODY
    max_processes: int = 256  # processes and threads
    max_open_files: int = 256  # files, sockets and pipes open at once
    scratch_bytes: int = DEFAULT_SCRATCH
    max_file_bytes: int = DEFAULT_SCRATCH  # the rank's log (its output) too

    def environment(self) -> dict[str, str]:
        """The rank's whole environment: nothing leaks in from the grader's."""
        path = os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin:/usr/bin:/bin"])
        env = {"PATH": path, "LANG": "C.UTF-8", **self.env}
        home = str(self.scratch)
        env = {**env, "HOME": home, "TMPDIR": home, "PWD": home}
        if self.allow:
            rules = (*self.allow, *landlock.own_rules(self.scratch))
            env[landlock.ENV_VAR] = "\n".join(rule.to_text() for rule in rules)
        return env

    def prepare(self) -> None:
        """Create the scratch directory, the sandbox uid's alone."""
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.scratch.chmod(0o700)
        if self.level is not Level.NONE and os.geteuid() == 0:
            os.chown(self.scratch, self.uid, self.gid)

    def _command(self, argv: Sequence[str]) -> tuple[list[str], tuple[int, ...]]:
        """The argv, and the descriptors it needs inherited (bwrap's seccomp program)."""
        if self.level is Level.UID:
            syscall_filter.program()  # made here: pre_exec only loads it
        if self.level is not Level.NAMESPACES:
            return list(argv), ()
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxError("sandbox level 'namespaces' needs bwrap on PATH")
        flags = _base_flags(self.uid, self.gid)
        masks = [Path(p) for p in _PRIVATE]
        # bwrap makes the missing parents of a mount point 0700: open those inside a mask.
        opened: set[Path] = set()

        def mount(*option: str, at: Path) -> None:
            for parent in reversed(at.parents):
                if parent not in opened and any(m in parent.parents for m in masks):
                    flags.extend(["--perms", "0755", "--dir", str(parent)])
                    opened.add(parent)
            flags.extend([*option, str(at)])

        remount: list[str] = []
        # Inside a hidden folder is hidden already; a mask mounted on a folder after one on
        # its child would bury the child's mount point (a course in a home, both hidden).
        outermost = [p for p in self.hidden if not any(q in p.parents for q in self.hidden)]
        for path in outermost:
            if path.is_dir():
                mount("--size", str(MiB), "--tmpfs", at=path)
                masks.append(path)
                remount += ["--remount-ro", str(path)]
            elif os.path.lexists(path):
                mount("--ro-bind", "/dev/null", at=path)
        for path in self.readable:
            mount("--ro-bind", str(path), at=path)
        # The rank is alone in its mount namespace: 0777 lets the dropped uid write there.
        mount("--perms", "0777", "--size", str(self.scratch_bytes), "--tmpfs", at=self.scratch)
        flags += remount  # last: the binds above made their mount points in the masks
        for key, value in self.environment().items():
            flags += ["--setenv", key, value]
        seccomp = syscall_filter.program_fd()
        flags += ["--chdir", str(self.scratch), "--seccomp", str(seccomp)]
        inner = _inner(self.uid, self.gid, self.max_processes)
        return [bwrap, *flags, "--", *inner, *argv], (seccomp,)

    def pre_exec(self) -> None:
        """In the process about to exec the sandboxed command (``Popen(preexec_fn=...)``):
        limits, then (``uid``) the drop. The process gets SIGKILL when
        its parent (the rank's wrapper) dies, from before the exec on: bwrap's own
        ``--die-with-parent`` comes too late when the wrapper is killed while bwrap
        starts (seen here: an orphaned bwrap). For ``uid`` it is set after setuid,
        which clears it.
        """
        self._confine(in_place=False)

    def enter(self) -> None:
        """At ``uid``, in a child that a trusted process forked and that will not exec (a
        rank forked by its job's zygote, :mod:`grader.launch.zygote`): what :meth:`pre_exec`
        does, and the process left dumpable as an exec would leave it (a drop from root
        clears the flag, which an exec sets again), so that it sees its own /proc as an
        exec'd rank does. It dies with the process that forked it."""
        if self.level is not Level.UID:
            raise SandboxError(f"only the uid level enters a sandbox in place, not {self.level}")
        self._confine(in_place=True)

    def _confine(self, in_place: bool) -> None:
        parent = os.getppid()
        if self.level is not Level.UID:
            die_with(parent)
        if self.level is Level.NONE:
            os.chdir(self.scratch)
            return
        with contextlib.suppress(PermissionError):  # already a session leader
            os.setsid()
        _set_limit(resource.RLIMIT_AS, self.memory_bytes)
        _set_limit(resource.RLIMIT_CORE, 0)
        _set_limit(resource.RLIMIT_FSIZE, self.max_file_bytes)
        _set_limit(resource.RLIMIT_NOFILE, self.max_open_files)
        if os.geteuid() == 0:  # NPROC counts per real uid: the rank's own once dropped to it
            _set_limit(resource.RLIMIT_NPROC, self.max_processes)
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries (su, mount) gain nothing
        if self.level is Level.UID:
            drop_to(self.uid, self.gid)
            os.chdir(self.scratch)
            if in_place:
                _prctl(_PR_SET_DUMPABLE, 1)
            die_with(parent)
            syscall_filter.load(syscall_filter.program())  # last: for good, and for all it starts

    def popen(self, argv: Sequence[str], output: IO[bytes]) -> subprocess.Popen[bytes]:
        """Start the sandboxed ``argv``, its output (stdout and stderr) into ``output``:
        what the trusted per-rank wrapper does."""
        command, fds = self._command(argv)
        inherited = (*fds, *(() if self.connection is None else (self.connection,)))
        try:
            return subprocess.Popen(
                command,
                env=self.environment(),
                preexec_fn=self.pre_exec,
                pass_fds=inherited,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=self.scratch,
            )
        finally:
            for fd in fds:
                os.close(fd)


def die_with(parent: int) -> None:
    """SIGKILL to this process when ``parent`` dies (kept across exec of a plain binary).
    Linux only; elsewhere (a student's own run) nothing."""
    if sys.platform != "linux":
        return
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(137)


def _set_limit(resource_id: int, value: int) -> None:
    """Set soft and hard limit (a student cannot raise it back), never above the hard one."""
    _, hard = resource.getrlimit(resource_id)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(resource_id, (value, value))
