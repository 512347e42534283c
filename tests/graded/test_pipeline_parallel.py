"""Graded tests of ``assignments/pipeline_parallel.py``: GPipe and 1F1B, gradients and order.

Every rank builds the same ``p``-stage model from a fixed seed (one ``Linear`` + ``Tanh``
per stage, all of one width; MSE loss after the last) and trains its own stage with the
submission's schedule, with fewer microbatches than stages (``m<p``), as many (``m=p``) and
more (``m>p``: ``2p + 1``).

- Correctness: the returned loss (the mean over microbatches on the last stage, ``None``
  elsewhere) and every parameter's gradient must equal those of the mean loss over the full
  batch, computed in float64 on one process. A wrong gradient is explained by the usual
  mistakes: a loss not scaled by ``1/m``, a microbatch never backpropagated, a gradient that
  never came back from the next stage.
- Schedule: correct gradients do not show the order of work, and the order is what 1F1B is
  for (at most ``p - r`` microbatches' activations alive on stage ``r``). A wrapper around
  the stage records ``F{i}`` when its ``i``-th forward runs and ``B{i}`` when the gradient
  of its ``i``-th output is computed. GPipe runs every forward before any backward; 1F1B
  runs ``min(p - r - 1, m)`` warm-up forwards, then one forward and one backward in turn,
  then the remaining backwards. Every rank's order and the expected ones go to ``extra``
  (``per_rank[r]["timeline"]``, ``expected_timeline``), which the report draws.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from grader.rank.context import TestContext
from grader.rank.p2p import PeerGone
from grader.testkit import check_unchanged

WIDTH = 6  # features of every activation
ROWS = 2  # rows per microbatch
REGIMES = ("m<p", "m=p", "m>p")


def microbatches(regime: str, p: int) -> int:
    return {"m<p": max(1, p - 1), "m=p": p, "m>p": 2 * p + 1}[regime]


def build_stages(p: int) -> list[nn.Sequential]:
    """The same ``p`` stages on every rank; Tanh stays away from saturation at this scale."""
    generator = torch.Generator().manual_seed(20240 + p)
    stages = []
    for _ in range(p):
        linear = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(WIDTH, WIDTH, generator=generator) * WIDTH**-0.5)
            linear.bias.copy_(torch.randn(WIDTH, generator=generator) * 0.5)
        stages.append(nn.Sequential(linear, nn.Tanh()))
    return stages


def batch(p: int, m: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1000 * p + m)
    inputs = torch.randn(m * ROWS, WIDTH, generator=generator)
    return inputs, torch.randn(m * ROWS, WIDTH, generator=generator)


def run_step(step: Callable, stage: nn.Module, rank: int, p: int, m: int) -> object:
    """Call the submission's schedule as the contract says: inputs on stage 0, targets on p-1."""
    inputs, targets = batch(p, m)
    given = (inputs.clone() if rank == 0 else None, targets.clone() if rank == p - 1 else None)
    result = step(stage, *given, F.mse_loss, m, (ROWS, WIDTH))
    for name, mine, original in zip(("inputs", "targets"), given, (inputs, targets), strict=True):
        if mine is not None:
            check_unchanged(mine, original, f"{name} (an argument, not an output)")
    return result


def expected_shares(p: int, m: int, rank: int) -> tuple[list[float], dict[str, list[Tensor]]]:
    """Each microbatch's loss, and its share (loss / m) of each of stage ``rank``'s gradients."""
    stages = [stage.double() for stage in build_stages(p)]
    model = nn.Sequential(*stages)
    inputs, targets = batch(p, m)
    losses: list[float] = []
    shares: dict[str, list[Tensor]] = {name: [] for name, _ in stages[rank].named_parameters()}
    for x, y in zip(inputs.double().tensor_split(m), targets.double().tensor_split(m), strict=True):
        model.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        (loss / m).backward()
        losses.append(loss.item())
        for name, param in stages[rank].named_parameters():
            shares[name].append(param.grad.clone())
    return losses, shares


def check_loss(returned: object, rank: int, p: int, losses: list[float], what: str) -> None:
    kind = "None" if returned is None else type(returned).__name__
    if rank != p - 1:
        assert returned is None, (
            f"{what}: stage {rank} returned {kind}: only the last stage (rank {p - 1}) returns "
            f"the loss, the others return None"
        )
        return
    assert isinstance(returned, Tensor) and returned.numel() == 1, (
        f"{what}: the last stage returned {kind}, expected the mean loss over the microbatches "
        f"as a scalar tensor"
    )
    assert not returned.requires_grad, f"{what}: return the loss detached (loss.detach())"
    m, value = len(losses), float(returned)
    mean = sum(losses) / m
    if abs(value - mean) <= 1e-5 * abs(mean) + 1e-7:
        return
    mistakes = {
        "the sum of the microbatch losses, not their mean": sum(losses),
        "already divided by num_microbatches, then averaged again": mean / m,
        "the last microbatch's loss alone": losses[-1],
        "the first microbatch's loss alone": losses[0],
    }
    why = next((k for k, v in mistakes.items() if abs(value - v) <= 1e-5 * abs(v) + 1e-7), "")
    raise AssertionError(
        f"{what}: the last stage returned loss {value:.6g}, expected the mean over the {m} "
        f"microbatches, {mean:.6g}" + (f" (it looks like {why})" if why else "")
    )


def gradient_mistakes(shares: list[Tensor], rank: int, p: int) -> dict[str, Tensor]:
    """What the gradient would be after each usual mistake, by the hint that explains it."""
    m, want = len(shares), sum(shares)
    upstream = f"no gradient came back from stage {rank + 1}: each stage must call " + (
        "requires_grad_() on the activation it receives and send that activation's .grad back"
    )
    mistakes = {
        f", about {m}x the expected: is each microbatch's loss scaled by 1/num_microbatches "
        "before its backward?": want * m,
        f", about 1/{m} of the expected: is the loss divided by m twice?": want / m,
        ", about 2x the expected: does each microbatch run backward twice?": want * 2,
        ": the gradient is zero: "
        + (upstream if rank < p - 1 else "is the loss backpropagated?"): torch.zeros_like(want),
        f": only microbatch {m - 1}'s share is there: gradients must accumulate in .grad over "
        "the microbatches (never zero or overwrite them in between)": shares[-1],
    }
    for k in range(m):
        mistakes[f": microbatch {k}'s share is missing: did its backward run?"] = want - shares[k]
    return mistakes if m > 1 else {k: v for k, v in mistakes.items() if "2x" in k or "zero:" in k}


def check_gradients(
    stage: nn.Module, shares: dict[str, list[Tensor]], rank: int, p: int, what: str
) -> None:
    for name, param in stage.named_parameters():
        where = f"{what}: stage {rank}, parameter {name}"
        want = sum(shares[name])
        assert param.grad is not None, (
            f"{where} has no gradient (.grad is None): no backward reached stage {rank}"
        )
        got = param.grad.detach().double()
        scale = float(want.abs().max())
        error = (got - want).abs()
        if float(error.max()) <= 1e-4 * scale + 1e-7:
            continue
        hint = ""
        for reason, candidate in gradient_mistakes(shares[name], rank, p).items():
            allowed = 1e-4 * max(scale, float(candidate.abs().max())) + 1e-7
            if float((got - candidate).abs().max()) <= allowed:
                hint = reason
                break
        index = tuple(int(i) for i in torch.unravel_index(error.argmax(), error.shape))
        at = f" (largest at {list(index)}: expected {want[index]:.4g}, got {got[index]:.4g})"
        raise AssertionError(
            f"{where}: gradient differs by {float(error.max()):.3g} (max abs){hint}"
            + ("" if hint else at)
        )


def check_step(student: ModuleType, function: str, rank: int, p: int, regime: str) -> None:
    m = microbatches(regime, p)
    what = f"{function} with {m} microbatch{'es' if m > 1 else ''} on {p} stages"
    stage = build_stages(p)[rank]
    returned = run_step(getattr(student, function), stage, rank, p, m)
    losses, shares = expected_shares(p, m, rank)
    check_loss(returned, rank, p, losses, what)
    check_gradients(stage, shares, rank, p, what)


@pytest.mark.graded(target="pipeline_parallel.gpipe_step", kind="correctness")
@pytest.mark.parametrize("regime", REGIMES)
def test_gpipe_gradients(student: ModuleType, rank: int, world_size: int, regime: str) -> None:
    check_step(student, "gpipe_step", rank, world_size, regime)


@pytest.mark.graded(target="pipeline_parallel.one_f_one_b_step", kind="correctness")
@pytest.mark.parametrize("regime", REGIMES)
def test_one_f_one_b_gradients(
    student: ModuleType, rank: int, world_size: int, regime: str
) -> None:
    check_step(student, "one_f_one_b_step", rank, world_size, regime)


class Recorder(nn.Module):
    """Records ``F{i}`` when the ``i``-th forward runs, ``B{i}`` when its output's gradient is."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.timeline: list[str] = []

    def forward(self, x: Tensor) -> Tensor:
        i = sum(cell.startswith("F") for cell in self.timeline)
        self.timeline.append(f"F{i}")
        output = self.inner(x)
        if output.requires_grad:
            output.register_hook(lambda grad: self.timeline.append(f"B{i}"))
        return output


def gpipe_order(p: int, rank: int, m: int) -> list[str]:
    return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]


def one_f_one_b_order(p: int, rank: int, m: int) -> list[str]:
    warmup = min(p - rank - 1, m)
    order = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        order += [f"F{warmup + i}", f"B{i}"]
    return order + [f"B{i}" for i in range(m - warmup, m)]


def count_problem(timeline: list[str], rank: int, m: int) -> str | None:
    forwards = sum(cell.startswith("F") for cell in timeline)
    if forwards != m:
        return f"stage {rank} ran {forwards} forwards for {m} microbatches: one per microbatch"
    for i in range(m):
        runs = timeline.count(f"B{i}")
        if runs != 1:
            done = f"backpropagated microbatch {i} (B{i}) {runs} times"
            done = f"never backpropagated microbatch {i} (B{i})" if runs == 0 else done
            return f"stage {rank} {done}: each microbatch takes one backward"
    return None


def gpipe_problem(timeline: list[str], p: int, rank: int, m: int) -> str | None:
    problem = count_problem(timeline, rank, m)
    if problem:
        return problem
    first = next(j for j, cell in enumerate(timeline) if cell.startswith("B"))
    late = [cell for cell in timeline[first:] if cell.startswith("F")]
    if late:
        return (
            f"stage {rank} ran {late[0]} after {timeline[first]}: "
            f"GPipe runs every forward before any backward"
        )
    return None


def one_f_one_b_problem(timeline: list[str], p: int, rank: int, m: int) -> str | None:
    problem = count_problem(timeline, rank, m)
    expected = one_f_one_b_order(p, rank, m)
    if problem or timeline == expected:
        return problem
    warmup, limit = min(p - rank - 1, m), p - rank
    rule = (
        f"1F1B's warm-up on stage {rank} of {p} is {warmup} forward{'s' if warmup != 1 else ''}"
        f", then one forward and one backward in turn, so at most {limit} microbatch"
        f"{'es are' if limit > 1 else ' is'} in flight"
    )
    ahead = next(j for j, cell in enumerate(timeline) if cell.startswith("B"))
    if ahead != min(warmup + 1, m):
        ran = f"{'only ' if ahead < warmup + 1 else ''}{ahead} microbatch{'es' * (ahead > 1)}"
        return f"stage {rank} ran {ran} forward before its first backward; {rule}"
    in_flight = 0
    for cell in timeline:
        in_flight += 1 if cell.startswith("F") else -1
        if in_flight > limit:
            return f"stage {rank} had {in_flight} microbatches in flight after {cell}; {rule}"
    backwards = [cell for cell in timeline if cell.startswith("B")]
    for i, cell in enumerate(backwards):
        if cell != f"B{i}":
            return f"stage {rank} ran {cell} before B{i}: 1F1B backpropagates in forward order"
    j = next(j for j, (a, b) in enumerate(zip(timeline, expected, strict=True)) if a != b)
    return (
        f"stage {rank} ran {timeline[j]} at step {j} where 1F1B runs {expected[j]}: {rule} "
        f"(expected {' '.join(expected)}; ran {' '.join(timeline)})"
    )


def check_schedule(
    ctx: TestContext, step: Callable, function: str, order: Callable, problem_of: Callable, p: int
) -> None:
    """Run the schedule for every regime; show (and judge) the first one any rank got wrong."""
    timeout = datetime.timedelta(seconds=3 * ctx.test.op_timeout)
    side = dist.new_group(backend="gloo", timeout=timeout)  # the submission's messages stay out
    runs = []
    for regime in ("m>p", "m=p", "m<p"):
        m = microbatches(regime, p)
        recorder = Recorder(build_stages(p)[ctx.rank])
        run_step(step, recorder, ctx.rank, p, m)
        runs.append((m, recorder.timeline, problem_of(recorder.timeline, p, ctx.rank, m)))
    mine = next((k for k, run in enumerate(runs) if run[2]), len(runs))
    firsts: list[int] = [len(runs)] * p
    try:
        dist.all_gather_object(firsts, mine, group=side)
    except RuntimeError as err:
        raise PeerGone("the grader's exchange of the schedules", -1) from err
    m, timeline, problem = runs[min(firsts) % len(runs)]
    ctx.extra["per_rank"] = {"timeline": timeline}
    ctx.extra["expected_timeline"] = [order(p, r, m) for r in range(p)]
    ctx.extra["num_microbatches"] = m
    assert problem is None, f"{function} with {m} microbatches on {p} stages: {problem}"


@pytest.mark.graded(target="pipeline_parallel.gpipe_step", kind="schedule")
def test_gpipe_schedule(ctx: TestContext, student: ModuleType, world_size: int) -> None:
    check_schedule(ctx, student.gpipe_step, "gpipe_step", gpipe_order, gpipe_problem, world_size)


@pytest.mark.graded(target="pipeline_parallel.one_f_one_b_step", kind="schedule")
def test_one_f_one_b_schedule(ctx: TestContext, student: ModuleType, world_size: int) -> None:
    step, problem_of = student.one_f_one_b_step, one_f_one_b_problem
    check_schedule(ctx, step, "one_f_one_b_step", one_f_one_b_order, problem_of, world_size)
