"""Reference collectives built only from point-to-point messages.

Every function here uses ``torch.distributed`` send/recv/isend/irecv plus local tensor math;
no built-in collective is called, not even a barrier. The algorithms are the classic
bandwidth-efficient ones (p ranks, n bytes):

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

References:
    R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of Collective Communication
    Operations in MPICH", IJHPCA 19(1), 2005.
    E. Chan, M. Heimlich, A. Purkayastha, R. van de Geijn, "Collective communication:
    theory, practice, and experience", CCPE 19(13), 2007.
    P. Patarasuk, X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
    workstations", JPDC 69(2), 2009.

Conventions shared by all functions: ``src``/``dst`` are global ranks (as in
``torch.distributed``); list arguments are indexed by rank in ``group``. Data is copied
into a contiguous flat buffer, cut into p pieces whose sizes differ by at most one (some
may be empty: zero-size messages are skipped on both sides), and results are copied back
into the caller's tensors in place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


class _Ranks:
    """The ranks of ``group`` as positions 0..p-1 counted from ``root`` (a group rank)."""

    def __init__(self, group: ProcessGroup | None, root: int = 0) -> None:
        self.group, self.root = group, root
        self.p = dist.get_world_size(group)
        self.me = (dist.get_rank(group) - root) % self.p

    def rank(self, pos: int) -> int:
        """Group rank at position ``pos`` (taken modulo p)."""
        return (pos + self.root) % self.p

    def peer(self, pos: int) -> int:
        """Global rank at position ``pos``: what send/recv expect."""
        r = self.rank(pos)
        return r if self.group is None else dist.get_global_rank(self.group, r)


def _group_rank(group: ProcessGroup | None, global_rank: int) -> int:
    return global_rank if group is None else dist.get_group_rank(group, global_rank)


def _exchange(
    g: _Ranks, send: Tensor | None = None, to: int = 0, recv: Tensor | None = None, frm: int = 0
) -> None:
    """Send ``send`` to position ``to`` while receiving ``recv`` from position ``frm``.

    Both sides are posted before either is waited on: on gloo a blocking send waits for
    the matching receive, so two ranks that send to each other with ``send`` deadlock.
    Empty tensors (and ``None``) are not sent; the peer skips them the same way.
    """
    reqs = []
    if send is not None and send.numel() > 0:
        reqs.append(dist.isend(send, g.peer(to), group=g.group))
    if recv is not None and recv.numel() > 0:
        reqs.append(dist.irecv(recv, g.peer(frm), group=g.group))
    for req in reqs:
        req.wait()


def _flat_copy(t: Tensor) -> Tensor:
    return t.detach().clone(memory_format=torch.contiguous_format).view(-1)


def _bounds(n: int, p: int) -> list[int]:
    """Offsets of p pieces of an n-element buffer; sizes differ by at most one."""
    return [i * n // p for i in range(p + 1)]


def _span(buf: Tensor, bounds: list[int], a: int, b: int) -> Tensor:
    """Pieces a..b-1 of ``buf`` as one contiguous view."""
    return buf[bounds[a] : bounds[b]]


def _ring_reduce_scatter(g: _Ranks, buf: Tensor, bounds: list[int]) -> None:
    """Ring reduce-scatter in place (Patarasuk & Yuan 2009): p-1 steps, (p-1)/p n bytes.

    At step s position i sends its partial sum of piece i-s-1 to i+1 and adds the one of
    piece i-s-2 received from i-1. Afterwards piece i of position i holds the full sum;
    the other pieces hold partial sums.
    """
    p, me = g.p, g.me
    scratch = buf.new_empty(-(-buf.numel() // p))  # the largest piece: ceil(n / p)
    for s in range(p - 1):
        out, acc = (me - s - 1) % p, (me - s - 2) % p
        target = _span(buf, bounds, acc, acc + 1)
        recv = scratch[: target.numel()]  # one buffer for every step: no allocation per step
        _exchange(g, _span(buf, bounds, out, out + 1), me + 1, recv, me - 1)
        target.add_(recv)


def _ring_all_gather(g: _Ranks, buf: Tensor, bounds: list[int]) -> None:
    """Ring all-gather in place: position i starts with piece i, ends with all of them.

    At step s position i forwards piece i-s to i+1 and receives piece i-s-1 from i-1:
    p-1 steps, (p-1)/p n bytes sent by every rank.
    """
    p, me = g.p, g.me
    for s in range(p - 1):
        out, into = (me - s) % p, (me - s - 1) % p
        send, recv = _span(buf, bounds, out, out + 1), _span(buf, bounds, into, into + 1)
        _exchange(g, send, me + 1, recv, me - 1)


def _subtree(me: int, p: int) -> tuple[int, list[int]]:
    """Binomial tree rooted at position 0: positions me..me+size-1 form me's subtree.

    Returns ``size`` and the offsets of me's children (child me+c owns pieces
    me+c..me+min(2c, size)-1). me's parent is me - lowbit(me).
    """
    size = min(me & -me, p - me) if me else p
    return size, [1 << k for k in range((size - 1).bit_length())]


def _tree_scatter(g: _Ranks, buf: Tensor, bounds: list[int]) -> None:
    """Binomial scatter from position 0: receive my subtree's pieces, pass halves down."""
    me = g.me
    size, children = _subtree(me, g.p)
    if me:
        _exchange(g, recv=_span(buf, bounds, me, me + size), frm=me - (me & -me))
    for c in reversed(children):  # biggest subtree first
        _exchange(g, send=_span(buf, bounds, me + c, me + min(2 * c, size)), to=me + c)


def _tree_gather(g: _Ranks, buf: Tensor, bounds: list[int]) -> None:
    """Binomial gather to position 0: collect my children's pieces, pass them up."""
    me = g.me
    size, children = _subtree(me, g.p)
    for c in children:  # smallest subtree first: it is ready first
        _exchange(g, recv=_span(buf, bounds, me + c, me + min(2 * c, size)), frm=me + c)
    if me:
        _exchange(g, send=_span(buf, bounds, me, me + size), to=me - (me & -me))


def broadcast(tensor: Tensor, src: int, group: ProcessGroup | None = None) -> None:
    """Every rank's ``tensor`` gets ``src``'s values, in place.

    van de Geijn's broadcast (Chan et al. 2007; Thakur et al. 2005): binomial
    scatter of p pieces from the root, then ring all-gather. The root sends
    2(p-1)/p n < 2n bytes, against n * ceil(lg p) for a plain binomial broadcast.
    """
    g = _Ranks(group, _group_rank(group, src))
    buf = _flat_copy(tensor) if g.me == 0 else tensor.new_empty(tensor.numel())
    bounds = _bounds(buf.numel(), g.p)
    _tree_scatter(g, buf, bounds)
    _ring_all_gather(g, buf, bounds)
    if g.me != 0:
        tensor.copy_(buf.view_as(tensor))


def reduce(tensor: Tensor, dst: int, group: ProcessGroup | None = None) -> None:
    """``dst``'s ``tensor`` gets the element-wise sum over ranks; others keep theirs.

    Rabenseifner's reduce (Thakur et al. 2005): reduce-scatter (the ring here, which works
    for any p, in place of recursive halving), then binomial gather of the reduced pieces
    to the root. Partial sums live in a private buffer, so the other ranks' tensors are
    untouched. The busiest rank sends < 2n bytes.
    """
    g = _Ranks(group, _group_rank(group, dst))
    buf = _flat_copy(tensor)
    bounds = _bounds(buf.numel(), g.p)
    _ring_reduce_scatter(g, buf, bounds)
    _tree_gather(g, buf, bounds)
    if g.me == 0:
        tensor.copy_(buf.view_as(tensor))


def all_reduce(tensor: Tensor, group: ProcessGroup | None = None) -> None:
    """Every rank's ``tensor`` gets the element-wise sum over ranks, in place.

    Ring all-reduce (Patarasuk & Yuan 2009): ring reduce-scatter then ring all-gather,
    2(p-1) steps; every rank sends 2(p-1)/p n bytes, the lower bound. All ranks end
    with bitwise identical values (each piece is summed once, then copied).
    """
    g = _Ranks(group)
    # A contiguous tensor is reduced where it lies; any other goes through a flat copy.
    buf = tensor.detach().view(-1) if tensor.is_contiguous() else _flat_copy(tensor)
    bounds = _bounds(buf.numel(), g.p)
    _ring_reduce_scatter(g, buf, bounds)
    _ring_all_gather(g, buf, bounds)
    if buf.data_ptr() != tensor.data_ptr():
        tensor.copy_(buf.view_as(tensor))


def scatter(
    tensor: Tensor, scatter_list: list[Tensor] | None, src: int, group: ProcessGroup | None = None
) -> None:
    """Rank r's ``tensor`` gets ``scatter_list[r]`` of ``src`` (``None`` off ``src``).

    Binomial tree (Chan et al. 2007, minimum-spanning-tree scatter): ceil(lg p) rounds;
    the root sends (p-1)/p n bytes, n = the whole list. Ranks are counted from the root,
    so any p and any root work.
    """
    g = _Ranks(group, _group_rank(group, src))
    m = tensor.numel()
    if g.me == 0:
        assert scatter_list is not None, "scatter_list is required on src"
        buf = torch.cat([scatter_list[g.rank(i)].reshape(-1) for i in range(g.p)])
    else:
        buf = tensor.new_empty(g.p * m)
    _tree_scatter(g, buf, [i * m for i in range(g.p + 1)])
    tensor.copy_(buf[g.me * m : (g.me + 1) * m].view_as(tensor))


def gather(
    tensor: Tensor, gather_list: list[Tensor] | None, dst: int, group: ProcessGroup | None = None
) -> None:
    """On ``dst``, ``gather_list[r]`` gets rank r's ``tensor`` (``None`` off ``dst``).

    Binomial tree, the mirror of ``scatter``: ceil(lg p) rounds; the root receives
    (p-1)/p n bytes.
    """
    g = _Ranks(group, _group_rank(group, dst))
    m = tensor.numel()
    buf = tensor.new_empty(g.p * m)
    buf[g.me * m : (g.me + 1) * m] = tensor.reshape(-1)
    _tree_gather(g, buf, [i * m for i in range(g.p + 1)])
    if g.me == 0:
        assert gather_list is not None, "gather_list is required on dst"
        for i in range(g.p):
            out = gather_list[g.rank(i)]
            out.copy_(buf[i * m : (i + 1) * m].view_as(out))


def all_gather(
    tensor_list: list[Tensor], tensor: Tensor, group: ProcessGroup | None = None
) -> None:
    """On every rank, ``tensor_list[r]`` gets rank r's ``tensor``.

    Ring (Thakur et al. 2005; Chan et al. 2007): p-1 steps, (p-1)/p n bytes per rank,
    n = the whole gathered output.
    """
    g = _Ranks(group)
    m = tensor.numel()
    buf = tensor.new_empty(g.p * m)
    buf[g.me * m : (g.me + 1) * m] = tensor.reshape(-1)
    _ring_all_gather(g, buf, [i * m for i in range(g.p + 1)])
    for i, out in enumerate(tensor_list):
        out.copy_(buf[i * m : (i + 1) * m].view_as(out))


def reduce_scatter(
    output: Tensor, input_list: list[Tensor], group: ProcessGroup | None = None
) -> None:
    """Rank r's ``output`` gets the sum over ranks of their ``input_list[r]``.

    Ring (Patarasuk & Yuan 2009; Chan et al. 2007): p-1 steps,
    (p-1)/p n bytes per rank, n = the whole input list. ``input_list`` is left unchanged.
    """
    g = _Ranks(group)
    m = output.numel()
    buf = torch.cat([t.reshape(-1) for t in input_list])  # a private copy
    _ring_reduce_scatter(g, buf, [i * m for i in range(g.p + 1)])
    output.copy_(buf[g.me * m : (g.me + 1) * m].view_as(output))


def all_to_all(
    output_list: list[Tensor], input_list: list[Tensor], group: ProcessGroup | None = None
) -> None:
    """On rank r, ``output_list[s]`` gets rank s's ``input_list[r]``.

    Pairwise exchange (Thakur et al. 2005, long messages): at step k = 1..p-1 rank r
    sends to r+k and receives from r-k at the same time; p-1 steps, (p-1)/p n bytes.
    """
    g = _Ranks(group)
    me = g.me
    output_list[me].copy_(input_list[me])
    for k in range(1, g.p):
        send = input_list[(me + k) % g.p].contiguous()
        out = output_list[(me - k) % g.p]
        recv = torch.empty_like(out, memory_format=torch.contiguous_format)
        _exchange(g, send, me + k, recv, me - k)
        out.copy_(recv)
