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
- ``sharded_optimizer_state``: the bytes of optimizer state each rank holds, about 1/p of the
  unsharded optimizer's (see the test for which assignments of parameters pass).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

from grader.scenarios.data_parallel import (
    FIRST_GROUP,
    FIRST_SETTINGS,
    SHARDED,
    param_groups,
    state_bytes,
)
from grader.testkit import TestRecord, World, failures, generator
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


def call_sharded(
    world: World, name: str, inputs: Any, own_first: bool = False, split: int = FIRST_GROUP
) -> list[dict[str, Any]]:
    """Every rank's observations of the student's ShardedOptimizer stepping ``inputs``."""
    p, (initial, grads) = world.size, inputs
    return world.call(
        scenario="data_parallel.sharded",
        args=[(name, initial, grads, own_first, split)] * p,
        case=f"ShardedOptimizer({SHARDED[name][0].__name__}) on {p} ranks",
    ).returned


def check_steps(
    seen: list[dict[str, Any]],
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
        before = [s["params"][step - 2] if step > 1 else initial for s in seen]
        after = [s["params"][step - 1] for s in seen]
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
                    for k in (s["kept"][step - 1] for s in seen)
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


@pytest.mark.graded(target="data_parallel.ShardedOptimizer", kind="correctness")
def test_sharded_optimizer_state(world: World, record: TestRecord) -> None:
    """Each rank's AdamW state, about 1/p of the unsharded optimizer's, measured on its own.

    Which assignments of parameters to ranks pass, on purpose: any that balances them by
    count (no rank owns more than ceil(n/p) of the n parameters: round-robin, contiguous
    chunks) or by size (each parameter to the rank owning the fewest elements so far, in any
    order: at most 1/p of the state plus the largest parameter's, plus the scalar ``step``
    counters, which count parameters, not elements). The allowance is the larger of the two
    bounds, from the unsharded optimizer's own state; a rank holding more, such as one that
    keeps the whole state, fails. The bound is judged first, then the parameters (so that a
    falsified measurement cannot pass wrong code; wrong steps also explain state that is
    missing), and zero_grad() is left to the other tests.
    """
    inputs = sharded_inputs()
    seen = call_sharded(world, "adamw", inputs)
    oracle = torch.optim.AdamW(param_groups(inputs[0], {})[0], **SHARDED["adamw"][1])
    for q, g in zip(oracle.param_groups[0]["params"], inputs[1][0], strict=True):
        q.grad = g.clone()  # one step: the unsharded state's size, whatever its values
    oracle.step()
    p, per_param, n = world.size, state_bytes(oracle)[1:], len(SHAPES)
    total, per_rank = sum(per_param), [int(s["state_bytes"]) for s in seen]
    scalars = sum(t.nbytes for st in oracle.state.values() for t in st.values() if t.dim() == 0)
    by_count = sum(sorted(per_param, reverse=True)[: math.ceil(n / p)])
    by_size = math.ceil(total / p) + max(per_param) + scalars
    allowed = max(by_count, by_size)
    record.details.update(
        state_bytes_per_rank=per_rank,
        unsharded_state_bytes=total,
        allowed_bytes_per_rank=allowed,
        allowed_by_count=by_count,
        allowed_by_size=by_size,
    )
    what = f"ShardedOptimizer(AdamW) on {p} ranks"
    too_much = [
        f"it holds {mine} bytes of optimizer state, the unsharded AdamW {total}: each rank "
        f"should keep state only for its own shard, about 1/{p} (at most {allowed} bytes here: "
        f"ceil({n}/{p}) parameters' worth, or 1/{p} of the elements plus one parameter)"
        if mine > allowed
        else None
        for mine in per_rank
    ]
    blame(what, too_much)
    check_steps(seen, "adamw", inputs, zero_grad=False)  # wrong steps explain missing state
    if sum(per_rank) < total:
        raise AssertionError(
            f"{what}: found {sum(per_rank)} bytes of optimizer state over all ranks, the "
            f"unsharded AdamW holds {total}: keep the state in the .state of a torch.optim "
            "optimizer held as an attribute (e.g. self.local_optimizer)"
        )
