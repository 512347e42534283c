"""The seccomp filter of every sandboxed rank: kernel objects that no namespace separates.

Namespaces give each rank its own mounts, PIDs, network and IPC, and a uid of its own job;
what follows is shared by every process on the machine whatever its namespaces, so two
sandboxes (two ranks, two gradings, a grading and a later one) could pass data through it.
Each of these system calls fails with ``EPERM`` (the rank sees ``PermissionError``), except
``clone3``, which says ``ENOSYS`` so that the C library falls back to ``clone``, whose flags
the filter can read. Everything else is allowed: the filter is a deny-list of channels, not
a second sandbox.

===================================  =====================================================
refused                              why
===================================  =====================================================
``socket``, every family             a rank's one way out is the connection to the broker
                                     that its trusted wrapper made and handed it: no TCP
                                     (a rendezvous store on loopback), no netlink, no Unix
                                     socket of the system's (dbus, journald) or abstract.
``fcntl`` F_SETLK, F_SETLKW,         POSIX and open-file-description byte-range locks live
F_GETLK, F_OFD_SETLK, F_OFD_SETLKW,  on the inode: a lock set on a file every sandbox can
F_OFD_GETLK; ``flock``               open (the read-only system) is seen by all of them,
                                     one bit per byte offset (issue 15's attack). Scoping
                                     them to the scratch directory is not feasible: seccomp
                                     sees a file descriptor's number, never its file, and
                                     no other unprivileged mechanism (Landlock included)
                                     filters locks. So all are refused; nothing the grader
                                     runs on a rank takes a lock.
``fcntl`` F_SETLEASE, F_GETLEASE,    a lease or a directory notification fires when another
F_NOTIFY; ``inotify_init(1)``,       process opens or reads a shared file: a channel
``fanotify_init``                    through the timing of another sandbox's accesses.
``add_key``, ``keyctl``,             kernel keyrings belong to the uid, not to a namespace,
``request_key``                      and outlive the process (a key read 81 s after its
                                     grading ended).
``ptrace``, ``process_vm_readv``,    reading or writing another process's memory or file
``process_vm_writev``, ``kcmp``,     descriptors (a rank of the same job, at the ``uid``
``pidfd_getfd``                      level the same uid).
SysV ``shm*``, ``msg*``, ``sem*``;   at the ``uid`` level the IPC namespace is the host's:
POSIX ``mq_*``                       segments, queues and semaphores outlive the job.
``unshare``, ``setns``, ``clone``    a new namespace (a user namespace needs no privilege)
with a ``CLONE_NEW*`` flag,          gives the rank capabilities over it, and mounts in it:
``clone3`` (ENOSYS), ``mount`` and   nothing a rank needs, and the way around the rest.
the new mount API, ``pivot_root``
``io_uring_setup``                   io_uring's operations bypass this filter.
``setpriority``, ``sched_setattr``,  any process reads another's niceness, policy, CPUs
``sched_setscheduler``,              and I/O priority (``getpriority``,
``sched_setparam``,                  ``sched_getscheduler``, ``sched_getaffinity``,
``sched_setaffinity``,               ``ioprio_get``), whatever its uid: a rank that sets
``ioprio_set``                       its own is read by the others of its job, bits that
                                     no broker carries. A rank keeps the defaults.
``fork``, ``vfork``, ``clone``       a new process: the kernel's accounting of the rank
without ``CLONE_THREAD``             (``grader/broker/accounting.py``) counts its own
                                     threads, not its children, so a child could compute
                                     while the rank waits on the broker and its work would
                                     never be charged. Threads stay allowed (torch's, the
                                     student's): they are counted.
===================================  =====================================================

The program is compiled with libseccomp (the system's ``libseccomp2``) through its Python
bindings: Debian's ``python3-seccomp`` (``import seccomp``) or PyPI's ``pyseccomp``, a ctypes
binding with the same API. Only the native architecture is allowed: a system call through
another ABI (i386's ``int 0x80``, or x32's, on x86-64) kills the whole process. Bubblewrap
applies the program (``--seccomp FD``) last, after building the namespaces; the ``uid`` level
loads it in the rank's process before the exec. A student's own run at ``none`` needs none of
this.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from collections.abc import Iterator
from types import ModuleType

__all__ = ["REFUSED", "FilterUnavailable", "load", "program", "program_fd"]

# fcntl's lock, lease and notify commands (<fcntl.h>; F_OFD_* since Linux 3.15).
_F_GETLK, _F_SETLK, _F_SETLKW = 5, 6, 7
_F_OFD_GETLK, _F_OFD_SETLK, _F_OFD_SETLKW = 36, 37, 38
_F_SETLEASE, _F_GETLEASE, _F_NOTIFY = 1024, 1025, 1026
LOCK_COMMANDS = (_F_GETLK, _F_SETLK, _F_SETLKW, _F_OFD_GETLK, _F_OFD_SETLK, _F_OFD_SETLKW)
_FCNTL_REFUSED = (*LOCK_COMMANDS, _F_SETLEASE, _F_GETLEASE, _F_NOTIFY)
# <linux/sched.h>: a new thread of the caller's process, and the namespace flags of clone(2).
_CLONE_THREAD = 0x00010000
_CLONE_NEW = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
    "CLONE_NEWTIME": 0x00000080,
}

#: Refused outright (EPERM), by channel; names this architecture lacks are skipped.
REFUSED: dict[str, tuple[str, ...]] = {
    "sockets": ("socket",),  # the rank's one connection is inherited, made by its wrapper
    "new processes": ("fork", "vfork"),  # and clone without CLONE_THREAD (_rules)
    "file locks": ("flock",),
    "watching shared files": ("inotify_init", "inotify_init1", "fanotify_init"),
    "keyrings": ("add_key", "keyctl", "request_key"),
    "other processes' memory": (
        "ptrace",
        "process_vm_readv",
        "process_vm_writev",
        "kcmp",
        "pidfd_getfd",
    ),
    "System V and POSIX IPC": (
        *("shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl"),
        *("semget", "semop", "semtimedop", "semctl", "ipc"),
        *("mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify"),
        "mq_getsetattr",
    ),
    "namespaces and mounts": (
        *("unshare", "setns", "mount", "umount2", "pivot_root", "mount_setattr"),
        *("fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree"),
    ),
    "io_uring": ("io_uring_setup",),
    "scheduling others read": (
        *("setpriority", "sched_setscheduler", "sched_setparam", "sched_setattr"),
        *("sched_setaffinity", "ioprio_set"),
    ),
}


class FilterUnavailable(RuntimeError):
    """No libseccomp binding here; the message is one line that names the fix."""


def _binding() -> ModuleType:
    try:
        import seccomp  # Debian's python3-seccomp
    except ImportError:
        try:
            import pyseccomp as seccomp  # PyPI's, ctypes over libseccomp2
        except (ImportError, OSError) as err:  # OSError: the library itself is missing
            raise FilterUnavailable(
                "the rank's seccomp filter needs libseccomp's Python binding "
                f"(pip install pyseccomp, with the system's libseccomp2): {err}"
            ) from None
    return seccomp


def _rules(seccomp: ModuleType) -> Iterator[tuple[int, str, tuple[object, ...]]]:
    """(action, system call, argument conditions) for every refusal."""
    eperm = seccomp.ERRNO(errno.EPERM)
    for names in REFUSED.values():
        for name in names:
            yield eperm, name, ()
    for name in ("fcntl", "fcntl64"):
        for command in _FCNTL_REFUSED:
            yield eperm, name, (seccomp.Arg(1, seccomp.EQ, command),)
    for flag in _CLONE_NEW.values():  # clone's flags are its first argument on every ABI here
        yield eperm, "clone", (seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag),)
    yield eperm, "clone", (seccomp.Arg(0, seccomp.MASKED_EQ, _CLONE_THREAD, 0),)  # a process
    yield seccomp.ERRNO(errno.ENOSYS), "clone3", ()  # flags behind a pointer: fall back


def _build() -> object:
    seccomp = _binding()
    native = seccomp.system_arch()
    syscall_filter = seccomp.SyscallFilter(seccomp.ALLOW)
    # Another ABI's call ends the whole process (libseccomp's default ends the calling thread
    # alone, and a rank would hang on with its other threads).
    syscall_filter.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    for action, name, conditions in _rules(seccomp):
        if seccomp.resolve_syscall(native, name) < 0:  # not on this architecture
            continue
        syscall_filter.add_rule(action, name, *conditions)
    return syscall_filter


@functools.cache
def program() -> bytes:
    """The filter as a BPF program (what bubblewrap's ``--seccomp FD`` reads)."""
    with open(os.memfd_create("grader-seccomp"), "w+b") as out:
        _build().export_bpf(out)
        out.seek(0)
        return out.read()


def program_fd() -> int:
    """A new inheritable descriptor that reads :func:`program` from its start."""
    fd = os.memfd_create("grader-seccomp", 0)  # not MFD_CLOEXEC: bwrap inherits it
    os.write(fd, program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class _SockFprog(ctypes.Structure):
    """<linux/filter.h>'s struct sock_fprog: a BPF program's length (in 8-byte instructions)
    and address."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2


def load(bpf: bytes) -> None:
    """Apply ``bpf`` (:func:`program`, made before a fork) to this process and all it
    starts, for good. Only system calls: fit for the child between fork and exec. The caller
    has set no_new_privs (or is root)."""
    fprog = _SockFprog(len(bpf) // 8, bpf)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
