"""Watches torch.distributed's collectives: blocks them where forbidden, logs them elsewhere.

The collectives part asks students to build every collective from
point-to-point messages; calling ``dist.all_reduce`` would pass the
correctness tests without learning anything. The guard is installed before
the submission is imported, so that ``from torch.distributed import
all_reduce`` captures the guarded function too, and it only bites while a
test of a part that forbids collectives is running: the rest of the time it
hands every call to the original.

A blocked call raises :class:`ForbiddenCall`, a ``BaseException`` so that a
student's ``except Exception`` does not swallow it, and is remembered, so
that the test is graded ``forbidden`` even if the student catches it anyway.

Where collectives are allowed, each call is handed to the active
:class:`grader.rank.p2p.MessageLog`, if any, so that a test can count the
all-reduces of a DataParallel step or see when the first one started.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C import _distributed_c10d as _c10d_ext

from grader.rank import p2p
from grader.rank.frames import student_location

# The collectives of torch.distributed's Python API ...
MODULE_FUNCTIONS = (
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "_all_gather_base",
    "_reduce_scatter_base",
    "_broadcast_coalesced",
)
# ... and the methods of a process group object and of its backends.
GROUP_METHODS = (
    "allgather",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "all_gather_single",
    "all_gather_single_coalesced",
    "allreduce",
    "allreduce_coalesced",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "gather",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "scatter",
    "_allgather_base",
    "_reduce_scatter_base",
)


class ForbiddenCall(BaseException):
    """A built-in collective was called where only point-to-point messages are allowed."""


_active = False
violations: list[str] = []
_depth = 0  # dist.all_reduce calls ProcessGroup.allreduce: only the outermost call counts


def install() -> None:
    """Guard every collective; call once, before the submission is imported."""
    for module in (dist, c10d):
        for name in MODULE_FUNCTIONS:
            _guard_attribute(module, name, f"torch.distributed.{name}")
    for cls in (_c10d_ext.ProcessGroup, _c10d_ext.Backend):
        for name in GROUP_METHODS:
            _guard_attribute(cls, name, f"ProcessGroup.{name}")


def activate() -> None:
    global _active
    _active = True
    violations.clear()


def deactivate() -> list[str]:
    """Stop guarding; return the forbidden calls made since ``activate``."""
    global _active
    _active = False
    return list(violations)


def _guard_attribute(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name, None)
    if original is None or getattr(original, "_grader_guarded", False):
        return
    guarded = _guard(original, label)
    try:
        setattr(owner, name, guarded)
    except (AttributeError, TypeError):
        return  # an attribute that cannot be replaced cannot be reached by students either


def _guard(original: Callable, label: str) -> Callable:
    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        global _depth
        if not _active:
            if _depth == 0 and p2p.active_log is not None:
                p2p.active_log.on_collective(label.rsplit(".", 1)[-1], _tensor_bytes(args, kwargs))
            _depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                _depth -= 1
        where = student_location()
        message = (
            f"called {label}" + (f" at {where}" if where else "") + ": built-in collectives are "
            "not allowed in this part; build it from send/recv/isend/irecv"
        )
        violations.append(message)
        raise ForbiddenCall(message)

    guarded._grader_guarded = True  # type: ignore[attr-defined]
    return guarded


def _tensor_bytes(args: tuple, kwargs: dict) -> int:
    """The bytes of the first tensor (or list of tensors) among a call's arguments."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return sum(t.numel() * t.element_size() for t in value)
    return 0
