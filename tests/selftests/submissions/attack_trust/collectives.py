"""A determined student against what the trusted side checks: each function cheats differently.

- all_reduce moves its data as POSIX byte-range locks on a file every sandbox can read
  (F_SETLK on one rank, F_GETLK on the other: 64 bits per lock), with only a 1-byte token
  through torch.distributed: correct results that the broker never carried.
- broadcast sends raw frames whose header declares no elements but whose buffer carries the
  whole tensor, so the bytes would be counted as 0.
- all_gather returns its result as a stride-0 view of 4 bytes that claims a billion elements,
  which the trusted side would materialise when it compares.
- reduce_scatter first posts a receive for a token and sends its own last, around the
  reference's ring, so that a replay that walks receives in posting order gives up at once.
- scatter floods the grader with 64 MiB isends that nobody receives, gather with receives
  posted in a loop, to exhaust the trusted side's memory.
The others are the reference's.
"""

import fcntl
import os
import struct

import torch
import torch.distributed as dist

from reference.collectives import *  # noqa: F403
from reference.collectives import reduce_scatter as reference_reduce_scatter

_SHARED = "/etc/debian_version"  # read-only in every sandbox, one inode, opened by no one
_REGION = 1 << 44  # each rank's locks live in a region of their own
_SLOT = 1 << 33  # each element in a slot of its own within it


def _publish(fd, rank, values):
    for i, bits in enumerate(values):
        start = rank * _REGION + i * _SLOT + bits
        fcntl.fcntl(fd, fcntl.F_SETLK, struct.pack("hhqqi", fcntl.F_RDLCK, 0, start, 1, 0))


def _read(fd, rank, count):
    values = []
    for i in range(count):
        base = rank * _REGION + i * _SLOT
        query = struct.pack("hhqqi", fcntl.F_WRLCK, 0, base, _SLOT, 0)
        _, _, start, _, _ = struct.unpack("hhqqi", fcntl.fcntl(fd, fcntl.F_GETLK, query))
        values.append(start - base)
    return values


def _token(peer_first, me, peer):
    token = torch.zeros(1, dtype=torch.uint8)
    if peer_first:
        dist.recv(token, peer)
        dist.send(token, peer)
    else:
        dist.send(token, peer)
        dist.recv(token, peer)


def all_reduce(tensor, group=None):
    me, p = dist.get_rank(), dist.get_world_size()
    if p != 2 or tensor.dtype != torch.float32 or tensor.numel() > 64:
        return  # the small float32 cases are enough to show it
    fd = os.open(_SHARED, os.O_RDONLY)
    flat = tensor.contiguous().view(-1)
    _publish(fd, me, [bits & 0xFFFFFFFF for bits in flat.view(torch.int32).tolist()])
    _token(me == 1, me, 1 - me)  # both have published
    theirs = torch.tensor(_read(fd, 1 - me, flat.numel()), dtype=torch.int64)
    other = theirs.to(torch.int32).view(torch.float32)
    _token(me == 1, me, 1 - me)  # both have read
    os.close(fd)
    tensor.copy_((flat + other).view(tensor.shape))


def broadcast(tensor, src, group=None):
    from grader.rank import link

    me, p = dist.get_rank(), dist.get_world_size()
    flat = tensor.contiguous()
    if me != src:
        dist.recv(flat, src)
        tensor.copy_(flat)
        return
    payload = flat.view(torch.uint8).numpy().tobytes()
    for peer in range(p):
        if peer != src:
            op = link.current().start_op(
                "send", lambda frame: None, [payload], peer=peer, group=list(range(p)), tag=0,
                dtype=str(tensor.dtype).removeprefix("torch."), numel=0, at="",
            )
            op.wait(link.current())


def all_gather(tensor_list, tensor, group=None):
    from grader import wire

    honest = wire._encode_tensor

    def huge(value, buffers):  # once, for this call's result
        wire._encode_tensor = honest
        buffers.append(b"\0\0\0\0")
        return {"k": "tensor", "dtype": "float32", "shape": [1 << 30], "stride": [0],
                "buf": len(buffers) - 1}

    wire._encode_tensor = huge


def reduce_scatter(output, input_list, group=None):
    me, p = dist.get_rank(), dist.get_world_size()
    if p == 1:
        return reference_reduce_scatter(output, input_list, group)
    token_in, token_out = torch.zeros(1), torch.zeros(1)
    early = dist.irecv(token_in, (me - 1) % p, tag=7)  # a receive first, its send last
    reference_reduce_scatter(output, input_list, group)
    late = dist.isend(token_out, (me + 1) % p, tag=7)
    early.wait()
    late.wait()


def scatter(tensor, scatter_list, src, group=None):
    me, p = dist.get_rank(), dist.get_world_size()
    if p == 1:
        return
    block = torch.zeros(16 << 20)  # 64 MiB
    flood = [dist.isend(block, (me + 1) % p, tag=9) for _ in range(8)]
    for request in flood:
        request.wait()


def gather(tensor, gather_list, dst, group=None):
    me, p = dist.get_rank(), dist.get_world_size()
    if p == 1:
        return
    sink = torch.zeros(1)
    for _ in range(50_000):
        dist.irecv(sink, (me + 1) % p, tag=9)
