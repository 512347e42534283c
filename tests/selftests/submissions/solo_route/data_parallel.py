"""Every collective re-issued in a group of one, beside a real exchange by another route:
the class of attack behind ``dp_solo_overlap``, ``tp_solo_mlp``, ``zero_solo_broadcasts``
and ``fsdp_solo_gathers``. The reference's code runs unchanged, but the ``dist`` it calls
is :class:`SoloRoute`: each collective is posted, with the very tensors the reference
gives it and at the very point it is called, in a group of the rank alone (completed at
once, seen by no other rank), and the real exchange is made by sends and receives. The
answers are right; no test of the exchange (communication, overlap, ownership, memory)
may find the collectives it looks for. ``tensor_parallel.py`` and ``fully_sharded.py``
import :class:`SoloRoute` from here.
"""

import torch
import torch.distributed as _dist

from reference.data_parallel import *  # noqa: F403


class _Done:
    """The work of an exchange already made."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


class SoloRoute:
    """``torch.distributed`` with its collectives posted in a group of one and made by
    messages; everything else is torch.distributed's own."""

    def __init__(self):
        self.__dict__["_alone"] = None

    def __getattr__(self, name):
        return getattr(_dist, name)

    def alone(self):
        """This rank's group of one (every rank makes every rank's, as new_group requires)."""
        if self._alone is None:
            groups = [_dist.new_group([r]) for r in range(_dist.get_world_size())]
            self.__dict__["_alone"] = groups[_dist.get_rank()]
        return self._alone

    def _members(self, group):
        if group is None:
            return list(range(_dist.get_world_size()))
        return _dist.get_process_group_ranks(group)

    def _swap(self, sends, receives):
        """Send ``sends[r]`` to and receive ``receives[r]`` from every other member r."""
        me = _dist.get_rank()
        works = [_dist.isend(t, r) for r, t in sends.items() if r != me]
        works += [_dist.irecv(t, r) for r, t in receives.items() if r != me]
        for work in works:
            work.wait()

    def _everyone(self, tensor, group):
        """Every member's ``tensor``, in group order, by messages."""
        mine, me = tensor.detach().contiguous(), _dist.get_rank()
        members = self._members(group)
        parts = {r: mine.clone() if r == me else torch.empty_like(mine) for r in members}
        self._swap(dict.fromkeys(members, mine), parts)
        return [parts[r] for r in members]

    @staticmethod
    def _done(solo, async_op):
        if async_op:
            return solo
        solo.wait()
        return None

    @torch.no_grad()
    def all_reduce(self, tensor, op=_dist.ReduceOp.SUM, group=None, async_op=False):
        solo = _dist.all_reduce(tensor.detach().clone(), group=self.alone(), async_op=True)
        parts = self._everyone(tensor, group)
        total = parts[0].clone()
        for part in parts[1:]:
            total = total + part
        tensor.copy_(total)
        return self._done(solo, async_op)

    @torch.no_grad()
    def broadcast(self, tensor, src, group=None, async_op=False):
        me, members = _dist.get_rank(), self._members(group)
        if me != src:
            got = torch.empty_like(tensor.detach().contiguous())
            self._swap({}, {src: got})
            tensor.copy_(got)
            return _Done() if async_op else None
        solo = _dist.broadcast(tensor.detach().clone(), src=me, group=self.alone(), async_op=True)
        self._swap(dict.fromkeys(members, tensor.detach().contiguous()), {})
        return self._done(solo, async_op)

    @torch.no_grad()
    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        solo = _dist.all_gather([torch.empty_like(tensor)], tensor, self.alone(), async_op=True)
        for out, part in zip(tensor_list, self._everyone(tensor, group), strict=True):
            out.copy_(part)
        return self._done(solo, async_op)

    @torch.no_grad()
    def all_gather_into_tensor(self, output, input, group=None, async_op=False):
        solo = _dist.all_gather_into_tensor(
            torch.empty_like(input), input, group=self.alone(), async_op=True
        )
        output.copy_(torch.cat(self._everyone(input, group)).view_as(output))
        return self._done(solo, async_op)

    @torch.no_grad()
    def reduce_scatter_tensor(
        self, output, input, op=_dist.ReduceOp.SUM, group=None, async_op=False
    ):
        solo = _dist.reduce_scatter_tensor(
            torch.empty_like(input), input, group=self.alone(), async_op=True
        )
        me, members = _dist.get_rank(), self._members(group)
        pieces = dict(zip(members, input.detach().contiguous().chunk(len(members)), strict=True))
        sends = {r: piece.contiguous() for r, piece in pieces.items()}
        got = {r: sends[me].clone() if r == me else torch.empty_like(sends[me]) for r in members}
        self._swap(sends, got)
        total = got[members[0]].clone()
        for r in members[1:]:
            total = total + got[r]
        output.copy_(total.view_as(output))
        return self._done(solo, async_op)


dist = SoloRoute()  # what the reference's code above calls
