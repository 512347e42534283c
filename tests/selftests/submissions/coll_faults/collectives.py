"""Faults a grader must survive: each function fails in its own way, the rest are correct."""

import os
import time

import torch
import torch.distributed as dist

from reference.collectives import *  # noqa: F403
from reference.collectives import gather as reference_gather
from reference.collectives import scatter as reference_scatter


def broadcast(tensor, src, group=None):
    """Raises on rank 1 only; its peers then wait in vain."""
    if dist.get_rank() == 1:
        raise ValueError("index out of range on rank 1")
    if dist.get_world_size() > 1:
        dist.recv(torch.empty(1), 1)


def reduce(tensor, dst, group=None):
    """Rank 1 exits in the middle of the test."""
    if dist.get_rank() == 1:
        os._exit(3)


def all_reduce(tensor, group=None):
    """Rank 0 and rank 1 both send to each other first: a deadlock on gloo."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world > 1 and rank < 2:
        dist.send(tensor.contiguous(), 1 - rank)
        dist.recv(tensor.contiguous(), 1 - rank)


def scatter(tensor, scatter_list, src, group=None):
    """The last rank never returns (a busy loop, not a wait in gloo) on the small tensors of
    the correctness test; its cost tests, on large ones, see a correct scatter."""
    world = dist.get_world_size()
    if tensor.numel() < 1000 and dist.get_rank() == world - 1 and world > 1:
        while True:
            time.sleep(0.05)
    reference_scatter(tensor, scatter_list, src, group)


def gather(tensor, gather_list, dst, group=None):
    """Correct, plus a message to the next rank that nobody ever receives."""
    reference_gather(tensor, gather_list, dst, group)
    world = dist.get_world_size()
    if world > 1:
        dist.isend(torch.full((3,), 99.0), (dist.get_rank() + 1) % world)
