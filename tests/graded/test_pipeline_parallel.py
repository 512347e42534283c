"""Graded tests of ``assignments/pipeline_parallel.py``: GPipe and 1F1B, gradients and order.

A ``p``-stage model (one ``Linear`` + ``Tanh`` per stage, all of one width; MSE loss after
the last) is drawn here from the secret seed; rank ``r`` gets stage ``r``'s weights, rank 0
the inputs and the last rank the targets, and trains its stage with the submission's
schedule (``grader/scenarios/pipeline_parallel.py``), with fewer microbatches than stages
(``m<p``), as many (``m=p``) and more (``m>p``: ``2p + 1``).

- Correctness: the returned loss (the mean over microbatches on the last stage, ``None``
  elsewhere) and every parameter's gradient must equal those of the mean loss over the full
  batch, computed here in float64. A wrong gradient is explained by the usual mistakes: a
  loss not scaled by ``1/m``, a microbatch never backpropagated, a gradient that never came
  back from the next stage.
- Schedule: correct gradients do not show the order of work, and the order is what 1F1B is
  for (at most ``p - r`` microbatches' activations alive on stage ``r``). It is read from
  the broker's record alone (:mod:`grader.testkit.schedule`): stage 0 takes microbatch
  ``j``'s rows only at the gate "microbatch j" (its ``inputs`` is a stand-in), every message
  is identified by what it holds against the activations and gradients computed here, and
  the stage's passes must fit, in the schedule's order, between the messages that bring
  their inputs and those that carry their results away. GPipe runs every forward before any
  backward, and the backwards in forward order (microbatch 0 first); 1F1B runs
  ``min(p - r - 1, m)`` warm-up forwards (also run with ``m = 1`` from 3 stages on), then
  one forward and one backward in turn, then the remaining backwards. Every rank's order as
  the broker saw it and the expected ones go to ``record.schedule``, which the report draws.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grader.scenarios.pipeline_parallel import ROWS, WIDTH, make_stage, stand_in
from grader.testkit import (
    FLOAT32_LAYERS,
    FLOAT32_SCALAR,
    CallResult,
    Gate,
    TestRecord,
    World,
    check_unchanged,
    failures,
    on_every_rank,
    rank_tensor,
    require,
    stage_timing,
)
from grader.testkit.messages import Expected
from grader.testkit.pipeline_parallel import Stepped, steps
from grader.testkit.schedule import PipelineSchedule, in_flight_bound, judge_stage, observed_order

REGIMES = ("m<p", "m=p", "m>p")
Shares = dict[str, list[Tensor]]  # each microbatch's share of a parameter's gradient, by name


def microbatches(regime: str, p: int) -> int:
    return {"m<p": max(1, p - 1), "m=p": p, "m>p": 2 * p + 1}[regime]


def stage_weights(p: int) -> list[tuple[Tensor, Tensor]]:
    """Every stage's weight and bias; Tanh stays away from saturation at this scale."""
    return [
        (
            rank_tensor(f"pp/{p}/stage{r}/weight", 0, (WIDTH, WIDTH), torch.float32) * WIDTH**-0.5,
            rank_tensor(f"pp/{p}/stage{r}/bias", 0, (WIDTH,), torch.float32) * 0.5,
        )
        for r in range(p)
    ]


def run_step(world: World, function: str, m: int) -> tuple[CallResult, Tensor, Tensor]:
    """Call the schedule as the contract says: inputs on stage 0 (a stand-in: microbatch
    ``j``'s rows are handed over at the gate "microbatch j"), targets on the last stage."""
    p = world.size
    inputs = rank_tensor(f"pp/{p}/{m}/inputs", 0, (m * ROWS, WIDTH), torch.float32)
    targets = rank_tensor(f"pp/{p}/{m}/targets", 0, (m * ROWS, WIDTH), torch.float32)
    args = [
        (function, *weights, stand_in(m) if r == 0 else None, targets if r == p - 1 else None, m)
        for r, weights in enumerate(stage_weights(p))
    ]
    rows = [Gate.handing(f"microbatch {j}", x) for j, x in enumerate(inputs.tensor_split(m))]
    gates = [rows] + [[] for _ in range(p - 1)]
    case = f"{m} microbatch{'es' if m > 1 else ''}"
    try:
        out = world.call(scenario="pipeline_parallel.step", args=args, case=case, gates=gates)
    except (failures.StudentError, failures.Deadlock) as err:
        hint = failure_hint(str(err), function, p, m)
        if not hint:
            raise
        raise err.with_hint(hint) from err
    return out, inputs, targets


_WAIT = re.compile(r"rank (\d+) waits in (send to|recv from) rank (\d+)")


def failure_hint(message: str, function: str, p: int, m: int) -> str:
    """The pipeline mistake behind a deadlock (or a crash with m < p - 1), if it is a usual one."""
    waits = {(int(a), way, int(b)) for a, way, b in _WAIT.findall(message)}
    if not message.startswith("deadlock"):
        if function == "one_f_one_b_step" and m < p - 1:
            return (
                f"with {m} microbatch{'es' * (m > 1)} on {p} stages, fewer than stage 0's "
                f"p - 1 = {p - 1} warm-up forwards: the warm-up is min(p - r - 1, m) forwards"
            )
        return ""
    no_grad = "call requires_grad_() on a received activation, or its .grad is None"
    for rank, way, peer in sorted(waits):
        if way == "recv from" and peer == rank + 1 and f"rank {peer} returned without" in message:
            return (
                f"stage {peer} returned without sending the gradient of its input back to stage "
                f"{rank}: {no_grad}"
            )
        if way == "recv from" and peer == rank + 1 and (peer, "recv from", rank) in waits:
            return (
                f"stages {rank} and {peer} both wait to receive from each other: a send was "
                f"skipped, such as the gradient stage {peer} sends back: {no_grad}"
            )
        early = way == "send to" and peer == rank - 1 and (peer, "send to", rank) in waits
        if function == "gpipe_step" and early:
            return (
                f"a schedule error: stage {rank} started a backward (it sends a gradient to "
                f"stage {peer}) while stage {peer} still sends it activations: GPipe runs "
                "every forward before any backward"
            )
    return ""


def expected_shares(p: int, inputs: Tensor, targets: Tensor, m: int) -> tuple[list[float], list]:
    """Each microbatch's loss, and its share (loss / m) of each stage's gradients, in float64."""
    stages = [make_stage(w.double(), b.double()) for w, b in stage_weights(p)]
    model = nn.Sequential(*stages)
    losses: list[float] = []
    shares: list[Shares] = [{name: [] for name, _ in s.named_parameters()} for s in stages]
    for x, y in zip(inputs.double().tensor_split(m), targets.double().tensor_split(m), strict=True):
        model.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        (loss / m).backward()
        losses.append(loss.item())
        for stage, share in zip(stages, shares, strict=True):
            for name, param in stage.named_parameters():
                share[name].append(param.grad.clone())
    return losses, shares


def expected_messages(p: int, inputs: Tensor, targets: Tensor, m: int) -> Expected:
    """Each stage's output and its input's gradient (of loss / m), per microbatch, in float64."""
    stages = [make_stage(w.double(), b.double()) for w, b in stage_weights(p)]
    expected = Expected([[] for _ in stages], [[] for _ in stages])
    for x, y in zip(inputs.double().tensor_split(m), targets.double().tensor_split(m), strict=True):
        x, given = x.requires_grad_(), []  # each stage's input, its gradient kept
        for stage, outputs in zip(stages, expected.activations, strict=True):
            x.retain_grad()
            given.append(x)
            x = stage(x)
            outputs.append(x.detach())
        (F.mse_loss(x, y) / m).backward()
        for x, grads in zip(given, expected.gradients, strict=True):
            grads.append(x.grad)
    return expected


def check_loss(seen: Stepped, rank: int, p: int, losses: list[float], what: str) -> None:
    kind, returned = seen.loss_type, seen.loss
    if rank != p - 1:
        require(
            kind == "None",
            f"{what}: stage {rank} returned {kind}: only the last stage (rank {p - 1}) returns "
            f"the loss, the others return None",
        )
        return
    require(
        returned is not None and returned.numel() == 1,
        f"{what}: the last stage returned {kind}, expected the mean loss over the microbatches "
        f"as a scalar tensor",
    )
    require(not seen.loss_requires_grad, f"{what}: return the loss detached (loss.detach())")
    m, value = len(losses), float(returned)
    mean = sum(losses) / m
    if FLOAT32_SCALAR.holds(value, mean):
        return
    mistakes = {
        "the sum of the microbatch losses, not their mean": sum(losses),
        "already divided by num_microbatches, then averaged again": mean / m,
        "the last microbatch's loss alone": losses[-1],
        "the first microbatch's loss alone": losses[0],
    }
    why = next((k for k, v in mistakes.items() if FLOAT32_SCALAR.holds(value, v)), "")
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
        mistakes[
            f": microbatch {k}'s share is there twice: did it run (forward and backward) twice?"
        ] = want + shares[k]
    return mistakes if m > 1 else {k: v for k, v in mistakes.items() if "2x" in k or "zero:" in k}


def check_gradients(
    grads: Mapping[str, Tensor | None], shares: Shares, rank: int, p: int, what: str
) -> None:
    for name, parts in shares.items():
        where = f"{what}: stage {rank}, parameter {name}"
        want, grad = sum(parts), grads.get(name)
        require(
            grad is not None,
            f"{where} has no gradient (.grad is None): no backward reached stage {rank}",
        )
        got = grad.double()
        scale = float(want.abs().max())
        error = (got - want).abs()
        if float(error.max()) <= FLOAT32_LAYERS.bound(scale):
            continue
        hint = ""
        for reason, candidate in gradient_mistakes(parts, rank, p).items():
            allowed = FLOAT32_LAYERS.bound(max(scale, float(candidate.abs().max())))
            if float((got - candidate).abs().max()) <= allowed:
                hint = reason
                break
        index = tuple(int(i) for i in torch.unravel_index(error.argmax(), error.shape))
        at = f" (largest at {list(index)}: expected {want[index]:.4g}, got {got[index]:.4g})"
        raise AssertionError(
            f"{where}: gradient differs by {float(error.max()):.3g} (max abs){hint}"
            + ("" if hint else at)
        )


def check_step(world: World, function: str, regime: str) -> None:
    p, m = world.size, microbatches(regime, world.size)
    what = f"{function} with {m} microbatch{'es' if m > 1 else ''} on {p} stages"
    out, inputs, targets = run_step(world, function, m)
    losses, shares = expected_shares(p, inputs, targets, m)
    seen = steps(out.returned, what)

    def check(r: int) -> None:
        for name, index, original in (("inputs", 3, stand_in(m)), ("targets", 4, targets)):
            if out.args[r][index] is not None:
                given = out.args[r][index]
                check_unchanged(given, original, f"{what}: {name} (an argument, not an output)")
        check_loss(seen[r], r, p, losses, what)
        check_gradients(seen[r].grads, shares[r], r, p, what)

    on_every_rank(p, check)


@pytest.mark.graded(target="pipeline_parallel.gpipe_step", kind="correctness")
@pytest.mark.parametrize("regime", REGIMES)
def test_gpipe_gradients(world: World, regime: str) -> None:
    check_step(world, "gpipe_step", regime)


@pytest.mark.graded(target="pipeline_parallel.one_f_one_b_step", kind="correctness")
@pytest.mark.parametrize("regime", REGIMES)
def test_one_f_one_b_gradients(world: World, regime: str) -> None:
    check_step(world, "one_f_one_b_step", regime)


def schedule_microbatches(p: int) -> list[int]:
    """The regimes' microbatch counts, then m = 1 from 3 stages on: with m = p - 1 at most,
    a 1F1B warm-up of ``p - r - 1`` forwards that lacks its ``min(..., m)`` never runs short."""
    counts = [microbatches(regime, p) for regime in ("m>p", "m=p", "m<p")]
    return [*counts, 1] if p > 2 else counts


def check_schedule(world: World, record: TestRecord, schedule: PipelineSchedule) -> None:
    """Run the schedule for every regime; show (and judge) the first one any rank got wrong.

    Every verdict rests on the broker's record and the activations and gradients computed
    here; the order drawn is the broker's too.
    """
    p, runs = world.size, []
    for m in schedule_microbatches(p):
        out, inputs, targets = run_step(world, schedule.value, m)
        expected = expected_messages(p, inputs, targets, m)
        judged = [judge_stage(out.traffic, schedule, p, r, m, expected) for r in range(p)]
        runs.append((m, judged, out.traffic))
    m, judged, traffic = next((run for run in runs if any(j[1] for j in run[1])), runs[0])
    seen = [observed_order(schedule, bounds, p, r, m) for r, (bounds, _) in enumerate(judged)]
    expected_order = [schedule.order(p, r, m) for r in range(p)]
    record.schedule = (seen, expected_order)
    record.details.update(
        timeline=[[str(cell) for cell in row] for row in seen],  # as the broker saw it
        expected_timeline=[[str(cell) for cell in row] for row in expected_order],
        num_microbatches=m,
        in_flight_lower_bound_from_messages=[in_flight_bound(b, m) for b, _ in judged[:-1]],
        stage_timing=stage_timing(traffic),  # the broker's clock: what the picture draws
    )

    def check(r: int) -> None:
        problem = judged[r][1]
        require(problem is None, f"{schedule.value} with {m} microbatches on {p} stages: {problem}")

    on_every_rank(p, check)


@pytest.mark.graded(target="pipeline_parallel.gpipe_step", kind="schedule")
def test_gpipe_schedule(world: World, record: TestRecord) -> None:
    check_schedule(world, record, PipelineSchedule.GPIPE)


@pytest.mark.graded(target="pipeline_parallel.one_f_one_b_step", kind="schedule")
def test_one_f_one_b_schedule(world: World, record: TestRecord) -> None:
    check_schedule(world, record, PipelineSchedule.ONE_F_ONE_B)
