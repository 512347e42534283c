"""Landlock: a rank restricts itself to an allow-list of paths, for good, without privileges.

The kernel's Landlock LSM (Linux 5.13+) lets an unprivileged process give up every file
system access it does not list, and (ABI 4+) TCP, (ABI 6+) abstract Unix sockets and
signals outside its own domain; its children inherit the restriction and none can lift it.
The rank's entry point (:mod:`grader.rank.__main__`) applies it before the interpreter
imports anything else, from the plan the trusted wrapper wrote into the rank's environment:
at ``uid`` it is what makes the allow-list a wall (file permissions can hide a folder, not
allow a list), at ``namespaces`` a second wall behind the mounts.

Three system calls, made through ctypes: PyPI's bindings are development releases, and the
interface is three calls and two structures (``<linux/landlock.h>``).
"""

from __future__ import annotations

import ctypes
import enum
import errno
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Access", "LandlockUnavailable", "Rule", "abi", "enter", "own_rules", "restrict"]

#: Where the trusted wrapper puts a rank's allow-list, one :meth:`Rule.to_text` a line.
ENV_VAR = "GRADER_LANDLOCK"

# <asm-generic/unistd.h>: the same numbers on every architecture Linux has.
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
#: The least ABI the ranks need: the file system allow-list (network sockets are refused by
#: the seccomp filter at every level; ABI 4's TCP rules and ABI 6's scopes add to it).
MIN_ABI = 1


class Access(enum.IntFlag):
    """``LANDLOCK_ACCESS_FS_*``, with the ABI that brought each."""

    EXECUTE = 1 << 0
    WRITE_FILE = 1 << 1
    READ_FILE = 1 << 2
    READ_DIR = 1 << 3
    REMOVE_DIR = 1 << 4
    REMOVE_FILE = 1 << 5
    MAKE_CHAR = 1 << 6
    MAKE_DIR = 1 << 7
    MAKE_REG = 1 << 8
    MAKE_SOCK = 1 << 9
    MAKE_FIFO = 1 << 10
    MAKE_BLOCK = 1 << 11
    MAKE_SYM = 1 << 12
    REFER = 1 << 13  # ABI 2
    TRUNCATE = 1 << 14  # ABI 3
    IOCTL_DEV = 1 << 15  # ABI 5

    @classmethod
    def handled(cls, version: int) -> Access:
        """Every right the kernel of ``version`` knows: all of them are denied unless a rule
        allows them."""
        rights = cls(0)
        for right in cls:
            if version >= _SINCE.get(right, 1):
                rights |= right
        return rights


_SINCE = {Access.REFER: 2, Access.TRUNCATE: 3, Access.IOCTL_DEV: 5}
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4: no rule, so no TCP at all
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6: nothing outside the domain

#: What a rank may do below each kind of allowed path.
READ = Access.READ_FILE | Access.READ_DIR | Access.EXECUTE
WRITE = (
    READ
    | Access.WRITE_FILE
    | Access.REMOVE_DIR
    | Access.REMOVE_FILE
    | Access.MAKE_DIR
    | Access.MAKE_REG
    | Access.MAKE_SYM
    | Access.TRUNCATE
)
DEVICE = Access.READ_FILE | Access.WRITE_FILE  # /dev/null and its kin
_FILE_RIGHTS = (
    Access.EXECUTE | Access.WRITE_FILE | Access.READ_FILE | Access.TRUNCATE | Access.IOCTL_DEV
)


@dataclass(frozen=True)
class Rule:
    """``access`` to ``path`` and everything below it (a file: that file)."""

    path: str
    access: Access

    def to_text(self) -> str:
        return f"{int(self.access)}:{self.path}"

    @classmethod
    def from_text(cls, text: str) -> Rule:
        access, path = text.split(":", 1)
        return cls(path, Access(int(access)))


class LandlockUnavailable(RuntimeError):
    """This kernel cannot restrict a process by Landlock; the message is one line."""


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def abi() -> int:
    """The Landlock ABI this kernel offers; raises :class:`LandlockUnavailable` if none."""
    if sys.platform != "linux":
        raise LandlockUnavailable("Landlock needs Linux")
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    version = libc.syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), _CREATE_RULESET_VERSION)
    if version < MIN_ABI:
        code = ctypes.get_errno()
        why = {
            errno.ENOSYS: "this kernel has no Landlock (Linux 5.13 or newer needed)",
            errno.EOPNOTSUPP: "Landlock is not enabled (add landlock to the kernel's lsm= list)",
        }.get(code, f"Landlock is refused here ({os.strerror(code)})")
        raise LandlockUnavailable(why)
    return int(version)


def restrict(rules: Iterable[Rule]) -> int:
    """Allow this process (and all it starts) ``rules`` and nothing else, for good; returns
    the ABI applied. Paths that do not exist are skipped. Raises :class:`LandlockUnavailable`
    or :class:`OSError`; on error nothing was restricted."""
    version = abi()
    handled = Access.handled(version)
    attr = _RulesetAttr(handled, 0, 0)
    size = ctypes.sizeof(_RulesetAttr)
    if version >= 4:
        attr.handled_access_net = _NET_BIND_TCP | _NET_CONNECT_TCP
    if version >= 6:
        attr.scoped = _SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    ruleset = libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        for rule in rules:
            _add(libc, ruleset, rule, handled)
        _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        _check(libc.syscall(_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return version


def _add(libc: ctypes.CDLL, ruleset: int, rule: Rule, handled: Access) -> None:
    try:
        fd = os.open(rule.path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        access = rule.access & handled
        if not os.path.isdir(rule.path):  # a file takes only the rights that act on files
            access &= _FILE_RIGHTS
        beneath = _PathBeneathAttr(int(access), fd)
        _check(libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(beneath), 0),
               f"landlock_add_rule({rule.path})")  # fmt: skip
    finally:
        os.close(fd)


def _check(result: int, what: str) -> None:
    if result < 0:
        raise OSError(ctypes.get_errno(), what)


def own_rules(scratch: os.PathLike[str] | str) -> tuple[Rule, ...]:
    """What every rank may reach of its own: its scratch, and its own process's files
    (``/proc/self`` is resolved by the rank that applies it: its own, never another's)."""
    return (Rule(os.fspath(scratch), WRITE), Rule("/proc/self", READ))


def enter() -> int | None:
    """The rank's first act: apply the allow-list its wrapper put in the environment, if any
    (and take it out). Returns the ABI applied, or None where there was no list."""
    text = os.environ.pop(ENV_VAR, None)
    if text is None:
        return None
    return restrict(Rule.from_text(line) for line in text.splitlines() if line)
