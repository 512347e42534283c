"""How Ctrl-C and SIGTERM stop a command: one rule for every command of ``grader``.

SIGTERM (a scheduler, CI, ``grader batch`` stopping a grader) is Ctrl-C: a
KeyboardInterrupt, which each command turns into ending what it started and exit status
130. Two kinds of code must not take it where it lands:

- an import that runs C++ (torch's first): a KeyboardInterrupt raised inside a Python
  callback of C++ goes through pybind11 and aborts the process;
- pytest's collection of the tests, which takes an interrupt for a failure of its own.

Around those, :func:`after` records the signal and interrupts once the block is done;
:func:`held` blocks both signals for a few system calls that must happen together.

The grader raises :class:`Interrupted`, a KeyboardInterrupt of its own, never the builtin:
CPython remembers a KeyboardInterrupt that passes out of code run by ``exec`` of a string
(a dataclass's methods are made so, at import), and a program run by ``python -m`` then
dies by SIGINT at its exit, whatever it returned. A grader stopped while importing ended
so (status -2, not 130, about once in a hundred SIGTERMs); a subclass is not remembered.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM, as the grader's handlers raise it (caught as any KeyboardInterrupt)."""


@contextlib.contextmanager
def sigterm_is_ctrl_c(came: list[int] | None = None) -> Iterator[None]:
    """For the block, SIGTERM raises :class:`Interrupted`, as Ctrl-C does (a signal ignored
    stays so); each signal is also added to ``came``, for a block that may make of the
    interrupt what it likes (pytest reports one as an outcome of its own)."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        if came is not None:
            came.append(signum)
        raise Interrupted

    previous = {
        sig: signal.signal(sig, interrupt)
        for sig in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(sig) != signal.SIG_IGN
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def after() -> Iterator[None]:
    """Ctrl-C and SIGTERM during the block interrupt at its end, not inside it."""
    came: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: came.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(sig) != signal.SIG_IGN  # a signal ignored stays so
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if came:
        raise Interrupted


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait for the block's end, where they interrupt at once. For a few
    system calls only: a process started meanwhile would inherit the mask."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
