"""Every collective waits for a message that never comes: a deadlock at every world size > 1."""

import torch
import torch.distributed as dist


def _wait_forever(tensor):
    rank, ws = dist.get_rank(), dist.get_world_size()
    if ws == 1:
        return
    dist.recv(torch.empty(1), (rank + 1) % ws)


def broadcast(tensor, src, group=None):
    _wait_forever(tensor)


def reduce(tensor, dst, group=None):
    _wait_forever(tensor)


def all_reduce(tensor, group=None):
    _wait_forever(tensor)


def scatter(tensor, scatter_list, src, group=None):
    _wait_forever(tensor)


def gather(tensor, gather_list, dst, group=None):
    _wait_forever(tensor)


def all_gather(tensor_list, tensor, group=None):
    _wait_forever(tensor)


def reduce_scatter(output, input_list, group=None):
    _wait_forever(output)


def all_to_all(output_list, input_list, group=None):
    _wait_forever(input_list[0])
