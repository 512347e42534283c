"""Sandboxes for the ranks of a student's job, at the strongest level the machine allows.

Torchrun starts, for each rank, a small trusted wrapper (the grader's user, outside any
sandbox) that calls ``Sandbox(...).exec(argv)``: the wrapper's process becomes the
sandboxed worker, so torchrun still sees and signals its own child.

Three levels, strongest first:

* ``namespaces``: bubblewrap. As root, bwrap runs privileged and the command inside
  drops to the unprivileged uid with ``setpriv``: bwrap's own ``--unshare-user --uid``
  would map the sandbox's uid onto host root, which still owns (and reads) root's 0600
  files, and an unprivileged bwrap could not reach sources under a 0700 home (this
  machine's interpreter lives in /root/.pyenv). Hide the home and bind the interpreter's
  prefix back readable. Not root: bwrap maps the caller's uid in a user namespace.
* ``uid``: no namespaces (Docker's default seccomp profile refuses them to unprivileged
  containers, Gradescope's among them) but root: a dedicated uid, rlimits, and
  permissions for hiding (check them with ``readable_by``); ``kill_uid`` at job end.
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
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import NoReturn

__all__ = ["GUARANTEES", "Level", "Sandbox", "SandboxError", "detect", "kill_uid", "readable_by"]

GiB = 1 << 30
MiB = 1 << 20
NOBODY = 65534
#: A 4-rank gloo job peaked at ~0.9 GiB of address space per rank on 2 cores and still ran
#: under a 768 MiB cap (640 MiB failed); thread stacks and malloc arenas grow with cores.
DEFAULT_MEMORY = 4 * GiB
ENV_VAR = "GRADER_SANDBOX"
#: Private, size-capped tmpfs mounts each rank gets, with their modes.
_PRIVATE = {"/tmp": "1777", "/dev/shm": "1777", "/var/tmp": "1777", "/run": "0755"}
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38


class SandboxError(RuntimeError):
    """A sandbox that was asked for cannot be provided or used; the message is one line."""


class Level(str, Enum):
    NAMESPACES = "namespaces"
    UID = "uid"
    NONE = "none"


GUARANTEES: dict[Level, str] = {
    Level.NAMESPACES: (
        "Each rank runs as an unprivileged uid without capabilities, in its own mount, PID, "
        "network, IPC and UTS namespaces: it sees a read-only system with the grader's "
        "files masked, can "
        "write only its scratch directory and small private tmpfs mounts, has a loopback "
        "of its own and no other network, is capped in memory, and everything it started "
        "dies when its parent dies."
    ),
    Level.UID: (
        "Each rank runs as a dedicated unprivileged uid with capped memory, processes and "
        "file sizes, in its own scratch directory with a cleared environment; it can read "
        "what that uid's permissions allow (check with readable_by), can write "
        "world-writable places such as /tmp and /dev/shm, shares the host's network, and "
        "only kill_uid at job end stops the daemons it started."
    ),
    Level.NONE: (
        "No isolation: student code runs as the grader's own user with its files, network "
        "and memory; fit only for students grading their own work."
    ),
}


def _base_flags(uid: int, gid: int, tmpfs_bytes: int) -> list[str]:
    """The bwrap flags every rank gets; ``detect`` probes exactly these."""
    flags = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    for path, mode in _PRIVATE.items():  # tmpfs is RAM outside RLIMIT_AS: bound it
        flags += ["--perms", mode, "--size", str(tmpfs_bytes), "--tmpfs", path]
    flags += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
    if os.geteuid() == 0:  # what setpriv needs to drop, and --chdir into a 0700 scratch
        caps = ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_DAC_READ_SEARCH")
        flags += ["--cap-drop", "ALL", *(f for cap in caps for f in ("--cap-add", cap))]
    else:
        flags += ["--unshare-user", "--uid", str(uid), "--gid", str(gid), "--disable-userns"]
    # A hostname that resolves (gloo looks its own up), and only to loopback.
    return [*flags, "--hostname", "localhost", "--die-with-parent", "--new-session", "--clearenv"]


def _inner(uid: int, gid: int) -> list[str]:
    """What bwrap runs before the command: as root, the drop to uid/gid for good."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise SandboxError("sandbox level 'namespaces' as root needs setpriv (util-linux)")
    ids = ["--reuid", str(uid), "--regid", str(gid), "--clear-groups"]
    return [setpriv, *ids, "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]


def _drop_to(uid: int, gid: int) -> None:
    """Become uid/gid for good (no supplementary groups); a no-op unless we are root."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value})")


@functools.cache
def _namespaces_fail(uid: int, gid: int) -> str | None:
    """Why bwrap with this module's flags does not run here, or None when it does."""
    bwrap = shutil.which("bwrap")
    if sys.platform != "linux" or bwrap is None:
        return "bwrap is not installed (apt-get install bubblewrap)"
    try:
        command = [bwrap, *_base_flags(uid, gid, MiB), "--", *_inner(uid, gid), "/bin/true"]
        done = subprocess.run(command, cwd="/", capture_output=True, text=True, timeout=30)
    except SandboxError as exc:
        return str(exc)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bwrap did not run: {exc}"
    lines = (done.stderr.strip() or f"exit status {done.returncode}").splitlines()
    return None if done.returncode == 0 else f"bwrap refused: {lines[-1]}"


def detect(requested: str = "auto", uid: int = NOBODY, gid: int = NOBODY) -> Level:
    """The level to use: ``requested``, or with ``auto`` ``$GRADER_SANDBOX`` or the best here."""
    if requested == "auto":
        requested = os.environ.get(ENV_VAR, "auto") or "auto"
    root_linux = sys.platform == "linux" and os.geteuid() == 0
    if requested == "auto":
        if _namespaces_fail(uid, gid) is None:
            return Level.NAMESPACES
        return Level.UID if root_linux else Level.NONE
    try:
        level = Level(requested)
    except ValueError:
        choices = "auto, " + ", ".join(lv.value for lv in Level)
        raise SandboxError(f"unknown sandbox level {requested!r} (choose {choices})") from None
    if level is Level.NAMESPACES and (why := _namespaces_fail(uid, gid)) is not None:
        raise SandboxError(f"sandbox level 'namespaces' unavailable: {why}")
    if level is Level.UID and not root_linux:
        raise SandboxError("sandbox level 'uid' needs the grader to run as root on Linux")
    return level


@dataclass(frozen=True)
class Sandbox:
    """One rank's sandbox. Paths are absolute; ``hidden`` ones that do not exist are skipped.

    ``hidden`` directories are masked by an empty read-only tmpfs, hidden files by
    /dev/null; ``readable`` paths are then bound back read-only (e.g. ``grader/`` inside
    the hidden repository); ``sockets`` are Unix socket files bound in; ``scratch`` is the
    only writable path, and the rank's cwd, HOME and TMPDIR.
    """

    level: Level
    scratch: Path
    hidden: tuple[Path, ...] = ()
    readable: tuple[Path, ...] = ()
    sockets: tuple[Path, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    memory_bytes: int = DEFAULT_MEMORY
    uid: int = NOBODY
    gid: int = NOBODY
    max_processes: int = 1024  # counts threads, of all ranks sharing the uid
    max_file_bytes: int = 4 * GiB
    tmpfs_bytes: int = 256 * MiB

    def environment(self) -> dict[str, str]:
        """The rank's whole environment: nothing leaks in from the grader's."""
        path = os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin:/usr/bin:/bin"])
        env = {"PATH": path, "LANG": "C.UTF-8", **self.env}
        home = str(self.scratch)
        return {**env, "HOME": home, "TMPDIR": home, "PWD": home}

    def prepare(self) -> None:
        """Create the scratch directory, owned by the sandbox's uid; hand it the sockets."""
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.scratch.chmod(0o700)
        if self.level is not Level.NONE and os.geteuid() == 0:
            for path in (self.scratch, *self.sockets):
                os.chown(path, self.uid, self.gid)

    def command(self, argv: Sequence[str]) -> list[str]:
        """The argv to exec: ``bwrap ... -- argv`` for namespaces, ``argv`` otherwise."""
        if self.level is not Level.NAMESPACES:
            return list(argv)
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxError("sandbox level 'namespaces' needs bwrap on PATH")
        flags = _base_flags(self.uid, self.gid, self.tmpfs_bytes)
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
        for path in self.hidden:
            if path.is_dir():
                mount("--size", str(MiB), "--tmpfs", at=path)
                masks.append(path)
                remount += ["--remount-ro", str(path)]
            elif os.path.lexists(path):
                mount("--ro-bind", "/dev/null", at=path)
        for path in self.readable:
            mount("--ro-bind", str(path), at=path)
        mount("--bind", str(self.scratch), at=self.scratch)
        for path in self.sockets:  # connect() works through a read-only bind
            mount("--ro-bind", str(path), at=path)
        flags += remount  # last: the binds above made their mount points in the masks
        for key, value in self.environment().items():
            flags += ["--setenv", key, value]
        flags += ["--chdir", str(self.scratch)]
        return [bwrap, *flags, "--", *_inner(self.uid, self.gid), *argv]

    def pre_exec(self) -> None:
        """In the process about to exec ``command()``: limits, then (``uid``) the drop.

        Also fit for ``subprocess.Popen(preexec_fn=...)``. The process gets SIGKILL when
        its parent (the rank's wrapper) dies, from before the exec on: bwrap's own
        ``--die-with-parent`` comes too late when the wrapper is killed while bwrap
        starts (seen here: an orphaned bwrap). For ``uid`` it is set after setuid,
        which clears it.
        """
        parent = os.getppid()
        if self.level is not Level.UID:
            _die_with(parent)
        if self.level is Level.NONE:
            os.chdir(self.scratch)
            return
        with contextlib.suppress(PermissionError):  # already a session leader
            os.setsid()
        _set_limit(resource.RLIMIT_AS, self.memory_bytes)
        _set_limit(resource.RLIMIT_CORE, 0)
        _set_limit(resource.RLIMIT_FSIZE, self.max_file_bytes)
        if os.geteuid() == 0:  # NPROC counts per uid: only meaningful for a dedicated one
            _set_limit(resource.RLIMIT_NPROC, self.max_processes)
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries (su, mount) gain nothing
        if self.level is Level.UID:
            _drop_to(self.uid, self.gid)
            os.chdir(self.scratch)
            _die_with(parent)

    def exec(self, argv: Sequence[str]) -> NoReturn:
        """Become the sandboxed ``argv``: what the trusted per-rank wrapper ends with."""
        command = self.command(argv)
        env = self.environment()
        self.pre_exec()
        os.execvpe(command[0], command, env)


def _die_with(parent: int) -> None:
    """SIGKILL to this process when ``parent`` dies (kept across exec of a plain binary)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(137)


def _set_limit(resource_id: int, value: int) -> None:
    """Set soft and hard limit (a student cannot raise it back), never above the hard one."""
    _, hard = resource.getrlimit(resource_id)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(resource_id, (value, value))


def _as_uid(uid: int, gid: int, work: Callable[[], bytes]) -> bytes:
    """Run ``work`` in a forked child dropped to uid/gid; what it returns comes back.

    A fork, not a subprocess: no interpreter start, and the child only makes system
    calls before ``os._exit``.
    """
    if os.geteuid() != 0 and uid != os.geteuid():
        raise SandboxError(f"acting as uid {uid} needs root")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(read_end)
            _drop_to(uid, gid)
            os.write(write_end, work())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        out = pipe.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SandboxError(f"the check as uid {uid} failed")
    return out


def readable_by(paths: Iterable[Path], uid: int = NOBODY, gid: int = NOBODY) -> list[Path]:
    """The ``paths`` that uid/gid (no supplementary groups) can read.

    At the ``uid`` level these are the grader's files a rank could read: the grader
    should refuse to run, or warn, unless the list is empty. ``access()`` after dropping
    to the uid, so a directory on the way that the uid cannot search hides what lies
    below, and a FIFO is never opened.
    """
    paths = [Path(p) for p in paths]
    answers = _as_uid(uid, gid, lambda: bytes(os.access(p, os.R_OK) for p in paths))
    return [p for p, ok in zip(paths, answers, strict=True) if ok]


def _pids_of(uid: int) -> list[int]:
    """Live (not zombie) processes whose real, effective or saved uid is ``uid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith("Z"):
            continue
        if str(uid) in fields.get("Uid", "").split()[:3]:
            pids.append(int(entry))
    return pids


def kill_uid(uid: int, timeout: float = 10.0) -> int:
    """SIGKILL every process of ``uid`` until none is left; returns how many there were.

    ``kill(-1)`` sent as the uid itself reaches all of them in one call (a fork bomb
    cannot outrun it); then /proc is read again until it shows none.
    """
    if uid == 0 or uid == os.geteuid():
        raise SandboxError(f"refusing to kill every process of uid {uid}: it is the grader's")
    if sys.platform != "linux":
        raise SandboxError("kill_uid reads /proc: Linux only")
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while pids := _pids_of(uid):
        seen.update(pids)
        if time.monotonic() > deadline:
            raise SandboxError(f"processes of uid {uid} survive SIGKILL: {sorted(pids)}")
        _as_uid(uid, NOBODY, _kill_all)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    return len(seen)


def _kill_all() -> bytes:
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)  # every process we may signal, except ourselves
    return b""
