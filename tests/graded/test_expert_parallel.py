"""Graded tests of ``assignments/expert_parallel.py``: a mixture of experts over the ranks.

One ``MoE`` layer (``grader/scenarios/expert_parallel.py``: the layer the assignment writes
out) is drawn here from the secret seed and sent to every rank with the rank's own tokens
(5, 1, 8 and 3 on ranks 0..3) and the upstream gradient of their outputs; each rank wraps it
in the submission's ``ExpertParallelMoE``, runs one forward, one backward and
``finish_gradient_synchronization()``. The oracle is the same layer run here in one process,
in float64, on all ranks' tokens in rank order, with the loss ``(1/p) sum_r <y_r, g_r>``
(``grader/testkit/moe.py``, which also builds the routing: token i of rank r prefers
the (i + r)-th expert in play, so every rank's experts get rows from several ranks):

- ``moe``: outputs, the tokens' gradients, the router's gradients and those of this rank's
  experts, with E = p and 2p experts, top-1 and top-2. Where k < E expert 0's router bias
  keeps every token away from it (an expert with no token), and rank 1's single token
  leaves it without a token for most experts. Routing margins are drawn large enough that
  float32 and float64 route every token alike.
- ``capacity``: ``capacity_factor=0.5`` drops pairs at every world size; the oracle keeps
  each expert's first C pairs of the concatenated tokens, C = ceil(0.5 * k * T / E).
- ``identity_experts``: with top-1 and ``nn.Identity()`` experts the output is the input,
  bit for bit (every gate is exactly 1).
- ``communication``: from the broker's record of every rank's operations (its own count of
  the bytes it carried): at p = 1 nothing; otherwise counts (integers) before any token row,
  no tokens all-gathered, broadcast or all-reduced, the dispatch and combine exactly the kept
  pairs' rows each way (see :func:`row_bytes`), each piece holding what it must (the token
  rows, the experts' outputs, and their gradients in backward, computed here and compared as
  multisets: :func:`grader.testkit.moe.rows_carried`), and the router's gradients all-reduced.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from grader.scenarios.expert_parallel import build_moe
from grader.testkit import (
    CallResult,
    Event,
    OpName,
    TestRecord,
    World,
    check_close,
    failures,
    on_every_rank,
    rank_tensor,
    require,
)
from grader.testkit.compare import named_cause
from grader.testkit.moe import (
    CAPACITY_FACTOR,
    D_FF,
    Case,
    D,
    Oracle,
    draw_layer,
    draw_tokens,
    messages_problem,
    no_rows_hint,
    oracle,
    rank_major_taken_as_expert_major,
    rows_carried,
    rows_problem,
    token_order_taken_as_grouped,
)
from grader.testkit.moe_observed import Observed, observations
from grader.testkit.patterns import Expected

TERMS = 4 * (D + D_FF)  # rounding terms behind an output or gradient element
MAGNITUDE_FLOOR = 1e-2
COUNT_DTYPES = ("int64", "int32", "int16", "uint8", "int8")
NO_GRAD = (
    "no gradient came back through the all-to-alls: dist.all_to_all_single has no backward; "
    "wrap it in a torch.autograd.Function whose backward is the all-to-all with the splits "
    "swapped"
)
TOKEN_ORDER = (
    "the rows were dispatched in token order, not grouped by destination: the split sizes "
    "count each rank's rows in expert order, so sort the (token, expert) pairs by expert "
    "before the all-to-all, and add the outputs back by the same order"
)


def run_case(world: World, case: Case) -> tuple[CallResult, list[Observed], Oracle]:
    state = draw_layer(case)
    xs = draw_tokens(case, build_moe(state, case.num_experts, case.top_k).double())
    gs = [
        rank_tensor(f"{case.key}/grad", r, (n, D), torch.float32) for r, n in enumerate(case.tokens)
    ]
    args = [
        (state, case.num_experts, case.top_k, case.capacity_factor, xs[r], gs[r], case.identity)
        for r in range(case.p)
    ]
    name = f"E={case.num_experts}, top-{case.top_k}, capacity_factor={case.capacity_factor}"
    want = oracle(case, state, xs, gs)
    try:
        out = world.call(scenario="expert_parallel.forward_backward", args=args, case=name)
    except failures.CommunicationError as err:
        hint = no_rows_hint(case, want.kept)
        if err.cause is not failures.Cause.DISAGREEMENT or not hint:
            raise
        raise err.with_hint(hint) from err
    return out, observations(out.returned, name), want


def local_experts(case: Case, rank: int) -> range:
    n = case.num_experts // case.p
    return range(rank * n, (rank + 1) * n)


def close(
    got: Tensor | None,
    want: Tensor,
    what: str,
    why: dict[str, Tensor] | Callable[[], dict[str, Tensor]] | None = None,
    p: int | None = None,
    rows: bool = False,
) -> None:
    """``p``: the world size, for a factor of p; ``rows``: one row per token, whose order the
    rank may get wrong."""
    require(
        got is not None, f"{what} is missing (.grad is None)" + (f": {NO_GRAD}" if rows else "")
    )
    # Every element is a sum of terms of about the tensor's largest size (at least 1e-2: a
    # gradient that cancels to zero, as the router's does with top-1 gates of exactly 1).
    largest = float(want.abs().max()) if want.numel() else 0.0
    magnitude = torch.full_like(want, max(largest, MAGNITUDE_FLOOR))
    context = Expected(p=p, rows_dim=0 if rows else None)
    check_close(
        got, want, what, magnitude=magnitude, terms=TERMS, explanations=why or {}, context=context
    )


def check_output(case: Case, seen: Observed, want: Oracle, rank: int) -> None:
    what = case.describe()
    require(seen.output is not None, f"{what}: forward returned a {seen.output_type}, not a tensor")

    def why() -> dict[str, Tensor]:  # made only if the output is wrong
        mistakes = capacity_mistakes(case, want, rank) if case.capacity_factor else {}
        if case.p > 1 and case.num_experts > case.p:
            mistakes[
                "the rows that arrive are rank-major (rank 0's rows for each of this rank's "
                "experts, then rank 1's, ...), but were split among the experts as if "
                "expert-major: regroup them by local expert before running the experts"
            ] = rank_major_taken_as_expert_major(case, want)[rank]
        if case.p > 1:
            mistakes[TOKEN_ORDER] = token_order_taken_as_grouped(case, want)[rank]
        return mistakes

    close(seen.output, want.outputs[rank], f"{what}: output", why, case.p, rows=True)


def check_gradients(case: Case, seen: Observed, want: Oracle, rank: int) -> None:
    """The router's, then this rank's experts', then the tokens' gradients."""
    what, p, grads = case.describe(), case.p, seen.grads
    for name in ("router.weight", "router.bias"):
        full, own = want.grads[name], want.local_router[rank][name]
        why = {
            "this rank's gradient alone: all-reduce the router's gradients (and divide by p)": own,
            "this rank's gradient divided by p: all-reduce the router's gradients": own / p,
            f"{p}x the expected: the router's gradients were summed over ranks, not averaged": p
            * full,
            "it is zero: no gradient reached the router; are the gates detached?": 0 * full,
        }
        close(grads.get(name), full, f"{what}: {name} gradient", why, p)
    for e in local_experts(case, rank):
        for name, full in want.grads.items():
            if not name.startswith(f"experts.{e}."):
                continue
            got = grads.get(name)
            if got is None and not bool(full.any()):
                continue  # an expert that no token chose has no gradient
            why = {f"{p}x the expected: divide each local expert's gradient by p": p * full}
            where = f"{what}: {name} gradient (expert {e} lives on rank {rank})"
            require(got is not None, f"{where} is missing (.grad is None): {NO_GRAD}")
            close(got, full, where, why, p)
    tokens = want.input_grads[rank]
    why = {f"it is zero: {NO_GRAD}": 0 * tokens}
    close(seen.input_grad, tokens, f"{what}: the tokens' gradient", why, p, rows=True)


def capacity_mistakes(case: Case, want: Oracle, rank: int) -> dict[str, Tensor]:
    """The output under the usual wrong capacity rules, run here on the rank's tokens alone."""
    moe = build_moe(want.state, case.num_experts, case.top_k).double()
    x = want.xs[rank].double()
    k, E, C = case.top_k, case.num_experts, case.capacity
    local = math.ceil(CAPACITY_FACTOR * k * len(x) / E)
    if local == C:
        alone = (
            f"this rank kept its own first C = {C} pairs of every expert: the capacity is "
            "shared by all ranks' pairs, counted in rank order from everyone's counts"
        )
    else:
        alone = (
            f"the capacity was computed from this rank's {len(x)} tokens (C = {local}), not "
            f"from all ranks' {sum(case.tokens)} (C = {C}), and applied to its own pairs alone: "
            "exchange the counts first"
        )
    with torch.no_grad():
        return {alone: moe(x, capacity=local), "no pair was dropped: apply capacity_factor": moe(x)}


def check_case(case: Case, seen: list[Observed], want: Oracle) -> None:
    """Every rank's output first (a wrong one explains wrong gradients), then gradients."""
    on_every_rank(case.p, lambda r: check_output(case, seen[r], want, r))
    on_every_rank(case.p, lambda r: check_gradients(case, seen[r], want, r))


@pytest.mark.graded(target="expert_parallel.ExpertParallelMoE", kind="correctness")
@pytest.mark.parametrize("experts", ["E=p", "E=2p"])
def test_moe_top1(world: World, experts: str) -> None:
    case = Case(world.size, world.size * (1 if experts == "E=p" else 2), 1)
    check_case(case, *run_case(world, case)[1:])


@pytest.mark.graded(target="expert_parallel.ExpertParallelMoE", kind="correctness")
@pytest.mark.parametrize("experts", ["E=p", "E=2p"])
def test_moe_top2(world: World, experts: str) -> None:
    case = Case(world.size, world.size * (1 if experts == "E=p" else 2), 2)
    check_case(case, *run_case(world, case)[1:])


@pytest.mark.graded(target="expert_parallel.ExpertParallelMoE", kind="correctness")
@pytest.mark.parametrize("top_k", ["top-1", "top-2"])
def test_capacity(world: World, top_k: str) -> None:
    case = Case(world.size, 2 * world.size, int(top_k[-1]), CAPACITY_FACTOR)
    check_case(case, *run_case(world, case)[1:])


@pytest.mark.graded(target="expert_parallel.ExpertParallelMoE", kind="correctness")
def test_identity_experts(world: World) -> None:
    case = Case(world.size, 2 * world.size, 1, identity=True)
    _, seen, want = run_case(world, case)

    def check(r: int) -> None:
        got, x = seen[r].output, want.xs[r]
        require(got is not None, f"forward returned a {seen[r].output_type}, not a tensor")
        require(
            got.shape == x.shape, f"output has shape {tuple(got.shape)}, expected {tuple(x.shape)}"
        )
        if not torch.equal(got, x):
            row = int((got != x).any(1).nonzero()[0])
            require(
                False,
                f"{case.describe()}, identity experts: output row {row} is not the token "
                "itself; with top-1 every gate is exactly 1 and dispatch then combine must "
                "bring every row home unchanged, to its own position"
                + (
                    " (it is another token of this rank: the combine did not undo the permutation)"
                    if any(torch.equal(got[row], t) for t in x)
                    else ""
                ),
            )

    on_every_rank(case.p, check)


def row_bytes(case: Case, kept: Tensor) -> tuple[list[int], list[int]]:
    """Bytes of the rows each rank sends in the dispatch (its kept pairs, for every rank's
    experts, its own included) and receives (the kept pairs of every rank for its experts)."""
    n, row = case.num_experts // case.p, D * 4
    sent = [int(kept[r].sum()) * row for r in range(case.p)]
    received = [int(kept[:, n * r : n * (r + 1)].sum()) * row for r in range(case.p)]
    return sent, received


def is_count(event: Event) -> bool:
    return event.dtype in COUNT_DTYPES


def check_traffic(
    case: Case,
    out: CallResult,
    want: Oracle,
    rows: list[list[Tensor]],
    rank: int,
    router_bytes: int,
) -> None:
    """The rank's operations; ``rows``: what its all-to-alls of token rows must carry to each
    rank (:func:`rows_carried`, for this rank)."""
    events = [e for e in out.traffic.per_rank[rank] if e.op != OpName.MARK]
    what, kept = case.describe(), want.kept
    if case.p == 1:
        listed = ", ".join(sorted({e.op for e in events}))
        require(not events, f"{what}: on one rank there is nobody to talk to, yet it made {listed}")
        return
    collectives = [e for e in events if e.peer < 0]
    data = [e for e in collectives if not is_count(e)]
    for e in data:
        require(
            e.op in (OpName.ALL_TO_ALL, OpName.ALL_REDUCE),
            f"{what}: {e.op} of {e.dtype} data at {e.at or '?'}: tokens travel by all-to-all to "
            "the ranks of their experts only, never to every rank",
        )
    reduced = sum(e.nbytes for e in data if e.op == OpName.ALL_REDUCE)
    require(
        reduced == router_bytes,
        f"{what}: {reduced} bytes all-reduced, expected the router's gradients ({router_bytes} "
        "bytes): the experts' gradients need no all-reduce (they come back with the combine)",
    )
    moved = [e.nbytes for e in data if e.op == OpName.ALL_TO_ALL]
    if not moved and any(e.peer >= 0 for e in events):
        check_messages(case, out, kept, rank, rows)  # the student's own all-to-all of messages
        return
    count_bytes = sum(e.nbytes for e in collectives if is_count(e))
    limit = 2 * case.p * case.num_experts * 8
    require(
        count_bytes <= limit,
        f"{what}: {count_bytes} bytes of integers sent, more than two exchanges of every "
        f"rank's counts need ({limit})",
    )
    first_rows = next(
        (i for i, e in enumerate(events) if e.op == OpName.ALL_TO_ALL and not is_count(e)),
        len(events),
    )
    require(
        any(is_count(e) for e in events[:first_rows]),
        f"{what}: no exchange of integer counts before the first token rows: each rank must "
        "learn how many rows it will receive from the others before the dispatch",
    )
    sent, received = row_bytes(case, kept)
    expected = [sent[rank], received[rank], sent[rank], received[rank]]
    require(
        moved == expected,
        f"{what}: its all-to-alls of token rows carried {moved} bytes; expected {expected}: "
        f"the dispatch sends this rank's {sent[rank] // (D * 4)} kept pairs' rows, the combine "
        f"returns the {received[rank] // (D * 4)} rows its experts processed, and backward "
        "mirrors both (no padding, no dropped pair sent)",
    )
    check_pieces(case, data, kept, rank, rows)


def check_pieces(
    case: Case, data: list[Event], kept: Tensor, rank: int, rows: list[list[Tensor]]
) -> None:
    """What the rank's all-to-alls of token rows sent to each rank, and the rows they carried."""
    what = case.describe()
    n, row = case.num_experts // case.p, D * 4
    dispatch = [int(kept[rank, n * j : n * (j + 1)].sum()) * row for j in range(case.p)]
    combine = [int(kept[j, n * rank : n * (rank + 1)].sum()) * row for j in range(case.p)]
    pieces = [list(e.pieces) for e in data if e.op == OpName.ALL_TO_ALL]
    require(
        pieces == [dispatch, combine, dispatch, combine],
        f"{what}: its all-to-alls sent {pieces} bytes to ranks 0..{case.p - 1}; expected "
        f"{[dispatch, combine, dispatch, combine]}: to each rank exactly the rows routed to its "
        "experts, and the combine its mirror",
    )
    problem = rows_problem(case, [e for e in data if e.op == OpName.ALL_TO_ALL], rows)
    require(problem is None, f"{what}: {problem}")


def check_messages(
    case: Case, out: CallResult, kept: Tensor, rank: int, rows: list[list[Tensor]]
) -> None:
    """Rows exchanged by send/recv: to each peer exactly the rows the two owe each other,
    with room for the counts, and the values those rows must hold (``rows``: what this
    rank's all-to-alls must carry to each rank, :func:`rows_carried`)."""
    n, row = case.num_experts // case.p, D * 4
    for peer in range(case.p):
        if peer == rank:
            continue
        owed = int(
            kept[rank, n * peer : n * (peer + 1)].sum()
            + kept[peer, n * rank : n * (rank + 1)].sum()
        )
        sends = [e for e in out.traffic.per_rank[rank] if e.op == OpName.SEND and e.peer == peer]
        sent = sum(e.nbytes for e in sends)
        low, high = 2 * owed * row, 2 * owed * row + 2 * case.num_experts * 8
        require(
            low <= sent <= high,
            f"{case.describe()}: sent {sent} bytes to rank {peer}; the rows the two ranks' "
            f"tokens route to each other's experts, there and back, are {low} bytes",
        )
        problem = messages_problem([e for e in sends if not is_count(e)], rows, peer)
        require(problem is None, f"{case.describe()}: {problem}")


@pytest.mark.graded(target="expert_parallel.ExpertParallelMoE", kind="communication")
@pytest.mark.parametrize("capacity", ["capacity_factor=None", "capacity_factor=0.5"])
def test_communication(world: World, record: TestRecord, capacity: str) -> None:
    cf = None if capacity.endswith("None") else CAPACITY_FACTOR
    case = Case(world.size, 2 * world.size, 2, cf)
    out, seen, want = run_case(world, case)
    named = named_cause(lambda: check_case(case, seen, want))
    if named:  # the correctness tests deduct it; the exchange is judged on its own here
        record.details["values"] = f"wrong, for the cause the correctness tests name: {named}"
    sent, received = row_bytes(case, want.kept)
    record.details["dispatch_bytes_sent"] = sent
    record.details["dispatch_bytes_received"] = received
    router_bytes = (case.num_experts * D + case.num_experts) * 4
    rows = rows_carried(case, want)  # every rank's, once
    on_every_rank(case.p, lambda r: check_traffic(case, out, want, rows[r], r, router_bytes))
