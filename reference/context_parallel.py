"""Context parallelism: attention over a sequence split across ranks, by a ring or by heads.

Reference solution of `assignments/context_parallel.py`. Rank r of p holds the r-th
contiguous block of n = S/p positions of q, k and v (`[B, H, n, D]`) and computes its block
of softmax(q k^T / sqrt(D)) v over the whole sequence. Two classic ways:

- Ring attention (Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers
  for Near-Infinite Context"): the K/V blocks travel around the ring of ranks, one hop per
  step, while every rank attends its queries to the block it holds and folds the result into
  a running log-sum-exp (Milakov and Gimelshein 2018, "Online normalizer calculation for
  softmax"; the same merge as FlashAttention's). No rank ever holds more than two K/V blocks.
- DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for
  Enabling Training of Extreme Long Sequence Transformer Models"): an all-to-all turns the
  sequence shards into head shards, each rank runs ordinary attention over the whole
  sequence for H/p heads, and an all-to-all turns the result back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx
from torch.distributed import ProcessGroup


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or the input's dtype when it is wider (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def _diagonal_mask(n: int, device: torch.device) -> Tensor:
    """True where key i' comes after query i within one block: those scores are masked."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


def _scores(q: Tensor, k: Tensor, diagonal: bool) -> Tensor:
    """q k^T / sqrt(D), with the causal triangle masked if this is the diagonal block."""
    scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
    if diagonal:
        scores = scores.masked_fill(_diagonal_mask(q.size(-2), q.device), float("-inf"))
    return scores


def _block_attention(q: Tensor, k: Tensor, v: Tensor, diagonal: bool) -> tuple[Tensor, Tensor]:
    """Attention of q to one K/V block: its output and each row's log-sum-exp of scores.

    The row maximum m is subtracted before exp: exp(score) itself overflows float32 beyond
    88, while exp(score - m) <= 1.
    """
    scores = _scores(q, k, diagonal)
    m = scores.amax(dim=-1, keepdim=True)
    lse = m + torch.log(torch.exp(scores - m).sum(dim=-1, keepdim=True))
    return torch.exp(scores - lse) @ v, lse


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Fold one block's (output, log-sum-exp) into the running ones.

    Each output is normalised by its own sum of exps; rescaling by exp(lse - new_lse) puts
    both over the joint sum. logaddexp shifts by the larger of the two, so nothing overflows.
    """
    new_lse = torch.logaddexp(lse, block_lse)
    return torch.exp(lse - new_lse) * out + torch.exp(block_lse - new_lse) * block_out, new_lse


def _block_gradients(
    q: Tensor, k: Tensor, v: Tensor, d_out: Tensor, lse: Tensor, delta: Tensor, diagonal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """One K/V block's share of dQ, and the block's dK and dV from these queries.

    With P = exp(scores - lse) (the softmax rows, from the whole sequence's log-sum-exp saved
    in forward), dP = dO v^T and delta = rowsum(dO * O): dV = P^T dO, dS = P * (dP - delta),
    dQ = dS K / sqrt(D), dK = dS^T Q / sqrt(D).
    """
    scale = q.size(-1) ** -0.5
    probs = torch.exp(_scores(q, k, diagonal) - lse)
    d_scores = probs * (d_out @ v.transpose(-2, -1) - delta)
    return (
        (d_scores @ k) * scale,
        (d_scores.transpose(-2, -1) @ q) * scale,
        probs.transpose(-2, -1) @ d_out,
    )


def _pass_on(block: Tensor, group: ProcessGroup | None) -> tuple[Tensor, list[dist.Work]]:
    """Post the send of ``block`` to rank r+1 and the receive of the next one from rank r-1.

    Both are posted together and waited for later: a blocking send on every rank at once
    would deadlock the ring (each send waits for a receive that nobody has posted yet).
    """
    p, r = dist.get_world_size(group), dist.get_rank(group)
    received = torch.empty_like(block)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, block, group=group, group_peer=(r + 1) % p),
            dist.P2POp(dist.irecv, received, group=group, group_peer=(r - 1) % p),
        ]
    )
    return received, works


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _work_on(owner: int, rank: int, causal: bool) -> tuple[bool, bool]:
    """(compute it, mask its diagonal) for the K/V block of rank ``owner`` on rank ``rank``.

    Causal: earlier blocks are whole, the own block is triangular, later ones are skipped.
    """
    if not causal:
        return True, False
    return owner <= rank, owner == rank


class _RingAttention(torch.autograd.Function):
    """Ring attention: p steps in forward and in backward, one hop of the ring each."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, q: Tensor, k: Tensor, v: Tensor, causal: bool, group: ProcessGroup | None
    ) -> Tensor:
        p, r = dist.get_world_size(group), dist.get_rank(group)
        acc = _accumulation_dtype(q.dtype)
        q_acc = q.to(acc)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])  # one message per step: K and V of the same block
        for step in range(p):
            owner = (r - step) % p  # whose block this rank holds now
            if step < p - 1:
                next_kv, works = _pass_on(kv, group)
            compute, diagonal = _work_on(owner, r, causal)
            if compute:
                block_out, block_lse = _block_attention(
                    q_acc, kv[0].to(acc), kv[1].to(acc), diagonal
                )
                out, lse = _merge(out, lse, block_out, block_lse)
            if step < p - 1:
                _wait(works)
                kv = next_kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group = causal, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        """K/V go around again; the dK/dV of the held block travels with it and ends at home."""
        q, k, v, out, lse = ctx.saved_tensors
        p, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        acc = _accumulation_dtype(q.dtype)
        q_acc, d_out = q.to(acc), grad_out.to(acc)
        delta = (d_out * out).sum(dim=-1, keepdim=True)
        dq = torch.zeros_like(q_acc)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)  # the held block's dK, dV
        for step in range(p):
            owner = (r - step) % p
            if step < p - 1:
                next_kv, kv_works = _pass_on(kv, ctx.group)
            compute, diagonal = _work_on(owner, r, ctx.causal)
            if compute:
                k_block, v_block = kv[0].to(acc), kv[1].to(acc)
                dq_block, dk_block, dv_block = _block_gradients(
                    q_acc, k_block, v_block, d_out, lse, delta, diagonal
                )
                dq += dq_block
                dkv = dkv + torch.stack([dk_block, dv_block])
            if p > 1:  # p hops in all: after the last one, every dK/dV is back at its owner
                dkv, dkv_works = _pass_on(dkv, ctx.group)
                _wait(dkv_works)
            if step < p - 1:
                _wait(kv_works)
                kv = next_kv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, group: ProcessGroup | None = None
) -> Tensor:
    """This rank's block of attention over the whole sequence, K/V passed around a ring."""
    return _RingAttention.apply(q, k, v, causal, group)


def _all_to_all(pieces: list[Tensor], group: ProcessGroup | None) -> list[Tensor]:
    """Send pieces[j] to rank j; return what every rank sent here, in rank order."""
    pieces = [piece.contiguous() for piece in pieces]
    received = [torch.empty_like(piece) for piece in pieces]
    dist.all_to_all(received, pieces, group=group)
    return received


def _sequence_to_heads(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """[B, H, S/p, D] (my positions, all heads) -> [B, H/p, S, D] (my heads, all positions)."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    return torch.cat(_all_to_all(list(x.chunk(p, dim=1)), group), dim=2)


def _heads_to_sequence(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """[B, H/p, S, D] (my heads, all positions) -> [B, H, S/p, D] (my positions, all heads)."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    return torch.cat(_all_to_all(list(x.chunk(p, dim=2)), group), dim=1)


class _SequenceToHeads(torch.autograd.Function):
    """All-to-all from sequence shards to head shards; its adjoint, the way back, in backward."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _heads_to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    """All-to-all from head shards back to sequence shards; in backward, the other way."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _sequence_to_heads(grad, ctx.group), None


def ulysses_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, group: ProcessGroup | None = None
) -> Tensor:
    """The same result by head parallelism: all-to-all, local attention, all-to-all back."""
    p, heads = dist.get_world_size(group), q.size(1)
    if heads % p != 0:
        raise ValueError(f"H={heads} heads are not divisible by the context-parallel size {p}")
    q, k, v = (_SequenceToHeads.apply(x, group) for x in (q, k, v))
    acc = _accumulation_dtype(q.dtype)
    out, _ = _block_attention(q.to(acc), k.to(acc), v.to(acc), diagonal=causal)
    return _HeadsToSequence.apply(out.to(q.dtype), group)
