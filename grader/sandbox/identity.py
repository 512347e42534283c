"""Every grading its own uids: a block reserved for one run, a uid per rank, none shared.

As root (the ``uid`` level, and ``namespaces`` where privileged bubblewrap drops the rank
to a uid with ``setpriv``), what separates two gradings and what the kernel counts per
user (RLIMIT_NPROC, keyrings, signals, the owner of a file in a shared /tmp) is the rank's
uid. So each run reserves a block of uids that nothing else on the machine uses: the
blocks lie in a range no distribution allocates (above the 16-bit ids and the ranges
systemd hands out: systemd's UIDS-GIDS.md leaves 0x70000000-0x7FFFFFFF unused), and a block
is held by an ``flock`` on its file in ``/run/grader-uids`` for as long as the run's
process lives, so that a grading killed without a word frees it too. A block whose uids
still own a process (one of another program, or a rank that outlived a killed grader) is
skipped, never killed: the cleanup kills only its own job's processes. Rank ``r`` of this
node runs as ``first + r``, and every rank of the block in group ``first``, with no
supplementary groups: the folders a job reads (its submission) are that group's alone
(:meth:`Identity.share`). A run holds two blocks: its submission's ranks and the
reference's, which no student rank shares.

A grader that is not root needs none of this: bubblewrap gives each rank a user namespace
of its own (``--unshare-user``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from grader import sandbox
from grader.sandbox import NOBODY, SandboxError

__all__ = [
    "FIRST_UID",
    "Identity",
    "kill_uid",
    "pids_of",
    "readable_by",
    "release_all",
    "remove_files",
    "reserve",
]

FIRST_UID = 0x71000000  # 1895825408: inside systemd's unused range, clear of its edges
BLOCK = 256  # uids per run: the most ranks one node runs
BLOCKS = 4096
LOCK_DIR = Path("/run/grader-uids")
#: Where any uid may create files: what a job's uids leave here is removed at its end.
_SHARED_WRITABLE = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))


@dataclass(frozen=True)
class Identity:
    """The uids ``first .. first + count - 1``, this run's alone while ``lock`` is open."""

    first: int
    count: int
    lock: int  # the open descriptor holding the block's flock

    def uid(self, local_rank: int) -> int:
        if not 0 <= local_rank < self.count:
            raise SandboxError(f"a node runs at most {self.count} ranks")
        return self.first + local_rank

    @property
    def uids(self) -> range:
        return range(self.first, self.first + self.count)

    @property
    def group(self) -> int:
        """The gid every rank of the block runs in."""
        return self.first

    def share(self, folder: Path) -> None:
        """Make ``folder`` (the grader's) readable by this block's ranks and by no other
        uid: owned by root and the block's group, 0750."""
        os.chown(folder, 0, self.group)
        folder.chmod(0o750)

    def end_jobs(self) -> int:
        """SIGKILL every process of the block's uids; returns how many there were."""
        running = _uids_running(set(self.uids))  # one look at /proc, not one per uid
        return sum(kill_uid(uid) for uid in sorted(running))

    def clear(self) -> None:
        """End the block's jobs and remove the files its uids left where anyone may write
        (at the ``uid`` level /tmp is the host's): nothing of theirs reaches a later job."""
        self.end_jobs()
        _remove_owned(_SHARED_WRITABLE, set(self.uids))

    def release(self) -> None:
        """:meth:`clear`, and give the block back. After the run's own folders are gone."""
        try:
            self.clear()
        finally:
            os.close(self.lock)


def reserve(count: int = BLOCK, leftovers: bool = True) -> Identity:
    """A block of ``count`` uids that no process uses, locked for this process (root only).
    ``leftovers``: remove what an earlier holder (a killed grader) left; False where the
    caller does (:func:`remove_files`, :func:`release_all`), in one pass with other blocks."""
    if os.geteuid() != 0:
        raise SandboxError("reserving uids for the ranks needs root")
    LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    busy = _busy_uids()
    for block in random.sample(range(BLOCKS), BLOCKS):  # graders starting together spread out
        first = FIRST_UID + block * BLOCK
        if busy.intersection(range(first, first + count)):
            continue
        lock = os.open(lock_path(first), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            continue
        identity = Identity(first, count, lock)
        if leftovers:
            remove_files([identity])
        return identity
    raise SandboxError(f"every block of uids for the ranks is in use ({LOCK_DIR})")


def lock_path(first: int) -> Path:
    """The file whose ``flock`` holds the block of uids that begins at ``first``."""
    return LOCK_DIR / f"{first}.lock"


def _busy_uids() -> set[int]:
    """The real, effective and saved uids of every live process."""
    busy: set[int] = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{entry}/status").read_text().splitlines():
                if line.startswith("Uid:"):
                    busy.update(int(uid) for uid in line.split()[1:4])
                    break
    return busy


def remove_files(identities: Iterable[Identity]) -> None:
    """Remove every file the blocks' uids left where any uid may write, in one pass."""
    _remove_owned(_SHARED_WRITABLE, {uid for identity in identities for uid in identity.uids})


def release_all(identities: Iterable[Identity], clear_too: Iterable[Identity] = ()) -> None:
    """:meth:`Identity.release` of each block, their shared folders gone through once (with
    ``clear_too``'s, blocks just reserved, whose earlier holder may have left files)."""
    identities = list(identities)
    try:
        for identity in identities:
            identity.end_jobs()
        remove_files([*identities, *clear_too])
    finally:
        for identity in identities:
            os.close(identity.lock)


#: find(1), from the system's own folders: it walks a loaded /tmp (tens of thousands of
#: entries) at C's speed, where Python's os.walk takes seconds of CPU.
_FIND = next((f for f in ("/usr/bin/find", "/bin/find") if os.access(f, os.X_OK)), None)


def _remove_owned(roots: Iterable[Path], uids: set[int]) -> None:
    """Delete what ``uids`` own below ``roots`` (never following a link, never leaving the
    root's file system): found by find(1) in one pass over the roots, each entry it names
    checked again here before it goes; without find, by a walk of Python's."""
    devices = {}
    for root in roots:
        with contextlib.suppress(OSError):
            devices[root] = root.stat().st_dev
    if not devices or not uids:
        return
    if _FIND is None:
        for root, device in devices.items():
            _walk_and_remove(root, device, uids)
        return
    match: list[str] = []
    for first, last in _ranges(uids):
        match += ["-o", "(", "-uid", f"+{first - 1}", "-uid", f"-{last + 1}", ")"]
    command = [_FIND, *map(str, devices), "-xdev", "-mindepth", "1", "(", *match[1:], ")"]
    found = subprocess.run([*command, "-prune", "-print0"], capture_output=True, check=False)
    for raw in filter(None, found.stdout.split(b"\0")):
        path = os.fsdecode(raw)
        root = next((r for r in devices if path.startswith(f"{r}/")), None)
        if root is not None:
            _remove_if_owned(path, devices[root], uids)


def _ranges(uids: set[int]) -> list[tuple[int, int]]:
    """``uids`` as runs of consecutive ids, (first, last) each."""
    runs: list[tuple[int, int]] = []
    for uid in sorted(uids):
        if runs and uid == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], uid)
        else:
            runs.append((uid, uid))
    return runs


def _walk_and_remove(root: Path, device: int, uids: set[int]) -> None:
    for folder, dirs, files in os.walk(root, topdown=False):
        for name in files + dirs:
            _remove_if_owned(os.path.join(folder, name), device, uids)


def _remove_if_owned(path: str, device: int, uids: set[int]) -> None:
    """Remove ``path`` (a folder whole, a link itself) if one of ``uids`` owns it on
    ``device``."""
    with contextlib.suppress(OSError):
        info = os.lstat(path)
        if info.st_dev != device or info.st_uid not in uids:
            return
        if stat.S_ISDIR(info.st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


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
            sandbox.drop_to(uid, gid)
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


def pids_of(uid: int) -> list[int]:
    """Live (not zombie) processes whose real, effective or saved uid is ``uid``."""
    return [pid for pid, uids in _live_processes() if uid in uids]


def _uids_running(uids: set[int]) -> set[int]:
    """Which of ``uids`` are the real, effective or saved uid of a live process."""
    return {uid for _, held in _live_processes() for uid in held & uids}


def _live_processes() -> Iterator[tuple[int, set[int]]]:
    """Each live (not zombie) process: its pid, and its real, effective and saved uids."""
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
        yield int(entry), {int(u) for u in fields.get("Uid", "").split()[:3]}


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
    while pids := pids_of(uid):
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
