"""A grader process's one folder of temporary files, and the folders that dead graders left.

Everything a grader makes in the temporary directory lies in one folder of its own,
``$TMPDIR/grader-run-ID``: its session's work folder, its jobs' sockets, torch's compiler
cache, and what its own children (torchrun) make there, since ``TMPDIR`` names it for them
too. Only a socket folder whose path would be too long there (a Unix socket's path holds
at most 107 bytes) lies in ``/tmp`` instead. The grader removes all of it when it ends,
also on Ctrl-C or SIGTERM. A grader killed with SIGKILL (the OOM killer, a batch's or a
scheduler's last resort) runs no cleanup: what it made stays, and the next grader on this
machine removes it.

A folder's owner holds an exclusive ``flock`` on its ``.owner`` file for as long as it
lives, on a descriptor no child inherits; the kernel drops the lock when the owner dies,
however it dies. A socket folder in ``/tmp`` holds a hard link to that same file: a lock is
the file's, whichever name opens it. A grader starting tries the lock of every other folder
it finds whose ``.owner`` names this machine: one it can take is a dead grader's, and it
removes it. ``.owner`` comes into place (a rename) only once locked, so a folder being made
is never taken for a dead one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

from grader.protocol import rank_socket

PREFIX = "grader-run-"
SOCKETS = "grader-sockets-"
OWNER = ".owner"
SHORT = Path("/tmp")  # where a socket folder goes when the temporary directory is too deep
#: The most bytes a Unix socket's path may hold, and what a socket folder adds to it.
_SOCKET_PATH_BYTES = 107
_SOCKET_NAME_BYTES = len(f"/{SOCKETS}XXXXXXXX/") + len(rank_socket(Path(), 9999).name)


class Claim:
    """This process's folder, while it holds the lock; :meth:`release` removes it."""

    def __init__(self) -> None:
        self._environ, self._tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
        outer = Path(tempfile.gettempdir())  # where it is made, and where the others are
        sweep(outer)
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=outer)).resolve()
        try:
            self.path.chmod(0o711)  # a rank's uid passes through to its socket and scratch
            self._lock = _lock_new(self.path)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        tempfile.tempdir = os.environ["TMPDIR"] = str(self.path)

    def release(self) -> None:
        """Point ``TMPDIR`` back where it was and remove all the folder holds."""
        tempfile.tempdir = self._tempdir
        if self._environ is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = self._environ
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock)


def socket_folder() -> Path:
    """A fresh folder for a job's sockets: in the temporary directory where a socket's path
    fits there, else in ``/tmp``, linked to this process's ``.owner`` where it has one."""
    here = Path(tempfile.gettempdir())
    fits = _SOCKET_PATH_BYTES - len(os.fsencode(here)) >= _SOCKET_NAME_BYTES
    if fits or not os.access(SHORT, os.W_OK | os.X_OK):
        return Path(tempfile.mkdtemp(prefix=SOCKETS, dir=here))
    folder = Path(tempfile.mkdtemp(prefix=SOCKETS, dir=SHORT))
    if (here / OWNER).exists():
        with contextlib.suppress(OSError):  # another file system: left if its grader is killed
            os.link(here / OWNER, folder / OWNER)
    return folder


def sweep(outer: Path) -> list[Path]:
    """Remove what graders of this machine that are dead left in ``outer`` (and in ``/tmp``,
    their socket folders); returns the folders removed."""
    removed = []
    for where, prefix in ((outer, PREFIX), (SHORT, SOCKETS)):
        with contextlib.suppress(OSError):
            for folder in where.glob(f"{prefix}*"):
                if _dead(folder):
                    shutil.rmtree(folder, ignore_errors=True)
                    removed.append(folder)
    return removed


def _lock_new(folder: Path) -> int:
    """Lock a fresh ``.owner`` in ``folder``, naming this machine, and put it in place."""
    making = folder / f"{OWNER}.new"
    fd = os.open(making, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, socket.gethostname().encode())
        os.rename(making, folder / OWNER)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _dead(folder: Path) -> bool:
    """Whether ``folder``'s owner, a grader of this machine, has ended. Never for what is not
    a folder of this user's (a link, another user's), nor a folder whose ``.owner`` is
    missing (being made), names another machine (a temporary directory shared between
    nodes) or cannot be locked (a file system without ``flock``)."""
    try:
        info = os.lstat(folder)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            return False
        fd = os.open(folder / OWNER, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if os.read(fd, 256).decode(errors="replace") != socket.gethostname():
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # held: its grader lives
        return False
    finally:
        os.close(fd)
