"""Rank-side scenarios of the strategy parts: the grader's code that drives the student's classes.

A graded test calls ``world.call(scenario="data_parallel.train", args=...)``:
the rank imports ``grader.scenarios.data_parallel`` and calls ``train(student,
*args)`` with the student's module. A scenario builds what it is told to,
runs it, and returns observations (tensors, numbers, lists, dicts); it holds
no expected value, and the test compares what it returns with a one-process
oracle computed on the trusted side.

:func:`mark` puts a point in the broker's record of the rank's operations,
so that a test can see, say, whether an all-reduce was posted before
``backward()`` returned. It is posted from the rank, so it says what the
scenario saw, not more.
"""

from __future__ import annotations

import ctypes
import gc

import torch

from grader import protocol
from grader.rank import link as _link


def gate(label: str) -> torch.Tensor:
    """Pass the test's gate ``label``: block until the broker opens it, and return what it
    hands over (float64), without which the scenario's result would be wrong. The broker
    opens it only once this rank has done what the test requires first (a causal fact, from
    what the rank sent); no mark can stand in for it."""
    current = _link.current()
    if current is None:
        raise RuntimeError("a gate outside of a graded call")
    answer: list[bytes] = []
    op = current.start_op(protocol.GATE, lambda frame: answer.extend(frame.buffers), [],
                          label=label)  # fmt: skip
    op.wait(current)
    return torch.frombuffer(bytearray(answer[0]), dtype=torch.float64).clone()


def _libc() -> ctypes.CDLL | None:
    """The C library's functions, as the process has them (glibc's ``malloc_trim``: Linux)."""
    try:
        libc = ctypes.CDLL(None)
    except (OSError, TypeError):
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def measured_gate(label: str) -> torch.Tensor:
    """:func:`gate` ``label``, where the broker reads this rank's resident memory
    (:mod:`grader.broker.memory`): unreachable objects are collected first, and the allocator
    hands back to the system what was freed (glibc's ``malloc_trim``; the ranks' allocator
    otherwise keeps it, to reuse it), so that what the kernel counts is what the rank's
    process holds. Code that skipped this would only be charged more: nothing makes memory
    a process holds invisible."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    return gate(label)


def mark(label: str) -> None:
    """Record ``label`` in the broker's trace of this rank, between its operations."""
    current = _link.current()
    if current is not None:
        current.post(protocol.MARK, label=label)
