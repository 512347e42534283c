"""Assignment: context parallelism, attention over a sequence split across ranks.

You may use `torch.distributed`. `group` is a process group (`None`: the default group);
p = `dist.get_world_size(group)` and r = `dist.get_rank(group)` (the rank inside the group).
Every rank of the group calls collectively. The sequence of S positions is cut into p
contiguous blocks of n = S/p: rank r holds positions [r*n, (r+1)*n) of the queries, keys and
values, each `[B, H, n, D]`, and returns its block of softmax(q k^T / sqrt(D)) v over the
whole sequence of keys, `[B, H, n, D]` in the inputs' dtype. With `causal=True`, query
position i attends to key positions j <= i only (global positions). Both functions are
differentiable: each rank gets the gradients of its own q, k and v blocks, every other rank's
queries' contributions to its K/V gradients included.

Graded (`grader list context_parallel`; points in tests/graded/grading.yaml), at p = 1..4:
outputs and dq, dk, dv against one-process attention in float64 (float32 and float64
inputs, causal and not, S = 8p and S = p, i.e. blocks of one position), with scores beyond 88
in one case; the causality probe (changing keys and values at later positions leaves earlier
outputs and their dq bit-for-bit unchanged). From the broker's record (`*_communication`):
the ring sends only to r+1 and receives only from r-1, forwards exactly p-1 K/V blocks per
rank in forward, each the one it received the step before (a true rotation, checked on what
the messages carry), and its backward moves at most 1.5x the bytes of (p-1) K/V blocks and
p dK/dV blocks; Ulysses makes only all-to-alls, four each way, each sending every peer
(S/p)(H/p)D elements per batch row, the forward's carrying your q, k and v heads.

Hints
    - Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers for
      Near-Infinite Context" (the ring, section 3); Jacobs et al. 2023, "DeepSpeed Ulysses:
      System Optimizations for Enabling Training of Extreme Long Sequence Transformer Models"
      (the all-to-all over heads, section 3); Milakov and Gimelshein 2018, "Online normalizer
      calculation for softmax" (the running log-sum-exp).
    - A row's softmax needs every block's scores: merge the blocks with a running log-sum-exp,
      never by averaging the blocks' outputs.
    - Subtract the running maximum before `exp` (scores beyond 88 overflow float32's exp).
    - In causal attention the mask is about global positions: only the diagonal block (the
      rank's own keys) needs the triangular mask; earlier blocks are whole, later ones skipped.
    - Two ranks that both block in `send` to each other deadlock (the grader says so at once):
      post the send and the receive together (`isend`/`irecv`, or `batch_isend_irecv`) and
      wait for both.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed import ProcessGroup


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, group: ProcessGroup | None = None
) -> Tensor:
    """This rank's block of attention over the whole sequence, by passing K/V around a ring.

    - q, k, v: `[B, H, n, D]`, rank r's positions [r*n, (r+1)*n); `causal` as in the module
      docstring. Returns `[B, H, n, D]` in q's dtype, differentiable with respect to q, k, v.
    - K/V blocks pass around the ring (send to r+1, receive from r-1): exactly p-1 blocks leave
      each rank in forward, each the one that arrived the step before. The blocks are merged
      with a log-sum-exp in float32 (or in the inputs' dtype when it is wider).
    - Backward saves q, k, v, the output and the log-sum-exp, not the other ranks' blocks, and
      sends p-1 K/V blocks and p dK/dV blocks per rank. At p = 1 nothing is sent.

    Graded and the communication budget as in the module docstring.

    Hints
        Implement it as a `torch.autograd.Function` whose `backward` returns one gradient per
        input of `forward` (None for `causal` and `group`).

        Forward, p steps s = 0, 1, ..., p-1. At step s this rank holds the K/V block of rank
        (r - s) mod p (its own at step 0). Unless s = p-1, it first posts the non-blocking
        send of that block to rank (r+1) mod p and the receive of the next one from rank
        (r-1) mod p (one message holding K and V stacked, or two); then it computes the scores
        of its queries against the held block, and merges them into the running result; then
        it waits for both messages, and the received block is the one it holds at step s+1.

        The merge, per query row, keeps the running output o and log-sum-exp l (l = log of the
        sum of exp(score) over the keys seen so far). A block with scores s_j gives
        m = max_j s_j, l_b = m + log(sum_j exp(s_j - m)) and o_b = sum_j exp(s_j - l_b) v_j;
        then l_new = logaddexp(l, l_b), o = exp(l - l_new) o + exp(l_b - l_new) o_b. Start
        from l = -inf, o = 0, or from the first block computed.

        Causal: the held block of rank j = (r - s) mod p is computed whole if j < r, with the
        triangular mask (key i' <= query i, local indices) if j = r, and skipped if j > r (its
        keys are all in the future). Skipped blocks are still passed on: the ring keeps moving.

        Backward: send K/V around the ring again, with the running dK/dV of the held block
        beside it: at each step add this rank's contribution to the held block's dK/dV and to
        its own dq; after the last step send the dK/dV one more hop, so that it arrives home at
        the block's owner. With P = exp(scores - l) and dP = dO v^T: dv += P^T dO,
        dS = P * (dP - rowsum(dO * O)), dq += dS k / sqrt(D), dk += dS^T q / sqrt(D).
    """
    raise NotImplementedError("context_parallel.ring_attention: not implemented yet")


def ulysses_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, group: ProcessGroup | None = None
) -> Tensor:
    """The same result as `ring_attention`, by trading sequence shards for head shards.

    - q, k, v: `[B, H, n, D]` as for `ring_attention`; H must be divisible by p (`ValueError`
      naming H and p if not). Returns `[B, H, n, D]`, differentiable.
    - Communication: only all-to-alls, four in forward (q, k, v to head shards, the output
      back) and four in backward, each sending every peer B (S/p)(H/p) D elements. At p = 1
      it is plain attention and sends nothing.

    Graded as in the module docstring.

    Hints
        1. An all-to-all for each of q, k and v: rank r sends rank j its positions
           [r*n, (r+1)*n) of heads [j*H/p, (j+1)*H/p), and receives from every rank its
           positions of heads [r*H/p, (r+1)*H/p): after it, rank r holds the whole sequence of
           H/p heads, `[B, H/p, S, D]`, the positions in rank order.
        2. Plain attention (causal or not) over the whole sequence, head by head: no merging.
        3. One all-to-all back, heads to sequence: rank r gets its positions of every head.

        Backward mirrors it: one all-to-all of the output's gradient to head shards, local
        attention backward, three all-to-alls of dq, dk and dv back to sequence shards.
        `dist.all_to_all_single` on a tensor whose first dimension is the peer (after a
        permute and `.contiguous()`), or `dist.all_to_all` on a list of p chunks: the layout
        is the usual place to go wrong.
    """
    raise NotImplementedError("context_parallel.ulysses_attention: not implemented yet")
