"""Attacks on the shared-memory segment the broker gives each rank (``test_segment.py``).

Student code can reach its rank's segment (``grader.rank.link.current().segment``): it can
write anything into it at any time, and post frames that name any place in it.
"""

import os
import time

import torch
import torch.distributed as dist

from grader import protocol
from grader.rank import link

PAYLOAD, TOKEN = 1, 0  # tags


def rewrite_after_send(n):
    """Rank 0 sends ones and, once the broker has read that send, writes 7s over its whole
    out ring until the message is received; rank 1 receives it only after a while."""
    token = torch.zeros(1)
    segment = link.current().segment
    if dist.get_rank() == 0:
        work = dist.isend(torch.ones(n), 1, tag=PAYLOAD)
        dist.recv(token, 1, tag=TOKEN)  # the broker read the send's frame before this one's
        ring = slice(segment.out.start, segment.out.start + segment.out.size)
        rewrites = 0
        while not work.is_completed():
            segment.map[ring] = b"\x07" * segment.out.size
            rewrites += 1
        work.wait()
        return rewrites
    dist.send(token, 0, tag=TOKEN)
    time.sleep(0.2)
    got = torch.empty(n)
    dist.recv(got, 0, tag=PAYLOAD)
    return got


def many_held(n, count):
    """Rank 0 sends ``count`` messages of ``n`` floats, message i all i's, before rank 1
    receives any; rank 1 receives them last first: whether each arrived whole."""
    if dist.get_rank() == 0:
        works = [dist.isend(torch.full((n,), float(i)), 1, tag=10 + i) for i in range(count)]
        for work in works:
            work.wait()
        return None
    arrived = []
    for i in reversed(range(count)):
        got = torch.empty(n)
        dist.recv(got, 0, tag=10 + i)
        arrived.append(torch.equal(got, torch.full((n,), float(i))))
    return arrived[::-1]


def empty_then_full(n):
    """Rank 0 sends an empty tensor, then ``n`` threes, before rank 1 receives either (it is
    busy elsewhere): whether the threes arrived whole."""
    if dist.get_rank() == 0:
        works = [dist.isend(torch.empty(0), 1, tag=1), dist.isend(torch.full((n,), 3.0), 1, tag=2)]
        for work in works:
            work.wait()
        return None
    time.sleep(0.2)
    dist.recv(torch.empty(0), 0, tag=1)
    got = torch.empty(n)
    dist.recv(got, 0, tag=2)
    return torch.equal(got, torch.full((n,), 3.0))


def place_outside():
    """A send whose payload, the frame says, runs past the end of the out ring."""
    current = link.current()
    size = current.segment.out.size
    current.post(
        protocol.SEND, None, op=10**6, peer=1 - dist.get_rank(), group=[0, 1], tag=0,
        dtype="float32", numel=4, shm=[[size - 8, 16]],
    )  # fmt: skip
    dist.recv(torch.empty(4), 1 - dist.get_rank())


def shrink_segment():
    """Shrink (or grow) the segment under the broker's reads, through every descriptor of it
    the rank holds (its mapping's own): how many times the seals refused."""
    refused = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if "grader-segment" in target:
            for size in (0, 1 << 30):
                try:
                    os.ftruncate(int(name), size)
                except OSError:
                    refused += 1
    return refused
