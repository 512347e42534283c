"""Graded tests of ``ShardedOptimizer`` (ZeRO-1) in ``assignments/data_parallel.py``.

The ranks run :func:`grader.scenarios.data_parallel.sharded` on parameters and gradients made
here from a secret seed (the same gradients on every rank, as after DDP); the oracle is the
unsharded optimizer stepping the same parameters here, in float64.

- ``sharded_optimizer``: ZeRO-1 against the unsharded optimizer (SGD with momentum, AdamW):
  7 parameters (p divides none of 2, 3, 4) in two groups, the second added with
  ``add_param_group`` and with its own settings; a step where one parameter has no gradient;
  ``zero_grad`` between steps must clear every parameter's gradient.
- ``sharded_optimizer_first_group``: the same, with the first group (the one given to the
  constructor) holding its own settings too: stepping it with the optimizer's defaults fails.
- ``sharded_optimizer_no_owner``: 3 parameters on 4 ranks, so rank 3 owns none: it must still
  build its optimizer, step and take part in every broadcast, without crashing.
- ``sharded_optimizer_state``: each rank owns about 1/p of the state: the owners are read from
  the broker's record (who sent each updated value), and a second call gives each rank the
  true gradient only of what it owns (see the test for which assignments pass); a third call,
  on 8 parameters of 4 MiB, has the broker read each rank's resident memory from the kernel
  around every step: AdamW's state for more than about 1/p of them fails
  (:mod:`grader.testkit.resident`).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

from grader.scenarios.data_parallel import FIRST_GROUP, FIRST_SETTINGS, SHARDED, param_groups
from grader.testkit import CallResult, TestRecord, World, failures, generator, resident, zero
from grader.testkit.compare import on_every_rank, require
from grader.testkit.explain import blame, close, difference

SHAPES = [(4, 8), (8,), (6, 8), (20,), (6, 6), (24,), (5, 8)]  # 7 parameters, uneven sizes
FEW_SHAPES, FEW_SPLIT = [(4, 8), (8,), (6, 8)], 2  # fewer parameters than 4 ranks
SHARDED_STEPS = 4
NO_GRAD = (2, 3)  # (step, parameter): the one gradient that is None


def sharded_inputs(
    shapes: list[tuple[int, ...]] = SHAPES,
) -> tuple[list[Tensor], list[list[Tensor | None]]]:
    """The parameters, and each step's gradients (the same on every rank, as after DDP)."""
    gen = generator(f"data_parallel/sharded/params{len(shapes)}")
    initial = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads: list[list[Tensor | None]] = []
    for step in range(1, SHARDED_STEPS + 1):
        gen = generator(f"data_parallel/sharded/grads{step}")
        row = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        grads.append([None if (step, i) == NO_GRAD else g for i, g in enumerate(row)])
    return initial, grads


def shard_problem(
    got: list[Any],
    before: list[Any],
    want: list[Tensor],
    split: int,
    nowhere: set[int],
    hints: tuple[list[Tensor], list[str]],
) -> str | None:
    """The first of a rank's parameters that differs from the unsharded optimizer's, and why.

    ``nowhere``: the parameters no rank updated (their owner never stepped them); ``hints``:
    the parameters after steps with the optimizer's defaults in every group, and for each
    parameter the settings of its group that such steps ignore.
    """
    i = next((i for i, w in enumerate(want) if not close(got[i], w)), None)
    if i is None:
        return None
    group = int(i >= split)
    hint = ""
    if i in nowhere and group == 1:
        hint = (
            ": it was not updated on any rank: add_param_group must assign the new group's "
            "parameters to owners and add them, with the group's settings, to the optimizer "
            "that steps them (e.g. local_optimizer.add_param_group)"
        )
    elif i in nowhere:
        hint = ": it was not updated on any rank: step() must step each parameter on its owner"
    elif isinstance(got[i], Tensor) and torch.equal(got[i], before[i]):
        hint = ": it was not updated on this rank (broadcast it from its owner)"
    elif hints[1][i] and close(got[i], hints[0][i].detach()):
        hint = hints[1][i]
    return f"parameter {i} (group {group}) {difference(got[i], want[i])}{hint}"


def unchanged(i: int, after: list[list[Any]], before: list[list[Any]]) -> list[bool]:
    """Per rank: parameter ``i`` is exactly what it was before the step."""
    return [
        isinstance(a[i], Tensor) and torch.equal(a[i], b[i])
        for a, b in zip(after, before, strict=True)
    ]


def sharded_call(
    world: World,
    name: str,
    initial: list[Tensor],
    grads: list[list[list[Tensor | None]]],
    own_first: bool = False,
    split: int = FIRST_GROUP,
) -> CallResult:
    """The student's ShardedOptimizer stepping ``initial``, rank r with gradients ``grads[r]``."""
    return world.call(
        scenario="data_parallel.sharded",
        args=[(name, initial, mine, own_first, split) for mine in grads],
        case=case_of(name, world.size),
    )


def case_of(name: str, p: int) -> str:
    return f"ShardedOptimizer({SHARDED[name][0].__name__}) on {p} ranks"


def observed(out: CallResult, name: str, initial: list[Tensor]) -> list[zero.Stepped]:
    """Every rank's record of ``out``, a call of :func:`sharded_call` stepping ``initial``."""
    case = case_of(name, len(out.returned))
    return zero.stepped(out.returned, SHARDED_STEPS, len(initial), case)


def call_sharded(
    world: World, name: str, inputs: Any, own_first: bool = False, split: int = FIRST_GROUP
) -> list[zero.Stepped]:
    """Every rank's observations of the student's ShardedOptimizer stepping ``inputs``."""
    initial, grads = inputs
    out = sharded_call(world, name, initial, [grads] * world.size, own_first, split)
    return observed(out, name, initial)


def check_steps(
    seen: list[zero.Stepped],
    name: str,
    inputs: Any,
    own_first: bool = False,
    split: int = FIRST_GROUP,
    zero_grad: bool = True,
) -> torch.optim.Optimizer:
    """Every rank's parameters after each step against the unsharded optimizer's, and (if
    ``zero_grad``) the gradients after each ``zero_grad()``; the unsharded optimizer returned."""
    cls, kwargs, second = SHARDED[name]
    p, (initial, grads) = len(seen), inputs
    what = f"ShardedOptimizer({cls.__name__}) on {p} ranks"
    first = FIRST_SETTINGS[name] if own_first else None
    (theirs, full), (defaults, plain) = (
        param_groups(initial, second, first, split),
        param_groups(initial, {}, None, split),
    )
    oracle, ignoring = cls(full, **kwargs), cls(plain, **kwargs)  # ignoring: groups' settings
    ignored = [f": updated with {kwargs}, not its param group's own {first}" if first else ""]
    ignored.append(f": updated with {kwargs}, not its param group's own {second}")
    hints = (defaults, [ignored[int(i >= split)] for i in range(len(initial))])
    for step in range(1, SHARDED_STEPS + 1):
        for q, g in zip(theirs + defaults, grads[step - 1] * 2, strict=True):
            q.grad = None if g is None else g.clone()
        oracle.step()
        ignoring.step()
        want = [q.detach() for q in theirs]
        before = [s.params[step - 2] if step > 1 else initial for s in seen]
        after = [s.params[step - 1] for s in seen]
        nowhere = {i for i in range(len(want)) if all(unchanged(i, after, before))}
        blame(
            f"{what}: after step {step}",
            [shard_problem(after[r], before[r], want, split, nowhere, hints) for r in range(p)],
        )
        if zero_grad:
            blame(
                f"{what}: after zero_grad()",
                [
                    k
                    and f"parameter {k[0]} still has a gradient: zero_grad() must clear every "
                    "parameter's gradient, not only this rank's shard"
                    for k in (s.kept[step - 1] for s in seen)
                ],
            )
        oracle.zero_grad()
        ignoring.zero_grad()
    return oracle


@pytest.mark.graded(target="data_parallel.ShardedOptimizer", kind="correctness")
@pytest.mark.parametrize("optimizer", list(SHARDED))
def test_sharded_optimizer(world: World, optimizer: str) -> None:
    inputs = sharded_inputs()
    check_steps(call_sharded(world, optimizer, inputs), optimizer, inputs)


@pytest.mark.graded(target="data_parallel.ShardedOptimizer", kind="correctness")
@pytest.mark.parametrize("optimizer", list(SHARDED))
def test_sharded_optimizer_first_group(world: World, optimizer: str) -> None:
    """The constructor's param group has settings of its own (``FIRST_SETTINGS``): a solution
    that builds its local optimizer from bare tensors steps it with the defaults and fails."""
    inputs = sharded_inputs()
    seen = call_sharded(world, optimizer, inputs, own_first=True)
    check_steps(seen, optimizer, inputs, own_first=True)


@pytest.mark.graded(target="data_parallel.ShardedOptimizer", kind="correctness")
@pytest.mark.parametrize("optimizer", list(SHARDED))
def test_sharded_optimizer_no_owner(world: World, optimizer: str) -> None:
    """More ranks than parameters (run at p = 4 only): some rank owns nothing, and must still
    build its optimizer (a param group with an empty ``params`` list is allowed), step and
    take part in every broadcast."""
    inputs, n = sharded_inputs(FEW_SHAPES), len(FEW_SHAPES)
    try:
        seen = call_sharded(world, optimizer, inputs, split=FEW_SPLIT)
    except failures.RankFailure as err:
        if isinstance(err, failures.NotImplementedYet):
            raise
        raise err.with_hint(
            f"{n} parameters on {world.size} ranks: some rank owns none of a param "
            "group's parameters, or none at all, and must still build its optimizer (a param "
            "group with an empty params list is allowed), step it and take part in every "
            "broadcast"
        ) from err
    check_steps(seen, optimizer, inputs, split=FEW_SPLIT)


def updates(name: str, inputs: Any) -> list[list[Tensor]]:
    """The unsharded optimizer's parameters after each step."""
    cls, kwargs, second = SHARDED[name]
    params, groups = param_groups(inputs[0], second)
    oracle, out = cls(groups, **kwargs), []
    for row in inputs[1]:
        for q, g in zip(params, row, strict=True):
            q.grad = None if g is None else g.clone()
        oracle.step()
        out.append([q.detach().clone() for q in params])
    return out


def unsharded_state(inputs: Any) -> tuple[list[int], list[int]]:
    """Per parameter, the bytes of the unsharded AdamW's state (after one step: its size,
    whatever its values), and of its scalars (``step``) among them."""
    params = param_groups(inputs[0], {})[0]
    oracle = torch.optim.AdamW(params, **SHARDED["adamw"][1])
    for q, g in zip(params, inputs[1][0], strict=True):
        q.grad = g.clone()
    oracle.step()
    states = [list(oracle.state[q].values()) for q in params]
    return [sum(t.nbytes for t in st) for st in states], [
        sum(t.nbytes for t in st if t.dim() == 0) for st in states
    ]


def allowance(per_param: list[int], scalars: list[int], p: int) -> dict[str, int]:
    """The state a rank's owned elements may need: the larger of ceil(n/p) parameters' worth
    (balanced by count) and 1/p of the elements plus the largest parameter and the scalars
    (balanced by size)."""
    by_count = sum(sorted(per_param, reverse=True)[: math.ceil(len(per_param) / p)])
    by_size = math.ceil(sum(per_param) / p) + max(per_param) + sum(scalars)
    return {"allowed_by_count": by_count, "allowed_by_size": by_size}


def received_limit(initial: list[Tensor], p: int, mine: list[int]) -> int:
    """What a rank may be handed in the owners-only call: at every step the updates of the
    elements it does not own (``mine``: how many of each parameter's it owns), plus padding to
    a multiple of p per parameter and a few bytes per step. What the broker counts as handed
    to a rank leaves out its own bytes handed back (a broadcast root's tensor, a group of
    one's whole result): only what other ranks sent it."""
    others = sum(t.nbytes - n * t.element_size() for t, n in zip(initial, mine, strict=True))
    return SHARDED_STEPS * (others + p * len(initial) * 8 + 64)


OWNED_ONLY = (
    "in this call each rank was given the true gradient only of what it owns (as its "
    "messages in the first call showed) and random ones elsewhere: a rank must take the "
    "parameters it does not own from their owners, not step them itself"
)


@pytest.mark.graded(target="data_parallel.ShardedOptimizer", kind="correctness")
def test_sharded_optimizer_state(world: World, record: TestRecord) -> None:
    """Each rank owns about 1/p of the AdamW state, as the broker saw it, in two calls.

    The first call (the same gradients everywhere) must step right; the owner of each
    parameter element is the rank that sent its updated value (the root of a broadcast, or its
    piece of an all-gather, matched by content with the unsharded optimizer's). The owners'
    loads must balance: by count (no rank owns more than ceil(n/p) of the n parameters:
    round-robin, contiguous chunks) or by size (each to the least loaded rank, in any order:
    at most 1/p of the state plus the largest parameter's, plus the ``step`` counters). In the
    second call each rank gets the true gradient only of what it owns, random ones elsewhere:
    the parameters must still come out right, from the same owners, and no rank may be handed
    more than the parameters' updates. A rank then has the true gradients of its own elements
    only: whatever state it keeps of the others, it could not have computed it.
    """
    inputs, p = sharded_inputs(), world.size
    what = f"ShardedOptimizer(AdamW) on {p} ranks"
    first = sharded_call(world, "adamw", inputs[0], [inputs[1]] * p)
    check_steps(observed(first, "adamw", inputs[0]), "adamw", inputs, zero_grad=False)
    updated = updates("adamw", inputs)
    owned, problem = zero.owners(first.traffic, updated)
    if owned is None:
        raise AssertionError(f"{what}: {problem}")
    per_param, scalars = unsharded_state(inputs)
    bounds = allowance(per_param, scalars, p)
    allowed, load = max(bounds.values()), zero.loads(owned, p, per_param, scalars)
    total = sum(per_param)
    record.details.update(
        owned_state_bytes_per_rank=load,
        owned_elements_per_rank=[sum(c) for c in owned.counts(p)],
        unsharded_state_bytes=total,
        allowed_bytes_per_rank=allowed,
        **bounds,
    )
    blame(
        what,
        [
            f"it owns (sends the updates of) {mine} bytes' worth of optimizer state, the "
            f"unsharded AdamW {total}: each rank should own about 1/{p} of the parameters (at "
            f"most {allowed} bytes here: ceil({len(per_param)}/{p}) parameters' worth, or "
            f"1/{p} of the elements plus one parameter)"
            if mine > allowed
            else None
            for mine in load
        ],
    )
    check_owners_only(world, inputs, owned, updated, record)
    check_resident(world, record)


def check_resident(world: World, record: TestRecord) -> None:
    """A third call, on a larger model: the kernel's count of each rank's memory never shows
    AdamW's state for more than about 1/p of the parameters (:mod:`grader.testkit.resident`)."""
    p, sizes = world.size, (resident.WIDTH, resident.DEPTH, resident.STEPS)
    held = world.call(
        scenario="data_parallel.hold_state",
        args=[sizes] * p,
        case=f"ShardedOptimizer(AdamW) on {resident.MODEL}",
        gates=[resident.gates(p, r, ("grads", "stepped", "rest"), False) for r in range(p)],
        keep_payloads=False,
    )
    promise = resident.zero(p)

    def check(r: int) -> None:
        passes = held.traffic.gates[r]
        record.details[f"resident rank {r}"] = {g.label: g.resident for g in passes if g.resident}
        problem = resident.broken(passes, promise)
        require(problem is None, f"ShardedOptimizer(AdamW) on {resident.MODEL}: {problem}")

    on_every_rank(p, check)


def check_owners_only(
    world: World, inputs: Any, owned: zero.Owners, updated: list[list[Tensor]], record: TestRecord
) -> None:
    """The second call: rank r has the true gradient only where it owns the parameters. They
    must come out right, updated by the same owners, and no rank handed more than the
    parameters' updates."""
    p, what = world.size, f"ShardedOptimizer(AdamW) on {world.size} ranks"
    grads = [
        zero.owned_grads(inputs[1], owned, r, "data_parallel/sharded/unowned") for r in range(p)
    ]
    second = sharded_call(world, "adamw", inputs[0], grads)
    try:
        check_steps(observed(second, "adamw", inputs[0]), "adamw", inputs, zero_grad=False)
    except AssertionError as err:
        raise AssertionError(f"{err} ({OWNED_ONLY})") from None
    again, problem = zero.owners(second.traffic, updated)
    if again is None:
        raise AssertionError(f"{what}: with gradients true only where a rank owns them, {problem}")
    if any(not torch.equal(a, b) for a, b in zip(again.of, owned.of, strict=True)):
        raise AssertionError(
            f"{what}: with gradients true only where a rank owns them, other ranks sent the "
            "updates than in the first call: each parameter's owner must follow from the order "
            "parameters are added, the same in every call"
        )
    limits = [received_limit(inputs[0], p, row) for row in owned.counts(p)]
    got = second.traffic.delivered
    record.details.update(received_bytes_per_rank=list(got), received_limit=limits)
    blame(
        what,
        [
            f"it was handed {mine} bytes in {SHARDED_STEPS} steps of the second call, more "
            f"than the updates of the parameters it does not own take (at most {limit} here): "
            "a rank that also gets the others' gradients can keep their optimizer state, "
            "which ZeRO-1 leaves to their owners"
            if mine > limit
            else None
            for mine, limit in zip(got, limits, strict=True)
        ],
    )
