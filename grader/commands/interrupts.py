"""How Ctrl-C and SIGTERM stop a command: one rule for every command of ``grader``.

SIGTERM (a scheduler, CI, ``grader batch`` stopping a grader) is Ctrl-C: a
KeyboardInterrupt, which each command turns into ending what it started and exit status
130. Two kinds of code must not take it where it lands:

- an import that runs C++ (torch's first): a KeyboardInterrupt raised inside a Python
  callback of C++ goes through pybind11 and aborts the process;
- pytest's collection of the tests, which takes an interrupt for a failure of its own.

Around those, :func:`after` records the signal and interrupts once the block is done;
:func:`held` blocks both signals for a few system calls that must happen together.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType


@contextlib.contextmanager
def sigterm_is_ctrl_c() -> Iterator[None]:
    """For the block, SIGTERM raises KeyboardInterrupt, as Ctrl-C does."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
        raise KeyboardInterrupt


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait for the block's end, where they interrupt at once. For a few
    system calls only: a process started meanwhile would inherit the mask."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt
