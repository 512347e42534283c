"""Watches the point-to-point calls a submission makes, to say what a rank waits for.

``torch.distributed``'s ``send``, ``recv``, ``isend`` and ``irecv`` are replaced,
before the submission is imported, by wrappers that

- while a call blocks, keep a one-line description of it ("send to rank 1 at
  assignments/collectives.py:40 in broadcast") in a file that the supervisor
  reads when it finds the rank stuck;
- turn gloo's "Timed out waiting" into :class:`CommunicationTimeout` naming the
  call, so that a deadlock reads as "rank 0 waits in send to rank 1 while
  rank 1 waits in send to rank 0";
- hand every message to the active :class:`MessageLog`, if any, for the
  communication accounting of the strategy tests.

``batch_isend_irecv`` and ``P2POp`` call ``isend``/``irecv`` through the module's
globals, so they are covered by the same wrappers.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from grader.rank.frames import student_location

_PEER_ARGUMENT = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}
_DIRECTION = {"send": "to", "isend": "to", "recv": "from", "irecv": "from"}
_TIMEOUT_TEXT = ("Timed out", "timed out", "Timeout")
_PEER_GONE_TEXT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


class CommunicationTimeout(RuntimeError):
    """A communication call waited longer than the process group's timeout."""

    def __init__(self, call: str, peer: int) -> None:
        super().__init__(f"waits in {call}")
        self.call = call
        self.peer = peer


class PeerGone(RuntimeError):
    """A peer closed its connection mid-call: the fault is the peer's, not this rank's."""

    def __init__(self, call: str, peer: int) -> None:
        super().__init__(f"waits in {call} when a peer closed the connection")
        self.call = call
        self.peer = peer


class MessageLog:
    """Receives every message and collective call made while it is active.

    ``on_recv`` is called when the message has arrived (``recv`` returned or
    the ``irecv``'s request was waited), which is what the round count needs.
    """

    def on_send(self, peer: int, nbytes: int, tag: int) -> None: ...

    def on_recv(self, peer: int, nbytes: int, tag: int) -> None: ...

    def on_collective(self, name: str, nbytes: int) -> None: ...


_waiting_fd: int | None = None  # kept open: set and cleared around every blocking wait
active_log: MessageLog | None = None
# torch's own recv may call irecv, which is wrapped too: only the outermost call counts.
_depth = 0


def install(waiting_file: Path) -> None:
    """Replace the point-to-point functions; call once, before the submission is imported."""
    global _waiting_fd
    _waiting_fd = os.open(waiting_file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    for name in ("send", "recv", "isend", "irecv"):
        original = getattr(c10d, name)
        if getattr(original, "_grader_watched", False):
            continue
        wrapper = (
            _blocking(name, original) if name in ("send", "recv") else _posting(name, original)
        )
        wrapper._grader_watched = True  # type: ignore[attr-defined]
        setattr(c10d, name, wrapper)
        setattr(dist, name, wrapper)


def _describe(name: str, original: Callable, args: tuple, kwargs: dict) -> tuple[str, int, int]:
    """Say which call this is, with its peer as a global rank, and return (text, peer, tag)."""
    bound = _signature(original).bind(*args, **kwargs)
    arguments = bound.arguments
    peer = arguments.get(_PEER_ARGUMENT[name])
    group_peer = arguments.get("group_" + _PEER_ARGUMENT[name])
    group = arguments.get("group")
    if peer is None and group_peer is not None:
        peer = dist.get_global_rank(group, group_peer) if group is not None else group_peer
    where = student_location()
    peer_text = f"rank {peer}" if peer is not None else "any rank"
    text = f"{name} {_DIRECTION[name]} {peer_text}" + (f" at {where}" if where else "")
    return text, -1 if peer is None else int(peer), int(arguments.get("tag", 0))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@functools.cache
def _signature(function: Callable) -> inspect.Signature:
    return inspect.signature(function)


def _set_waiting(text: str, peer: int) -> None:
    if _waiting_fd is not None:
        data = f"{peer}\t{text}".encode()
        os.pwrite(_waiting_fd, data, 0)
        os.ftruncate(_waiting_fd, len(data))


def _clear_waiting() -> None:
    if _waiting_fd is not None:
        os.ftruncate(_waiting_fd, 0)


def _translate(error: RuntimeError, call: str, peer: int) -> RuntimeError:
    text = str(error)
    if any(t in text for t in _TIMEOUT_TEXT):
        return CommunicationTimeout(call, peer)
    if any(t in text for t in _PEER_GONE_TEXT):
        return PeerGone(call, peer)
    return error


def _waiting_on(call: str, peer: int, wait: Callable[[], Any]) -> Any:
    _set_waiting(call, peer)
    try:
        return wait()
    except RuntimeError as error:
        translated = _translate(error, call, peer)
        if translated is error:
            raise
        raise translated from error
    finally:
        _clear_waiting()


def _record(name: str, tensor: torch.Tensor, peer: int, tag: int) -> None:
    if active_log is None:
        return
    if name in ("send", "isend"):
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
            return _watched_blocking(name, original, args, kwargs)

    return wrapper


def _watched_blocking(name: str, original: Callable, args: tuple, kwargs: dict) -> Any:
    call, peer, tag = _describe(name, original, args, kwargs)
    tensor = args[0] if args else kwargs["tensor"]
    if name == "send":
        _record(name, tensor, peer, tag)
    result = _waiting_on(call, peer, lambda: original(*args, **kwargs))
    if name == "recv":
        _record(name, tensor, peer if peer >= 0 else int(result), tag)
    return result


def _posting(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _depth:
            return original(*args, **kwargs)
        call, peer, tag = _describe(name, original, args, kwargs)
        tensor = args[0] if args else kwargs["tensor"]
        if name == "isend":
            _record(name, tensor, peer, tag)
        work = original(*args, **kwargs)
        if work is None:
            return None
        on_done = (lambda: _record(name, tensor, peer, tag)) if name == "irecv" else None
        return TrackedWork(work, call, peer, on_done)

    return wrapper


class TrackedWork:
    """A request of ``isend``/``irecv`` whose ``wait`` says what it waits for."""

    def __init__(self, work: Any, call: str, peer: int, on_done: Callable[[], None] | None) -> None:
        self._work = work
        self._call = call
        self._peer = peer
        self._on_done = on_done

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        with _outermost():
            result = _waiting_on(self._call, self._peer, lambda: self._work.wait(*args, **kwargs))
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


def read_waiting(path: Path) -> tuple[str, int | None]:
    """What a rank said it waits for, and the peer it waits on (read by the supervisor)."""
    try:
        peer, _, text = path.read_text().partition("\t")
        return text.strip(), int(peer) if int(peer) >= 0 else None
    except (OSError, ValueError):
        return "", None
