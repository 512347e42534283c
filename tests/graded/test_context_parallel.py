"""Graded tests of ``assignments/context_parallel.py``: ring attention and DeepSpeed-Ulysses.

The whole sequence's q, k, v (``[B, H, S, D]``) and the output's upstream gradient are
drawn here from the secret seed; rank r gets positions ``[r*S/p, (r+1)*S/p)`` of each, runs
the submission's function forward and backward (``grader/scenarios/context_parallel.py``)
and sends back its output block and dq, dk, dv, which are compared with one-process
attention over the whole sequence, in float64 (``grader.testkit.attention``), within the
rounding bound of the inputs' dtype:

- ``ring_attention``, ``ulysses_attention``: float32 and float64 inputs, causal and not,
  ``S = 8p``; blocks of one position (``S = p``); scores beyond 88 in float32, where an exp
  without the max shift overflows (the tolerance grows with the largest score).
- ``causality``: with keys and values changed at every position from t on (t inside a
  rank's block), the outputs and dq at the positions before t are bit-for-bit unchanged
  (and right: a constant output is causal too).
- ``ring_attention_communication``, ``ulysses_attention_communication``: the broker's record
  (the rules are in ``grader/testkit/ring.py``), after the results, which must be right as
  everywhere (a message pattern earns nothing with a wrong answer), or wrong only by a usual
  mistake that the correctness tests name and deduct (noted in the details); the ring's
  steps, forward and backward, go to ``record.ring``, which the report draws where it is
  wrong.

A wrong value is explained where a usual mistake accounts for it: the causal mask applied to
every block, the future blocks computed, the ring turning the wrong way, blocks merged
without rescaling, the dK/dV partials never sent home or a hop short (another rank's dk),
positions interleaved by Ulysses, an exp that overflowed, NaN in rows left with no key.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from grader.testkit import (
    CallResult,
    Gate,
    TestOptions,
    TestRecord,
    World,
    check_close,
    check_informed,
    on_every_rank,
    rank_tensor,
    require,
)
from grader.testkit.attention import Attention, Observed, attention, causal_mask, observations
from grader.testkit.compare import WrongResult, named_cause, peer_bounds
from grader.testkit.patterns import Expected, Region
from grader.testkit.ring import ring_messages, ring_steps, ulysses_messages

B, H, D = 2, 12, 4  # H divisible by 1, 2, 3 and 4: Ulysses splits the heads
FUNCTIONS = ["ring_attention", "ulysses_attention"]
NAMES = ("output", "dq", "dk", "dv")
# Where exp(score) overflows: the log of the dtype's largest value (88.7 for float32).
EXP_LIMIT = {dtype: math.log(torch.finfo(dtype).max) for dtype in (torch.float32, torch.float64)}
OVERFLOW = (
    "the scores reach {:.0f}, and exp overflows beyond 88 in float32 (709 in float64): "
    "subtract the row's running maximum before exp"
)


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    causal: bool
    per_rank: int = 8  # positions per rank: S = per_rank * p
    spread: float = 1.0  # scale of q and k: 8 puts the largest scores beyond 200


CASES = {
    "float32": Case(torch.float32, False),
    "float32-causal": Case(torch.float32, True),
    "float64": Case(torch.float64, False),
    "float64-causal": Case(torch.float64, True),
    "one-position-blocks-causal": Case(torch.float32, True, per_rank=1),
    "scores-beyond-88": Case(torch.float32, False, spread=8.0),
}


@dataclass
class Run:
    """One call on every rank and what the trusted side knows of it."""

    p: int
    n: int  # positions per rank
    case: Case
    full: dict[str, Tensor]  # q, k, v, grad over the whole sequence, in the case's dtype
    out: CallResult
    seen: list[Observed]  # every rank's return, read and checked
    oracle: Attention

    def block(self, r: int) -> slice:
        return slice(r * self.n, (r + 1) * self.n)


def draw(key: str, p: int, case: Case) -> dict[str, Tensor]:
    s = case.per_rank * p
    full = {
        name: rank_tensor(f"cp/{key}/{p}/{name}", 0, (B, H, s, D), torch.float64)
        for name in ("q", "k", "v", "grad")
    }
    full["q"], full["k"] = full["q"] * case.spread, full["k"] * case.spread
    return {name: t.to(case.dtype) for name, t in full.items()}


def run(world: World, function: str, case: Case, key: str, full: dict | None = None) -> Run:
    p, n = world.size, case.per_rank
    full = full if full is not None else draw(key, p, case)

    def mine(name: str, r: int) -> Tensor:
        return full[name][:, :, r * n : (r + 1) * n].contiguous()

    args = [(function, mine("q", r), mine("k", r), mine("v", r), case.causal) for r in range(p)]
    # The output's gradient is handed over at the gate "backward", after the forward.
    gates = [[Gate.handing("backward", mine("grad", r))] for r in range(p)]
    out = world.call(scenario="context_parallel.attention", args=args, case=key, gates=gates)
    oracle = attention(full["q"], full["k"], full["v"], full["grad"], case.causal)
    return Run(p, n, case, full, out, observations(out.returned, key), oracle)


def mistakes(run: Run, function: str, r: int) -> dict[str, dict[str, Tensor]]:
    """What each result of rank r would be after a usual mistake, by the hint."""
    p, n, full, here = run.p, run.n, run.full, run.block(r)
    why: dict[str, dict[str, Tensor]] = {name: {} for name in NAMES}
    if run.case.causal and p > 1:
        for allowed, hint in masks(p, n, function):
            wrong = attention(full["q"], full["k"], full["v"], full["grad"], True, allowed)
            for name in NAMES:
                why[name][hint] = wrong.result(name)[:, :, here]
    if p > 1 and function == "ring_attention":
        why["output"][NO_RESCALE] = blocks_summed(run)[:, :, here]
        own = torch.zeros_like(full["grad"])
        own[:, :, here] = full["grad"][:, :, here]
        alone = attention(full["q"], full["k"], full["v"], own, run.case.causal)
        for name in ("dk", "dv"):
            why[name][
                "only this rank's own queries' share: the dK/dV partials that the other ranks "
                "computed for this block never came back; they travel with the block and make "
                "one more hop home after the last step"
            ] = alone.result(name)[:, :, here]
    return why


def blocks_summed(run: Run) -> Tensor:
    """The output if each block's attention, normalised on its own, were added as it is."""
    q, k, v = (run.full[name].double() for name in ("q", "k", "v"))
    s = q.size(2)
    scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
    seen = causal_mask(s) if run.case.causal else torch.ones(s, s, dtype=torch.bool)
    keys = torch.arange(s) // run.n
    out = torch.zeros_like(q)
    for b in range(run.p):
        weights = torch.softmax(scores.masked_fill(~(seen & (keys == b)), -math.inf), dim=-1)
        out += weights.nan_to_num(0.0) @ v  # a block wholly in the future: skipped
    return out


def masks(p: int, n: int, function: str) -> list[tuple[Tensor, str]]:
    """The causal masks of the usual wrong rules (True: the query sees the key), by the hint."""
    s = p * n
    blocks, local = torch.arange(s) // n, torch.arange(s) % n
    same, before = blocks[:, None] == blocks[None, :], blocks[:, None] > blocks[None, :]
    triangle = local[:, None] >= local[None, :]
    if function == "ulysses_attention":  # attention position of true position j*n + i
        order = (torch.arange(s) % n) * p + blocks
        return [(order[:, None] >= order[None, :], INTERLEAVED)]
    # The ring the other way: at step t rank r holds block r+t, taken for block r-t's.
    taken = (2 * blocks[:, None] - blocks[None, :]) % p
    backwards = (taken < blocks[:, None]) | (same & triangle)
    found = [
        (
            (before | same) & triangle,
            "the triangular mask was applied to every block: only the diagonal block "
            "(the rank's own keys) is masked, earlier blocks count whole",
        ),
        (
            ~same | triangle,
            "the later ranks' blocks were computed: in causal attention their keys "
            "are all in the future; skip them (and pass them on)",
        ),
    ]
    if p > 2:
        found.append((backwards, WRONG_WAY))
    return found


INTERLEAVED = (
    "the positions are interleaved: the pieces that the all-to-all brought were put "
    "together position by position (rank 0's first, rank 1's first, ...), not rank by rank, "
    "so the causal mask sees them out of order; concatenate the pieces along the sequence"
)
WRONG_WAY = (
    "the ring turns the wrong way: the blocks came from rank r+1 and went to r-1, so the "
    "block held at step s was rank r+s's, computed by the rule for rank r-s's; send to "
    "r+1 and receive from r-1"
)
NO_GRAD_FN = {
    "ring_attention": "ring_attention's output has no grad_fn, so no gradient reaches q, k, "
    "v: send and recv are not differentiable; write ring attention as a "
    "torch.autograd.Function whose backward passes K/V and dK/dV around the ring",
    "ulysses_attention": "ulysses_attention's output has no grad_fn, so no gradient reaches "
    "q, k, v: dist.all_to_all has no backward; wrap each all-to-all in a "
    "torch.autograd.Function whose backward is the all-to-all the other way (heads to "
    "sequence for sequence to heads, and back)",
}
HOP_HOME = (
    "the dK/dV of the block this rank held at the last step, which belongs to rank r+1: the "
    "partials travel with their block, and one more hop after the last step brings them home"
)
NO_KEY = (
    "NaN in exactly the rows of the queries left with no key to attend to (the softmax of a "
    "row of -inf is 0/0): the causal mask hides the keys after the query, not its own; mask "
    "triu(1), keeping the diagonal"
)
NO_RESCALE = (
    "each block's output, normalised by its own sum of exps, was added as it is: right only "
    "where a query row merges one block; in the merge rescale the running output and the "
    "block's by exp(lse - new_lse) and exp(block_lse - new_lse)"
)


def check_results(run: Run, function: str, what: str) -> None:
    """The output on every rank first, then dq, dk, dv: the forward's mistake is named first."""
    why = [mistakes(run, function, r) for r in range(run.p)]

    def returned(r: int) -> None:
        seen = run.seen[r]
        require(
            seen.output is not None,
            f"{what}: {function} returned a {seen.output_type}, not a tensor",
        )

    on_every_rank(run.p, returned)
    for name in NAMES:
        on_every_rank(run.p, lambda r, name=name: check(run, function, why[r], r, name, what))
    for r in range(run.p):  # its block of the output depends on other ranks' keys and values
        if run.p > 1 and (r > 0 or not run.case.causal):
            output = run.seen[r].output
            assert output is not None  # checked above
            check_informed(run.out, r, output.numel() * output.element_size(), what)


def check(
    run: Run, function: str, why: dict[str, dict[str, Tensor]], r: int, name: str, what: str
) -> None:
    oracle, dtype = run.oracle, run.case.dtype
    got, here = run.seen[r].result(name), run.block(r)
    if got is None and not run.seen[r].differentiable:
        require(False, f"{what}: {name} is missing: {NO_GRAD_FN[function]}")
    require(got is not None, f"{what}: {name} is missing (.grad is None)")
    want = oracle.result(name)[:, :, here].to(dtype)
    explanations = {hint: t.to(dtype) for hint, t in why[name].items()}
    overflows = oracle.row_max[:, :, here] > EXP_LIMIT[dtype]
    if bool(overflows.any()):
        if got.dtype.is_floating_point and not bool(got.isfinite().all()):
            require(False, f"{what}: {name} holds inf or NaN: {OVERFLOW.format(oracle.max_score)}")
        if name == "output":  # wrong only in the rows whose scores pass exp's limit
            explanations[OVERFLOW.format(oracle.max_score)] = torch.where(overflows, got, want)
    check_close(
        got,
        want,
        f"{what}: {name}",
        magnitude=oracle.magnitudes[name][:, :, here],
        terms=oracle.terms,
        explanations=explanations,
        context=expected(run, r, name),
    )


def expected(run: Run, r: int, name: str) -> Expected:
    """Every rank's expected value and the regions a usual mistake touches, for rank r."""
    n, causal = run.n, run.case.causal
    peers = [run.oracle.result(name)[:, :, run.block(j)] for j in range(run.p)]
    magnitudes = [run.oracle.magnitudes[name][:, :, run.block(j)] for j in range(run.p)]
    bounds = peer_bounds(run.case.dtype, magnitudes, run.oracle.terms)
    first = (torch.arange(n) == 0)[:, None]  # [n, 1]: rows of the block, broadcast over D
    regions = [Region(first, NO_KEY, nan=True, rows_dim=2)] if causal else []
    words = {1: HOP_HOME} if name in ("dk", "dv") else {}
    return Expected(rank=r, peers=peers, bounds=bounds, neighbours=words, regions=regions)


def describe(function: str, key: str, p: int) -> str:
    return f"{function} ({key}) on {p} rank{'s' * (p > 1)}"


@pytest.mark.graded(target="context_parallel.{function}", kind="correctness")
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("function", FUNCTIONS)
def test_attention(world: World, record: TestRecord, function: str, case: str) -> None:
    result = run(world, function, CASES[case], case)
    if function == "ring_attention":
        record.ring = ring_steps(result.out.traffic, result.full, result.n, result.case.causal)
    check_results(result, function, describe(function, case, world.size))


ADVICE = {
    "ring_attention": "skip the later blocks and mask the diagonal one",
    "ulysses_attention": "mask the whole sequence's scores once, with its positions in order "
    "(rank 0's block first)",
}


def same(x: Tensor, y: Tensor) -> bool:
    """Equal to the bit, a NaN where the other has one: unchanged, however wrong."""
    return bool(((x == y) | (x.isnan() & y.isnan())).all())


@pytest.mark.graded(target="context_parallel.{function}", kind="correctness")
@pytest.mark.parametrize("function", FUNCTIONS)
def test_causality(world: World, function: str) -> None:
    """Later keys and values change; earlier outputs and their dq must not, to the bit."""
    p, case = world.size, Case(torch.float32, True)
    n, what = case.per_rank, describe(function, "causality probe", p)
    first = draw("probe", p, case)
    t = (p // 2) * n + n // 2  # inside a rank's block: the diagonal mask matters
    changed = dict(first)
    for name in ("k", "v"):
        later = rank_tensor(f"cp/probe/{p}/{name}/later", 0, first[name].shape, case.dtype)
        changed[name] = torch.cat([first[name][:, :, :t], later[:, :, t:]], dim=2)
    a = run(world, function, case, "probe", first)
    b = run(world, function, case, "probe, later keys changed", changed)
    wrong: WrongResult | None = None  # a constant output is causal too: no points for it
    try:
        check_results(a, function, what)
    except WrongResult as err:
        wrong = err
    # Where the results name a usual mistake, it is the leak's cause too.
    advice = f"here: {wrong.reason}" if wrong and wrong.reason else ADVICE[function]

    def check(r: int) -> None:
        here = range(r * n, min((r + 1) * n, t))
        for name in ("output", "dq"):
            x, y = a.seen[r].result(name), b.seen[r].result(name)
            require(x is not None and y is not None, f"{what}: {name} is missing")
            for i in here:
                local = i - r * n
                require(
                    same(x[:, :, local], y[:, :, local]),
                    f"{what}: changing the keys and values at positions {t} and later changed "
                    f"{name} at position {i} (rank {r}'s position {local}): in causal attention "
                    f"a query sees no key after it; {advice}",
                )

    on_every_rank(p, check)
    if wrong is not None:
        raise wrong


def values_named(record: TestRecord, check: Callable[[], None]) -> None:
    """The results, as everywhere, but a wrong one whose cause a correctness test names is
    that test's deduction: the messages are judged on their own, and the cause noted."""
    named = named_cause(check)
    if named:
        record.details["values"] = f"wrong, for the cause the correctness tests name: {named}"


@pytest.mark.graded(target="context_parallel.ring_attention", kind="communication")
def test_ring_attention_communication(
    world: World, record: TestRecord, options: TestOptions
) -> None:
    case = Case(torch.float32, True)
    result = run(world, "ring_attention", case, "ring messages")
    traffic, p = result.out.traffic, world.size
    record.ring = ring_steps(traffic, result.full, result.n, case.causal)
    what = describe("ring_attention", "ring messages", p)
    values_named(record, lambda: check_results(result, "ring_attention", what))
    ratio = options.need("backward_bytes_ratio")
    problems, figures = ring_messages(traffic, result.full, result.n, ratio)
    record.details.update(figures)

    def check(r: int) -> None:
        require(problems[r] is None, f"ring_attention on {p} ranks: {problems[r]}")

    on_every_rank(p, check)


@pytest.mark.graded(target="context_parallel.ulysses_attention", kind="communication")
def test_ulysses_attention_communication(world: World, record: TestRecord) -> None:
    case = Case(torch.float32, False)
    result = run(world, "ulysses_attention", case, "ulysses messages")
    p = world.size
    what = describe("ulysses_attention", "messages", p)
    values_named(record, lambda: check_results(result, "ulysses_attention", what))
    problems, figures = ulysses_messages(result.out.traffic, result.full, result.n)
    record.details.update(figures)

    def check(r: int) -> None:
        require(problems[r] is None, f"ulysses_attention on {p} ranks: {problems[r]}")

    on_every_rank(p, check)
