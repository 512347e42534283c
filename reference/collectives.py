"""Reference collectives built only from point-to-point messages.

Reference solution of `assignments/collectives.py`. Every function here uses
``torch.distributed`` isend/irecv plus local tensor math; no built-in collective is called,
not even a barrier. The algorithms are the classic bandwidth-efficient ones of MPICH
(Thakur et al. 2005) and of Chan et al. 2007, for p ranks and n bytes:

=================  =======================================  ==========  =====================
function           algorithm                                rounds      busiest rank sends
=================  =======================================  ==========  =====================
all_reduce         ring reduce-scatter + ring all-gather    2(p-1)      2(p-1)/p n
reduce_scatter     ring                                     p-1         (p-1)/p n (n = input)
all_gather         ring                                     p-1         (p-1)/p n (n = output)
all_to_all         pairwise exchange                        p-1         (p-1)/p n
scatter, gather    binomial tree                            ceil(lg p)  (p-1)/p n (the root)
broadcast          binomial scatter + ring all-gather       lg p + p-1  < 2n (van de Geijn)
reduce             ring reduce-scatter + binomial gather    p-1 + lg p  < 2n (Rabenseifner)
=================  =======================================  ==========  =====================

Every algorithm is built from three pieces, each a few lines below:

- the *ring*: position i sends to i+1 and receives from i-1 at every step
  (``_ring_reduce_scatter``, ``_ring_all_gather``);
- the *binomial tree* rooted at position 0 (``_BinomialTree``), down which the pieces of a
  buffer are scattered and up which they are gathered (``_tree_scatter``, ``_tree_gather``);
- ``_send_recv``, one step of either: a send and a receive posted together.

References:
    R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of Collective Communication
    Operations in MPICH", IJHPCA 19(1), 2005.
    E. Chan, M. Heimlich, A. Purkayastha, R. van de Geijn, "Collective communication:
    theory, practice, and experience", CCPE 19(13), 2007.
    P. Patarasuk, X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
    workstations", JPDC 69(2), 2009.

Conventions shared by all functions: ``src``/``dst`` are global ranks (as in
``torch.distributed``); list arguments are indexed by rank in ``group``. Ranks are numbered
by their *position* counted from the root, ``(rank - root) % p``, so that every algorithm is
written for a root at position 0 and works for any root. Data is copied into a contiguous
flat buffer, cut into p pieces whose sizes differ by at most one (some may be empty:
zero-size messages are skipped on both sides), and results are copied back into the
caller's tensors in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


class _Positions:
    """The ranks of ``group`` numbered 0..p-1 from ``root`` (a group rank): position 0 is
    the root, position i the rank i places after it."""

    def __init__(self, group: ProcessGroup | None, root: int = 0) -> None:
        self.group = group
        self.root = root
        self.world_size = dist.get_world_size(group)
        self.me = (dist.get_rank(group) - root) % self.world_size

    def group_rank(self, position: int) -> int:
        """The group rank at ``position`` (taken modulo p, so that me + 1 wraps around)."""
        return (position + self.root) % self.world_size

    def global_rank(self, position: int) -> int:
        """The global rank at ``position``: what send and recv expect."""
        rank = self.group_rank(position)
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


def _group_rank_of(group: ProcessGroup | None, global_rank: int) -> int:
    return global_rank if group is None else dist.get_group_rank(group, global_rank)


def _send_recv(
    ranks: _Positions,
    send: Tensor | None = None,
    to: int = 0,
    recv: Tensor | None = None,
    source: int = 0,
) -> None:
    """Send ``send`` to position ``to`` while receiving ``recv`` from position ``source``.

    Both are posted before either is waited on: on gloo a blocking send waits for the
    matching receive, so two ranks that ``send`` to each other at once deadlock.
    Empty tensors (and ``None``) are not sent; the peer skips them the same way.
    """
    pending = []
    if send is not None and send.numel() > 0:
        pending.append(dist.isend(send, ranks.global_rank(to), group=ranks.group))
    if recv is not None and recv.numel() > 0:
        pending.append(dist.irecv(recv, ranks.global_rank(source), group=ranks.group))
    for request in pending:
        request.wait()


@dataclass(frozen=True)
class _Pieces:
    """A flat buffer cut into p pieces: piece i is ``buffer[offsets[i]:offsets[i + 1]]``."""

    buffer: Tensor
    offsets: list[int]

    @classmethod
    def even(cls, buffer: Tensor, p: int) -> _Pieces:
        """p pieces whose sizes differ by at most one (the first ones are the smaller)."""
        n = buffer.numel()
        return cls(buffer, [i * n // p for i in range(p + 1)])

    @classmethod
    def of_size(cls, buffer: Tensor, p: int, size: int) -> _Pieces:
        """p pieces of ``size`` elements each: the entries of a list argument, end to end."""
        return cls(buffer, [i * size for i in range(p + 1)])

    def __getitem__(self, i: int) -> Tensor:
        """Piece ``i`` modulo p, as a view into the buffer."""
        i %= len(self.offsets) - 1
        return self.buffer[self.offsets[i] : self.offsets[i + 1]]

    def span(self, first: int, end: int) -> Tensor:
        """Pieces first..end-1 together: one contiguous view, one message."""
        return self.buffer[self.offsets[first] : self.offsets[end]]

    def largest(self) -> int:
        return max(end - start for start, end in pairwise(self.offsets))


# -- the ring --------------------------------------------------------------------------------


def _ring_reduce_scatter(ranks: _Positions, pieces: _Pieces) -> None:
    """Ring reduce-scatter in place (Patarasuk & Yuan 2009): p-1 steps, (p-1)/p n bytes.

    At step s position i sends its partial sum of piece i-s-1 to position i+1, and adds
    the partial sum of piece i-s-2 it receives from position i-1 into its own. After the
    last step piece i of position i holds the full sum; its other pieces hold partial sums.
    """
    me, p = ranks.me, ranks.world_size
    incoming = pieces.buffer.new_empty(pieces.largest())  # one buffer for every step
    for step in range(p - 1):
        outgoing, summed = pieces[me - step - 1], pieces[me - step - 2]
        received = incoming[: summed.numel()]
        _send_recv(ranks, send=outgoing, to=me + 1, recv=received, source=me - 1)
        summed.add_(received)


def _ring_all_gather(ranks: _Positions, pieces: _Pieces) -> None:
    """Ring all-gather in place: position i starts with piece i and ends with all of them.

    At step s position i forwards piece i-s (its own at step 0, then the one it received
    last) to position i+1 and receives piece i-s-1 from position i-1: p-1 steps, every
    rank sends (p-1)/p n bytes.
    """
    me, p = ranks.me, ranks.world_size
    for step in range(p - 1):
        forwarded, arriving = pieces[me - step], pieces[me - step - 1]
        _send_recv(ranks, send=forwarded, to=me + 1, recv=arriving, source=me - 1)


# -- the binomial tree -----------------------------------------------------------------------


@dataclass(frozen=True)
class _BinomialTree:
    """The binomial tree on positions 0..p-1, rooted at 0: the minimum-spanning-tree
    algorithms of Chan et al. 2007, MPICH's binomial scatter and gather (Thakur et al. 2005).

    The subtree of position i is the run of positions i, i+1, ..., i+size-1, where size is
    the largest power of two that divides i (the whole tree for the root), cut off at p.
    Position i's children are i+1, i+2, i+4, ... up to its subtree's end, and its parent is
    i - size: the child i+d heads the subtree of positions i+d .. i+2d-1 (cut off at p).
    For p = 8::

        0 ─┬─ 1
           ├─ 2 ── 3
           └─ 4 ─┬─ 5
                 └─ 6 ── 7

    So half the tree hangs from the root's farthest child, and a message that carries a
    whole subtree halves at every level: ceil(log2 p) rounds.
    """

    p: int

    def subtree_end(self, position: int) -> int:
        """One past the last position of ``position``'s subtree."""
        if position == 0:
            return self.p
        return min(position + _largest_power_of_two_dividing(position), self.p)

    def parent(self, position: int) -> int:
        """The position that sends ``position`` its subtree (not defined for the root)."""
        return position - _largest_power_of_two_dividing(position)

    def children(self, position: int) -> list[int]:
        """Nearest first: position+1, +2, +4, ..., the smallest subtree first."""
        children, distance = [], 1
        while position + distance < self.subtree_end(position):
            children.append(position + distance)
            distance *= 2
        return children


def _largest_power_of_two_dividing(position: int) -> int:
    """1 for odd positions, 2 for 2, 6, 10, ..., 4 for 4, 12, ...: ``position & -position``
    in two's complement, its lowest set bit, written out."""
    power = 1
    while position % (2 * power) == 0:
        power *= 2
    return power


def _tree_scatter(ranks: _Positions, pieces: _Pieces) -> None:
    """Binomial scatter from position 0: piece i ends at position i.

    Each position receives the pieces of its whole subtree from its parent in one message,
    then hands each child that child's subtree, the biggest (farthest) first.
    """
    tree, me = _BinomialTree(ranks.world_size), ranks.me
    if me != 0:
        mine = pieces.span(me, tree.subtree_end(me))
        _send_recv(ranks, recv=mine, source=tree.parent(me))
    for child in reversed(tree.children(me)):
        _send_recv(ranks, send=pieces.span(child, tree.subtree_end(child)), to=child)


def _tree_gather(ranks: _Positions, pieces: _Pieces) -> None:
    """Binomial gather to position 0, the mirror of ``_tree_scatter``: piece i comes from
    position i.

    Each position collects its children's subtrees, the smallest (nearest, ready first)
    first, then sends its whole subtree to its parent in one message.
    """
    tree, me = _BinomialTree(ranks.world_size), ranks.me
    for child in tree.children(me):
        _send_recv(ranks, recv=pieces.span(child, tree.subtree_end(child)), source=child)
    if me != 0:
        _send_recv(ranks, send=pieces.span(me, tree.subtree_end(me)), to=tree.parent(me))


# -- the collectives -------------------------------------------------------------------------


def _flat_copy(tensor: Tensor) -> Tensor:
    """A private contiguous 1-D copy of ``tensor``."""
    return tensor.detach().clone(memory_format=torch.contiguous_format).view(-1)


def broadcast(tensor: Tensor, src: int, group: ProcessGroup | None = None) -> None:
    """Every rank's ``tensor`` gets ``src``'s values, in place.

    van de Geijn's broadcast (Chan et al. 2007; Thakur et al. 2005, long messages): binomial
    scatter of p pieces from the root, then ring all-gather. The root sends 2(p-1)/p n < 2n
    bytes, against n * ceil(lg p) for a plain binomial broadcast.
    """
    ranks = _Positions(group, _group_rank_of(group, src))
    is_root = ranks.me == 0
    buffer = _flat_copy(tensor) if is_root else tensor.new_empty(tensor.numel())
    pieces = _Pieces.even(buffer, ranks.world_size)
    _tree_scatter(ranks, pieces)
    _ring_all_gather(ranks, pieces)
    if not is_root:
        tensor.copy_(buffer.view_as(tensor))


def reduce(tensor: Tensor, dst: int, group: ProcessGroup | None = None) -> None:
    """``dst``'s ``tensor`` gets the element-wise sum over ranks; others keep theirs.

    Rabenseifner's reduce (Thakur et al. 2005): reduce-scatter (the ring here, which works
    for any p, in place of recursive halving), then binomial gather of the reduced pieces
    to the root. Partial sums live in a private buffer, so the other ranks' tensors are
    untouched. The busiest rank sends < 2n bytes.
    """
    ranks = _Positions(group, _group_rank_of(group, dst))
    buffer = _flat_copy(tensor)
    pieces = _Pieces.even(buffer, ranks.world_size)
    _ring_reduce_scatter(ranks, pieces)
    _tree_gather(ranks, pieces)
    if ranks.me == 0:
        tensor.copy_(buffer.view_as(tensor))


def all_reduce(tensor: Tensor, group: ProcessGroup | None = None) -> None:
    """Every rank's ``tensor`` gets the element-wise sum over ranks, in place.

    Ring all-reduce (Patarasuk & Yuan 2009): ring reduce-scatter then ring all-gather,
    2(p-1) steps; every rank sends 2(p-1)/p n bytes, the lower bound. All ranks end
    with bitwise identical values (each piece is summed once, then copied).
    """
    ranks = _Positions(group)
    # A contiguous tensor is reduced where it lies; any other goes through a flat copy.
    buffer = tensor.detach().view(-1) if tensor.is_contiguous() else _flat_copy(tensor)
    pieces = _Pieces.even(buffer, ranks.world_size)
    _ring_reduce_scatter(ranks, pieces)
    _ring_all_gather(ranks, pieces)
    if buffer.data_ptr() != tensor.data_ptr():
        tensor.copy_(buffer.view_as(tensor))


def scatter(
    tensor: Tensor, scatter_list: list[Tensor] | None, src: int, group: ProcessGroup | None = None
) -> None:
    """Rank r's ``tensor`` gets ``scatter_list[r]`` of ``src`` (``None`` off ``src``).

    Binomial tree (Chan et al. 2007, minimum-spanning-tree scatter): ceil(lg p) rounds;
    the root sends (p-1)/p n bytes, n = the whole list. Positions are counted from the
    root, so any p and any root work.
    """
    ranks = _Positions(group, _group_rank_of(group, src))
    p, size = ranks.world_size, tensor.numel()
    if ranks.me == 0:
        assert scatter_list is not None, "scatter_list is required on src"
        # Laid out by position: the root's own entry first.
        buffer = torch.cat([scatter_list[ranks.group_rank(i)].reshape(-1) for i in range(p)])
    else:
        buffer = tensor.new_empty(p * size)
    pieces = _Pieces.of_size(buffer, p, size)
    _tree_scatter(ranks, pieces)
    tensor.copy_(pieces[ranks.me].view_as(tensor))


def gather(
    tensor: Tensor, gather_list: list[Tensor] | None, dst: int, group: ProcessGroup | None = None
) -> None:
    """On ``dst``, ``gather_list[r]`` gets rank r's ``tensor`` (``None`` off ``dst``).

    Binomial tree, the mirror of ``scatter``: ceil(lg p) rounds; the root receives
    (p-1)/p n bytes.
    """
    ranks = _Positions(group, _group_rank_of(group, dst))
    p, size = ranks.world_size, tensor.numel()
    pieces = _Pieces.of_size(tensor.new_empty(p * size), p, size)
    pieces[ranks.me].copy_(tensor.reshape(-1))
    _tree_gather(ranks, pieces)
    if ranks.me == 0:
        assert gather_list is not None, "gather_list is required on dst"
        for i in range(p):
            out = gather_list[ranks.group_rank(i)]
            out.copy_(pieces[i].view_as(out))


def all_gather(
    tensor_list: list[Tensor], tensor: Tensor, group: ProcessGroup | None = None
) -> None:
    """On every rank, ``tensor_list[r]`` gets rank r's ``tensor``.

    Ring (Thakur et al. 2005; Chan et al. 2007): p-1 steps, (p-1)/p n bytes per rank,
    n = the whole gathered output.
    """
    ranks = _Positions(group)
    p, size = ranks.world_size, tensor.numel()
    pieces = _Pieces.of_size(tensor.new_empty(p * size), p, size)
    pieces[ranks.me].copy_(tensor.reshape(-1))
    _ring_all_gather(ranks, pieces)
    for i, out in enumerate(tensor_list):
        out.copy_(pieces[i].view_as(out))


def reduce_scatter(
    output: Tensor, input_list: list[Tensor], group: ProcessGroup | None = None
) -> None:
    """Rank r's ``output`` gets the sum over ranks of their ``input_list[r]``.

    Ring (Patarasuk & Yuan 2009; Chan et al. 2007): p-1 steps,
    (p-1)/p n bytes per rank, n = the whole input list. ``input_list`` is left unchanged.
    """
    ranks = _Positions(group)
    buffer = torch.cat([t.reshape(-1) for t in input_list])  # a private copy
    pieces = _Pieces.of_size(buffer, ranks.world_size, output.numel())
    _ring_reduce_scatter(ranks, pieces)
    output.copy_(pieces[ranks.me].view_as(output))


def all_to_all(
    output_list: list[Tensor], input_list: list[Tensor], group: ProcessGroup | None = None
) -> None:
    """On rank r, ``output_list[s]`` gets rank s's ``input_list[r]``.

    Pairwise exchange (Thakur et al. 2005, long messages): at step k = 1..p-1 rank r
    sends to r+k and receives from r-k at the same time; p-1 steps, (p-1)/p n bytes.
    """
    ranks = _Positions(group)
    me, p = ranks.me, ranks.world_size
    output_list[me].copy_(input_list[me])
    for distance in range(1, p):
        send = input_list[(me + distance) % p].contiguous()
        out = output_list[(me - distance) % p]
        received = torch.empty_like(out, memory_format=torch.contiguous_format)
        _send_recv(ranks, send=send, to=me + distance, recv=received, source=me - distance)
        out.copy_(received)
