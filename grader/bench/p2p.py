"""Logs the point-to-point messages a submission makes during ``grader bench``.

``torch.distributed``'s ``send``, ``recv``, ``isend`` and ``irecv`` are replaced,
before the submission is imported, by wrappers that hand every message to the
active :class:`MessageLog`, if any: sends when posted, receives when they
arrive, which is what the projections of the message pattern need.

``batch_isend_irecv`` and ``P2POp`` call ``isend``/``irecv`` through the module's
globals, so they are covered by the same wrappers. (Graded jobs need none of
this: there the broker carries and counts every message.)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


@dataclass(frozen=True)
class _Watched:
    """What a point-to-point function of torch.distributed does: send or receive, at once
    (blocking) or by a request."""

    sends: bool
    blocking: bool

    @property
    def peer_argument(self) -> str:
        return "dst" if self.sends else "src"


_WATCHED = {
    "send": _Watched(sends=True, blocking=True),
    "recv": _Watched(sends=False, blocking=True),
    "isend": _Watched(sends=True, blocking=False),
    "irecv": _Watched(sends=False, blocking=False),
}


class MessageLog:
    """Receives every message made while it is active.

    ``on_recv`` is called when the message has arrived (``recv`` returned or
    the ``irecv``'s request was waited), which is what the round count needs.
    """

    def on_send(self, peer: int, nbytes: int, tag: int) -> None: ...

    def on_recv(self, peer: int, nbytes: int, tag: int) -> None: ...


active_log: MessageLog | None = None
# torch's own recv may call irecv, which is wrapped too: only the outermost call counts.
_depth = 0


def install() -> None:
    """Replace the point-to-point functions; call once, before the submission is imported."""
    for name, watched in _WATCHED.items():
        original = getattr(c10d, name)
        if getattr(original, "_grader_watched", False):
            continue
        wrapper = _blocking(name, original) if watched.blocking else _posting(name, original)
        wrapper._grader_watched = True  # type: ignore[attr-defined]
        setattr(c10d, name, wrapper)
        setattr(dist, name, wrapper)


def _peer_and_tag(name: str, original: Callable, args: tuple, kwargs: dict) -> tuple[int, int]:
    """The call's peer as a global rank (-1: any rank), and its tag."""
    bound = _signature(original).bind(*args, **kwargs)
    arguments = bound.arguments
    peer = arguments.get(_WATCHED[name].peer_argument)
    group_peer = arguments.get("group_" + _WATCHED[name].peer_argument)
    group = arguments.get("group")
    if peer is None and group_peer is not None:
        peer = dist.get_global_rank(group, group_peer) if group is not None else group_peer
    return -1 if peer is None else int(peer), int(arguments.get("tag", 0))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@functools.cache
def _signature(function: Callable) -> inspect.Signature:
    return inspect.signature(function)


def _record(name: str, tensor: torch.Tensor, peer: int, tag: int) -> None:
    if active_log is None:
        return
    if _WATCHED[name].sends:
        active_log.on_send(peer, _nbytes(tensor), tag)
    else:
        active_log.on_recv(peer, _nbytes(tensor), tag)


@contextlib.contextmanager
def _outermost() -> Iterator[bool]:
    global _depth
    _depth += 1
    try:
        yield _depth == 1
    finally:
        _depth -= 1


def _blocking(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _outermost() as outermost:
            if not outermost:
                return original(*args, **kwargs)
            return _logged_blocking(name, original, args, kwargs)

    return wrapper


def _logged_blocking(name: str, original: Callable, args: tuple, kwargs: dict) -> Any:
    peer, tag = _peer_and_tag(name, original, args, kwargs)
    tensor = args[0] if args else kwargs["tensor"]
    sends = _WATCHED[name].sends
    if sends:
        _record(name, tensor, peer, tag)
    result = original(*args, **kwargs)
    if not sends:
        _record(name, tensor, peer if peer >= 0 else int(result), tag)
    return result


def _posting(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _depth:
            return original(*args, **kwargs)
        peer, tag = _peer_and_tag(name, original, args, kwargs)
        tensor = args[0] if args else kwargs["tensor"]
        sends = _WATCHED[name].sends
        if sends:
            _record(name, tensor, peer, tag)
        work = original(*args, **kwargs)
        if work is None:
            return None
        on_done = (lambda: _record(name, tensor, peer, tag)) if not sends else None
        return TrackedWork(work, on_done)

    return wrapper


class TrackedWork:
    """A request of ``isend``/``irecv`` that logs its receive once it has arrived."""

    def __init__(self, work: Any, on_done: Callable[[], None] | None) -> None:
        self._work = work
        self._on_done = on_done

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        with _outermost():
            result = self._work.wait(*args, **kwargs)
        self._done()
        return result

    def is_completed(self) -> bool:
        completed = self._work.is_completed()
        if completed:
            self._done()
        return completed

    def _done(self) -> None:
        if self._on_done is not None:
            on_done, self._on_done = self._on_done, None
            on_done()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
