"""The one format of every byte between the trusted grader and a rank: frames of values.

A frame is a JSON header and zero or more raw buffers::

    !I header length | !I buffer count | !Q length of each buffer | header | buffers

Values (call arguments, results, messages between ranks) are a JSON tree in
the header whose tensors point at buffers by index. No pickle crosses the
wire: the trusted side decodes what a rank sends with :func:`decode`, which
accepts only the node kinds below, known dtypes, sane shapes and buffers of
exactly the right length, within fixed limits. Anything else is a
:class:`WireError`, and the trusted side treats the sender as broken.

A rank of the broker's machine may instead leave a frame's payloads in its
shared segment, the header's ``shm`` field saying where (:mod:`grader.segment`);
the trusted side copies them out before this module decodes anything.

A tensor travels with its strides and storage offset, so that a
non-contiguous view made on the trusted side is a non-contiguous view on the
rank, and the caller's tensors come back as the caller's tensors.
"""

from __future__ import annotations

import json
import math
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from grader import dtypes

MAX_HEADER_BYTES = 4 << 20
MAX_BUFFERS = 4096
MAX_FRAME_BYTES = 2 << 30
MAX_DEPTH = 8
MAX_NODES = 100_000

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in dtypes.NAMES}
_PREFIX = struct.Struct("!II")


class WireError(Exception):
    """A frame or value that breaks the format; the message says what and where."""


@dataclass
class Frame:
    header: dict[str, Any]
    buffers: list[bytes] = field(default_factory=list)


def head_of(frame: Frame) -> bytes:
    """What precedes ``frame``'s buffers on the wire: their count and lengths, its header."""
    header = json.dumps(frame.header, separators=(",", ":")).encode()
    lengths = struct.pack(f"!{len(frame.buffers)}Q", *map(len, frame.buffers))
    return _PREFIX.pack(len(header), len(frame.buffers)) + lengths + header


def send_frame(sock: socket.socket, frame: Frame, fds: list[int] | None = None) -> None:
    """Write ``frame``; ``fds`` (a Unix socket's) travel with its first byte (``SCM_RIGHTS``)."""
    head = head_of(frame)
    sent = socket.send_fds(sock, [head], fds) if fds else 0
    sock.sendall(head[sent:])
    for buffer in frame.buffers:
        sock.sendall(buffer)


def recv_frame(
    sock: socket.socket,
    max_bytes: int = MAX_FRAME_BYTES,
    began: Callable[[], None] | None = None,
    fds: list[int] | None = None,
) -> Frame | None:
    """The next frame, or None when the peer closed the connection cleanly.

    ``max_bytes`` caps the header and buffers together before anything is allocated
    (a stranger's first frame, before it proved who it is, gets a small cap).
    ``began`` is called once the frame's first bytes are in, before the rest is read.
    ``fds``: descriptors that come with the frame's first bytes are appended there
    (without it, the kernel closes any that come).
    """
    prefix = _recv_prefix(sock, fds)
    if prefix is None:
        return None
    if began is not None:
        began()
    header_length, count = _PREFIX.unpack(prefix)
    if header_length > MAX_HEADER_BYTES or count > MAX_BUFFERS:
        raise WireError(f"frame too large ({header_length} header bytes, {count} buffers)")
    lengths = struct.unpack(f"!{count}Q", _recv_exactly(sock, 8 * count))
    if header_length + sum(lengths) > max_bytes:
        raise WireError(f"frame of {header_length + sum(lengths)} bytes is over the limit")
    try:
        header = json.loads(_recv_exactly(sock, header_length))
    except ValueError as err:
        raise WireError(f"header is not JSON: {err}") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise WireError("header is not an object with a type")
    return Frame(header, [_recv_exactly(sock, n) for n in lengths])


def _recv_prefix(sock: socket.socket, fds: list[int] | None) -> Any:
    if fds is None:
        return _recv_exactly(sock, _PREFIX.size, eof_ok=True)
    data, got, _, _ = socket.recv_fds(sock, _PREFIX.size, 1)
    fds.extend(got)
    if not data:
        return None
    return data + bytes(_recv_exactly(sock, _PREFIX.size - len(data)))


def _recv_exactly(sock: socket.socket, n: int, eof_ok: bool = False) -> Any:
    view = memoryview(bytearray(n))
    got = 0
    while got < n:
        chunk = sock.recv_into(view[got:], n - got)
        if chunk == 0:
            if eof_ok and got == 0:
                return None
            raise WireError("connection closed in the middle of a frame")
        got += chunk
    return view.obj


# -- values ------------------------------------------------------------------------------


def encode(value: Any, buffers: list[bytes]) -> Any:
    """The JSON node of ``value``; tensor bytes are appended to ``buffers``."""
    if value is None or isinstance(value, bool | str):
        return {"k": "py", "v": value}
    if isinstance(value, int | float):
        return {"k": "py", "v": value}
    if isinstance(value, torch.Tensor):
        return _encode_tensor(value, buffers)
    if isinstance(value, torch.dtype):
        return {"k": "dtype", "v": str(value).removeprefix("torch.")}
    if isinstance(value, list | tuple):
        kind = "list" if isinstance(value, list) else "tuple"
        return {"k": kind, "v": [encode(item, buffers) for item in value]}
    if isinstance(value, dict):
        return {"k": "dict", "v": [[str(k), encode(v, buffers)] for k, v in value.items()]}
    raise WireError(f"cannot send a {type(value).__name__}")


def _encode_tensor(tensor: torch.Tensor, buffers: list[bytes]) -> dict[str, Any]:
    tensor = tensor.detach().cpu()
    if _span(tuple(tensor.shape), tuple(tensor.stride())) < tensor.numel():
        tensor = tensor.contiguous()  # a view whose elements share storage (an expand): copy
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise WireError(f"cannot send a tensor of {tensor.dtype}")
    span = _span(tuple(tensor.shape), tuple(tensor.stride()))
    storage = torch.as_strided(tensor, (span,), (1,), tensor.storage_offset())
    buffers.append(storage.contiguous().view(torch.uint8).numpy().tobytes())
    return {
        "k": "tensor",
        "dtype": dtype,
        "shape": list(tensor.shape),
        "stride": list(tensor.stride()),
        "buf": len(buffers) - 1,
    }


def _span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements of storage a view with this shape and these strides reaches."""
    if any(size == 0 for size in shape):
        return 0
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))


def decode(node: Any, buffers: list[bytes]) -> Any:
    """The value of ``node``, checked: a :class:`WireError` for anything malformed."""
    budget = [MAX_NODES]
    return _decode(node, buffers, 0, budget)


def _decode(node: Any, buffers: list[bytes], depth: int, budget: list[int]) -> Any:
    budget[0] -= 1
    if depth > MAX_DEPTH or budget[0] < 0:
        raise WireError("value nested too deeply or too large")
    if not isinstance(node, dict):
        raise WireError("value node is not an object")
    kind = node.get("k")
    if kind == "py":
        value = node.get("v")
        if value is not None and not isinstance(value, bool | int | float | str):
            raise WireError("plain value of a wrong type")
        if isinstance(value, str) and len(value) > 100_000:
            raise WireError("string too long")
        return value
    if kind == "dtype":
        if node.get("v") not in DTYPES:
            raise WireError(f"unknown dtype {str(node.get('v'))[:40]!r}")
        return DTYPES[node["v"]]
    if kind in ("list", "tuple"):
        items = node.get("v")
        if not isinstance(items, list):
            raise WireError(f"{kind} without items")
        values = [_decode(item, buffers, depth + 1, budget) for item in items]
        return values if kind == "list" else tuple(values)
    if kind == "dict":
        items = node.get("v")
        if not isinstance(items, list) or not all(
            isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], str) for kv in items
        ):
            raise WireError("dict without string keys")
        return {k: _decode(v, buffers, depth + 1, budget) for k, v in items}
    if kind == "tensor":
        return _decode_tensor(node, buffers)
    raise WireError(f"unknown value kind {str(kind)[:40]!r}")


def _decode_tensor(node: dict[str, Any], buffers: list[bytes]) -> torch.Tensor:
    dtype = DTYPES.get(node.get("dtype"))  # type: ignore[arg-type]
    shape, stride, index = node.get("shape"), node.get("stride"), node.get("buf")
    if dtype is None:
        raise WireError(f"unknown dtype {str(node.get('dtype'))[:40]!r}")
    if not (_ints(shape) and _ints(stride) and len(shape) == len(stride) <= 16):
        raise WireError("tensor shape or strides malformed")
    if not isinstance(index, int) or not 0 <= index < len(buffers):
        raise WireError("tensor points at no buffer")
    span = _span(tuple(shape), tuple(stride))
    if math.prod(shape) > span:
        # Elements sharing storage (a stride 0): a few bytes would become a huge tensor on
        # the trusted side the moment it is compared or copied. Honest senders copy first.
        raise WireError(f"a tensor of shape {shape[:8]} views only {span} elements of storage")
    data = buffers[index]
    itemsize = dtype.itemsize
    if len(data) != span * itemsize:
        raise WireError(f"tensor needs {span * itemsize} bytes, its buffer has {len(data)}")
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0)
    storage = flat.view(dtype) if data else torch.empty(0, dtype=dtype)
    return torch.as_strided(storage, tuple(shape), tuple(stride), 0)


def _ints(values: Any) -> bool:
    return isinstance(values, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40 for v in values
    )


def pack(value: Any) -> tuple[Any, list[bytes]]:
    """``value`` as (node, buffers), ready to go into a frame."""
    buffers: list[bytes] = []
    return encode(value, buffers), buffers


def tensor_buffer(tensor: torch.Tensor) -> bytes:
    """A tensor's elements in row-major order: the payload of one message between ranks."""
    return tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
