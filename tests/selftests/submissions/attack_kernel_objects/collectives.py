"""Collectives that move their data around the broker, through kernel objects that no
namespace separates (issues 14 and 15): byte-range locks on a file every sandbox can open,
and the user's keyring. The first four functions use locks, the other four keys.

Each rank publishes its tensors and reads everyone else's; the result is then computed
locally, so no byte reaches the broker. The seccomp filter refuses both channels: every
test must fail, with the refusal (PermissionError) as the cause.
"""

import ctypes
import fcntl
import io
import os
import platform
import struct
import time
from collections import Counter

import torch
import torch.distributed as dist

# -- channel 1: POSIX byte-range locks on a read-only system file ----------------------------
# A read lock at [start, start + length) is seen by every process's F_GETLK: one lock carries
# a 32-bit word in its length. Rank r's slot for a call: a header lock (the word count + 1),
# then one lock per word, 2**33 apart so that no two merge.
_FLOCK = "hh4xqqi4x"  # struct flock on 64-bit Linux
_SLOT, _STRIDE = 1 << 50, 1 << 33
_calls: Counter = Counter()


def _lock(fd, kind, start, length):
    return fcntl.fcntl(fd, kind, struct.pack(_FLOCK, fcntl.F_RDLCK, 0, start, length, 0))


def _probe(fd, start):
    query = struct.pack(_FLOCK, fcntl.F_WRLCK, 0, start, 1, 0)
    kind, _, _, length, _ = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, query))
    return None if kind == fcntl.F_UNLCK else length


_FILE = os.open("/etc/passwd", os.O_RDONLY)


def _share_by_locks(blob: bytes, tag: int) -> list[bytes]:
    world, me = dist.get_world_size(), dist.get_rank()
    words = struct.unpack(f"<{-(-len(blob) // 4)}I", blob.ljust(-(-len(blob) // 4) * 4, b"\0"))
    base = ((tag % 64) * 8 + me) * _SLOT
    unlock = struct.pack(_FLOCK, fcntl.F_UNLCK, 0, base, _SLOT, 0)
    fcntl.fcntl(_FILE, fcntl.F_SETLK, unlock)  # what this slot held 8 calls ago
    for i, word in enumerate(words):
        _lock(_FILE, fcntl.F_SETLK, base + (i + 1) * _STRIDE, word + 1)
    _lock(_FILE, fcntl.F_SETLK, base, len(blob) + 1)  # the header last: the slot is complete
    blobs = []
    for rank in range(world):
        if rank == me:
            blobs.append(blob)
            continue
        start = ((tag % 64) * 8 + rank) * _SLOT
        while (size := _probe(_FILE, start)) is None:
            time.sleep(0.001)
        count = -(-(size - 1) // 4)
        read = [_probe(_FILE, start + (i + 1) * _STRIDE) - 1 for i in range(count)]
        blobs.append(struct.pack(f"<{count}I", *read)[: size - 1])
    return blobs


# -- channel 2: the user keyring -------------------------------------------------------------
_SYSCALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}  # add_key, keyctl
_ADD_KEY, _KEYCTL = _SYSCALLS.get(platform.machine(), (-1, -1))
_USER_KEYRING, _KEYCTL_SEARCH, _KEYCTL_READ, _KEYCTL_SET_TIMEOUT = -4, 10, 11, 15
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _checked(result):
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result


def _share_by_keys(blob: bytes, tag: int) -> list[bytes]:
    world, me = dist.get_world_size(), dist.get_rank()
    name = f"side-channel-{tag}-{{}}".encode()
    key = _checked(
        _libc.syscall(_ADD_KEY, b"user", name.replace(b"{}", b"%d" % me), blob, len(blob), _USER_KEYRING)
    )
    _libc.syscall(_KEYCTL, _KEYCTL_SET_TIMEOUT, key, 60)
    blobs = []
    for rank in range(world):
        description = name.replace(b"{}", b"%d" % rank)
        while (found := _libc.syscall(_KEYCTL, _KEYCTL_SEARCH, _USER_KEYRING, b"user", description, 0)) < 0:
            time.sleep(0.001)
        buffer = ctypes.create_string_buffer(32768)
        size = _checked(_libc.syscall(_KEYCTL, _KEYCTL_READ, found, buffer, len(buffer)))
        blobs.append(buffer.raw[:size])
    return blobs


# -- the collectives, computed from everyone's inputs ----------------------------------------
def _everyone(obj, share):
    _calls[share] += 1
    out = io.BytesIO()
    torch.save(obj, out)
    blobs = share(out.getvalue(), _calls[share] * 8 + dist.get_world_size())
    return [torch.load(io.BytesIO(b), weights_only=True) for b in blobs]


def broadcast(tensor, src, group=None):
    tensor.copy_(_everyone(tensor.contiguous(), _share_by_locks)[src])


def reduce(tensor, dst, group=None):
    every = _everyone(tensor.contiguous(), _share_by_locks)
    if dist.get_rank() == dst:
        tensor.copy_(sum(every))


def all_reduce(tensor, group=None):
    tensor.copy_(sum(_everyone(tensor.contiguous(), _share_by_locks)))


def scatter(tensor, scatter_list, src, group=None):
    every = _everyone(scatter_list or [], _share_by_locks)
    tensor.copy_(every[src][dist.get_rank()])


def gather(tensor, gather_list, dst, group=None):
    every = _everyone(tensor.contiguous(), _share_by_keys)
    for target, value in zip(gather_list or [], every):
        target.copy_(value)


def all_gather(tensor_list, tensor, group=None):
    for target, value in zip(tensor_list, _everyone(tensor.contiguous(), _share_by_keys)):
        target.copy_(value)


def reduce_scatter(output, input_list, group=None):
    every = _everyone([t.contiguous() for t in input_list], _share_by_keys)
    output.copy_(sum(inputs[dist.get_rank()] for inputs in every))


def all_to_all(output_list, input_list, group=None):
    every = _everyone([t.contiguous() for t in input_list], _share_by_keys)
    for source, target in enumerate(output_list):
        target.copy_(every[source][dist.get_rank()])
