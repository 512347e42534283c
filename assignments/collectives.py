"""Assignment: the collective operations, built from point-to-point messages.

Implement the eight collectives below with `torch.distributed.send`, `recv`, `isend`, `irecv`,
`batch_isend_irecv` and `P2POp`, plus local tensor math; calling a built-in collective of
`torch.distributed` or of a process group fails the test as `forbidden`. Every rank calls each
function together, with tensors of the same shape and dtype. Results go in place into the
caller's tensors; arguments that are not outputs stay unchanged. Any world size p works (1
included), any size (not divisible by p, smaller than p), any dtype torch can add, and
non-contiguous tensors. `group=None` is the world; lists are indexed by group rank, `src` and
`dst` are global ranks. The communication budget of each function is in its "Graded" line.

Graded (`grader list collectives`; points and ratios in tests/graded/grading.yaml)
    - Correctness, 1 point per function per world size p = 1, 2, 3, 4. One test calls the
      function on many cases: 1 element (fewer than the ranks), 2p + 1 elements (a size p
      does not divide), a non-contiguous 3x5 view, each in 4 dtypes (float32, float64,
      bfloat16, int64), and one float32 tensor of about 1M elements; the rooted operations
      with every rank as the root. Floats may differ from the exact sum by a few rounding
      errors of their dtype per rank; integers must be exact. The first wrong element fails
      the test.
    - `communication[<function>]`, 0.5 point at p = 2, 3, 4, on 49152 float32 elements
      (192 KB): the bytes the busiest rank sends or receives (the larger), as the grader's
      broker counted them, against the lower bound given in each function's "Graded" line;
      within the ratio given there earns the points, beyond it none. The message also reports
      your rounds against the reference's and the ceil(log2 p) minimum: a round is one step
      of the longest chain of messages each of which waits for the one before. Rounds are not
      scored here; they are latency, which the performance test prices.
    - `performance[<function>]`, 0.5 point at p = 2 and 4, on 1M float32 elements (4 MB):
      your message pattern (sizes, order, dependencies) is replayed on models of real
      machines (8 GPUs on NVLink, 2 nodes on InfiniBand) against the reference's pattern of
      the same call, and your local work between messages (CPU time, and time spent neither
      computing nor in a message, such as a sleep) is timed by the kernel against the
      reference's, run beside yours on the same machine (only what exceeds the reference's by
      more than 20 ms a call counts: a sleep, a Python loop over the elements): full points
      within 1.5x the reference's time (the larger of the two ratios; the messages' is the
      geometric mean over the machines), none beyond 3x, linear between. Waiting for a busy
      CPU is never charged. `grader bench` shows the message projection for every size.
    - Both cost tests check the result first: a wrong result earns none of their points.

Hints
    - With p == 1 nothing is sent.
    - When you split a buffer into p pieces (`torch.tensor_split` makes sizes differ by at
      most one), some pieces may be empty; skip or send them, but sender and receiver agree.
    - Sums are element-wise `+`, in the tensor's own dtype.
    - gloo refuses to send or receive a non-contiguous tensor ("input tensor has to be
      contiguous"). Work on a contiguous flat copy (`t.reshape(-1).clone()` or
      `t.contiguous().view(-1)`) and copy the result back.
    - Write results with `copy_`: rebinding a local name (`tensor = ...`) changes nothing for
      the caller. Accumulate partial sums in a private copy, never in an input.
    - On gloo a blocking `send` waits until the peer posts the matching receive, so two ranks
      that `send` to each other at the same time deadlock. Post the send with `isend` (or use
      `batch_isend_irecv`), do the receive, then `wait()` the send.
    - Every message sent must be received: a stray message is delivered to the next receive
      from that peer and corrupts later calls.
    - send/recv take global ranks: `dist.get_global_rank(group, r)` converts a group rank when
      `group` is not `None`, and `dist.get_group_rank(group, src)` goes the other way.
    - Each function's hints give the classic algorithms' costs for p ranks and n bytes: rounds
      of messages, and bytes sent by the busiest rank. Background: Thakur, Rabenseifner &
      Gropp, "Optimization of Collective Communication Operations in MPICH" (2005); Chan et
      al., "Collective communication: theory, practice, and experience" (2007); Patarasuk &
      Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations" (2009).
"""

from __future__ import annotations

import torch  # noqa: F401
import torch.distributed as dist  # noqa: F401
from torch import Tensor
from torch.distributed import ProcessGroup


def broadcast(tensor: Tensor, src: int, group: ProcessGroup | None = None) -> None:
    """Make every rank's `tensor` hold `src`'s values, in place.

    - `tensor`: input on `src` (left unchanged there), output on the other ranks.
    - `src`: global rank of the source. `group`: the process group, `None` for the world.

    Graded: correctness as in the module notes; communication: the busiest rank may move at
    most 2.0x the bound of n bytes (the tensor).

    Hints
        - Binomial tree: ceil(log2 p) rounds, but the root sends n bytes in every round.
        - van de Geijn (aim for this one): scatter p pieces of the buffer from the root with a
          binomial tree, then ring all-gather the pieces. About log2 p + p - 1 rounds; the
          busiest rank sends 2(p-1)/p n < 2n bytes, whatever p. Lower bound: n.
        - Number ranks relative to the root, `(rank - src) % p`, so any root works.
    """
    raise NotImplementedError("collectives.broadcast: not implemented yet")


def reduce(tensor: Tensor, dst: int, group: ProcessGroup | None = None) -> None:
    """Make `dst`'s `tensor` hold the element-wise sum over all ranks, in place.

    - `tensor`: every rank's contribution; on `dst` overwritten with the sum, on every other
      rank left unchanged (no partial sums left behind).
    - `dst`: global rank that receives the sum. `group`: the process group, `None` for the world.

    Graded: correctness as in the module notes; communication: the busiest rank may move at
    most 2.0x the bound of n bytes (the tensor).

    Hints
        - Binomial tree: ceil(log2 p) rounds; a rank sends n bytes, the root adds up to
          log2 p full-size tensors.
        - Rabenseifner (aim for this one): reduce-scatter the buffer into p pieces (ring, or
          recursive halving when p is a power of two), so rank i holds the full sum of piece i,
          then gather the pieces to the root with a binomial tree. The busiest rank sends < 2n
          bytes. Lower bound: n. Do it on a private copy of `tensor`.
    """
    raise NotImplementedError("collectives.reduce: not implemented yet")


def all_reduce(tensor: Tensor, group: ProcessGroup | None = None) -> None:
    """Make every rank's `tensor` hold the element-wise sum over all ranks, in place.

    - `tensor`: input and output. `group`: the process group, `None` for the world.

    Graded: correctness as in the module notes; communication: the busiest rank may move at
    most 1.25x the bound of 2(p-1)/p n bytes.

    Hints
        - Recursive doubling: log2 p rounds, n bytes per round (p a power of two).
        - Ring (aim for this one; Patarasuk & Yuan 2009): split the flat buffer into p pieces;
          ring reduce-scatter (p-1 steps: send one piece to rank r+1, receive one from rank
          r-1 and add it) leaves rank r with the full sum of one piece; ring all-gather (p-1
          steps) circulates the summed pieces. 2(p-1) rounds; every rank sends 2(p-1)/p n
          bytes, which is the lower bound.
        - Sending and receiving in the same step needs `isend`/`irecv` (see the module hints).
    """
    raise NotImplementedError("collectives.all_reduce: not implemented yet")


def scatter(
    tensor: Tensor, scatter_list: list[Tensor] | None, src: int, group: ProcessGroup | None = None
) -> None:
    """Make rank r's `tensor` hold `scatter_list[r]` of `src`, in place.

    - `tensor`: output on every rank (`src` included), the shape of one list entry.
    - `scatter_list`: on `src`, p tensors shaped like `tensor`, indexed by group rank, left
      unchanged; `None` on the other ranks.
    - `src`: global rank of the source. `group`: the process group, `None` for the world.

    Graded: correctness as in the module notes; communication: the busiest rank may move at
    most 1.25x the bound of (p-1)/p n (n = the whole list) bytes.

    Hints
        - Linear: the root sends p-1 messages one after the other: p-1 rounds.
        - Binomial tree (aim for this one): with ranks numbered relative to the root, a rank
          receives from its parent the entries of its whole subtree in one message, then hands
          half of them to each child, the biggest subtree first. ceil(log2 p) rounds; the root
          sends (p-1)/p n bytes, the lower bound. It must work for any p, not only powers of 2.
    """
    raise NotImplementedError("collectives.scatter: not implemented yet")


def gather(
    tensor: Tensor, gather_list: list[Tensor] | None, dst: int, group: ProcessGroup | None = None
) -> None:
    """On `dst`, make `gather_list[r]` hold rank r's `tensor`, in place.

    - `tensor`: every rank's input, left unchanged.
    - `gather_list`: on `dst`, p output tensors shaped like `tensor`, indexed by group rank
      (fill each with `copy_`); `None` on the other ranks.
    - `dst`: global rank that gathers. `group`: the process group, `None` for the world.

    Graded: correctness as in the module notes; communication: the busiest rank may move at
    most 1.25x the bound of (p-1)/p n (n = the whole list) bytes.

    Hints
        - Linear: the root receives p-1 messages: p-1 rounds.
        - Binomial tree (aim for this one), the mirror of `scatter`: each rank collects its
          children's subtrees, then sends its whole subtree to its parent in one message.
          ceil(log2 p) rounds; the root receives (p-1)/p n bytes (n = all entries together).
    """
    raise NotImplementedError("collectives.gather: not implemented yet")


def all_gather(
    tensor_list: list[Tensor], tensor: Tensor, group: ProcessGroup | None = None
) -> None:
    """On every rank, make `tensor_list[r]` hold rank r's `tensor`, in place.

    - `tensor_list`: p output tensors shaped like `tensor`, indexed by group rank (filled in
      place, never rebound).
    - `tensor`: this rank's input, left unchanged. `group`: the process group, `None` for the
      world.

    Graded: correctness as in the module notes; communication: the busiest rank may move at
    most 1.25x the bound of (p-1)/p n (n = the whole output list) bytes.

    Hints
        - Recursive doubling: log2 p rounds, (p-1)/p n bytes (p a power of two).
        - Ring (aim for this one): at step s = 0..p-2, rank r sends the entry it got at the
          previous step (its own at s = 0) to rank r+1 and receives a new one from rank r-1.
          p-1 rounds; every rank sends (p-1)/p n bytes (n = the whole output), the lower
          bound, for any p.
    """
    raise NotImplementedError("collectives.all_gather: not implemented yet")


def reduce_scatter(
    output: Tensor, input_list: list[Tensor], group: ProcessGroup | None = None
) -> None:
    """Make rank r's `output` hold the element-wise sum over ranks of their `input_list[r]`.

    - `output`: this rank's result, in place; the shape of one list entry.
    - `input_list`: p tensors shaped like `output`, indexed by group rank, left unchanged.
    - `group`: the process group, `None` for the world.

    Graded: correctness as in the module notes; communication: the busiest rank may move at
    most 1.25x the bound of (p-1)/p n (n = the whole input list) bytes.

    Hints
        - Recursive halving: log2 p rounds, (p-1)/p n bytes (p a power of two).
        - Ring (aim for this one): at step s = 0..p-2, rank r sends its partial sum of one
          entry to rank r+1 and adds the partial sum of another entry received from rank r-1;
          choose the order so that rank r ends with the full sum of entry r. p-1 rounds; every
          rank sends (p-1)/p n bytes (n = the whole input list). Accumulate in a private copy.
    """
    raise NotImplementedError("collectives.reduce_scatter: not implemented yet")


def all_to_all(
    output_list: list[Tensor], input_list: list[Tensor], group: ProcessGroup | None = None
) -> None:
    """On rank r, make `output_list[s]` hold rank s's `input_list[r]`, in place.

    - `output_list`: p output tensors, indexed by the sending group rank.
    - `input_list`: p input tensors, indexed by the receiving group rank, left unchanged;
      `input_list[r]` on rank s is shaped like `output_list[s]` on rank r.
    - `group`: the process group, `None` for the world.

    Graded: correctness as in the module notes; communication: the busiest rank may move at
    most 1.25x the bound of (p-1)/p n (n = one rank's whole input list) bytes.

    Hints
        - Bruck: ceil(log2 p) rounds but about n/2 log2 p bytes (good for short messages).
        - Pairwise exchange (aim for this one): copy your own entry locally, then at step
          k = 1..p-1 send `input_list[(r+k) % p]` to rank r+k while receiving
          `output_list[(r-k) % p]` from rank r-k, both at once. p-1 rounds; every rank sends
          (p-1)/p n bytes (n = its whole input list), the lower bound.
    """
    raise NotImplementedError("collectives.all_to_all: not implemented yet")
