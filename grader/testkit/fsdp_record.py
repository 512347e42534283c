"""The broker's record of an FSDP step, read on the trusted side (``test_fully_sharded.py``).

Every step's events between ranks by phase and layer (placed by the gates, never by a
mark), the parameter each all-gather carries a shard of (identified by what it carries,
against the shards :mod:`grader.testkit.fully_sharded` computes: the initial ones in the
first step, the one-process training's after it), what each reduce-scatter carries against
the rank's local gradients at that step, and the rules of the order and size of the gathers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grader import wire
from grader.broker.traffic import Event, Traffic
from grader.judge import communication
from grader.judge.call import CallResult
from grader.protocol import OpName
from grader.scenarios.fully_sharded import DTYPES, SHARDED
from grader.testkit.compare import carried, require
from grader.testkit.fully_sharded import (
    NUMEL,
    REPLICATED,
    SHARDED_PARAMS,
    STEPS,
    expected,
    initial_state,
    padded_shard,
    shard_size,
    within,
)


@dataclass(frozen=True)
class Step:
    """A rank's operations in one step, placed by its gates: ``starts[i]`` operations came
    before sharded layer ``i`` had what its forward needs (the tokens, or its factor); the
    backward is from the targets and the last layer's start on, to the learning rate."""

    number: int
    events: list[Event]  # the step's operations, marks left out
    starts: list[int]
    backward_from: int

    @property
    def forward(self) -> list[Event]:
        return self.events[: self.backward_from]

    @property
    def backward(self) -> list[Event]:
        return self.events[self.backward_from :]


def step_of(traffic: Traffic, r: int, number: int = 1) -> Step:
    """Rank ``r``'s step ``number`` as its gates place it (from the previous step's learning
    rate on), its operations between ranks only (no collective of a group smaller than every
    rank: one of the rank alone never left it); fails if a gate was never passed."""
    passed = {g.label: g.after for g in traffic.gates[r]}
    labels = ["tokens", *SHARDED[1:], "targets", "lr"]
    lacking = [f"step {number} {what}" for what in labels if f"step {number} {what}" not in passed]
    require(not lacking, f"step {number} never passed the grader's gate {lacking[:1]}")
    begin = passed.get(f"step {number - 1} lr", 0)
    events = traffic.per_rank[r]

    def counts(e: Event) -> bool:
        return e.op != OpName.MARK and traffic.among_all(e)

    def operations_before(what: str) -> int:
        return sum(map(counts, events[begin : passed[f"step {number} {what}"]]))

    starts = [operations_before(what) for what in labels[: len(SHARDED)]]
    steps = [e for e in events[begin : passed[f"step {number} lr"]] if counts(e)]
    return Step(number, steps, starts, max(operations_before("targets"), starts[-1]))


def gathered(e: Event, p: int, itemsize: dict[str, int]) -> str | None:
    """The sharded parameter whose one shard an all-gather's size is (sizes are all distinct)."""
    size = itemsize.get(e.dtype, 0)
    for name in SHARDED_PARAMS:
        if size and e.nbytes == shard_size(name, p) * size:
            return name
    return None


ITEMSIZE = {name: dtype.itemsize for name, dtype in wire.DTYPES.items()}
RECORD = " (the broker's record of what it carried)"


def shard_problem(
    e: Event, name: str, p: int, r: int, dtype: str, phase: str, values: Values
) -> str | None:
    """Why the all-gather of ``name``'s size does not carry rank ``r``'s shard of it, as the
    step gathers it (``values``: its parameters, cast to the compute dtype), or None."""
    want = padded_shard(values.of[name], p, r).to(DTYPES[dtype] or torch.float32).double()
    got = carried(e)
    exact = values.tolerance == 0
    if torch.equal(got, want) or (not exact and within(got, want, values.tolerance)[0]):
        return None
    return (
        f"the {phase}'s all-gather at {e.at or '?'} is the size of {name}'s shard but does "
        f"not carry this rank's shard of it{RECORD}: gather the flat shard [r*s, (r+1)*s) of "
        "the padded parameter, as it is, in the compute dtype"
        + ("" if values.step == 1 else ", as the last step left it (its owner's update)")
    )


@dataclass(frozen=True)
class Values:
    """The parameters a step starts from (``of``, the one-process training's), and how far a
    rank's may be from them: 0 in the first step (the initial state, exactly), the test's
    tolerance after a step (a rank's sums run in another order than the grader's)."""

    step: int
    of: dict[str, Tensor]
    tolerance: float


def values_before(step: int, dtype: str, tolerance: float, p: int) -> Values:
    """The parameters step ``step`` starts from at world size ``p``, with plain SGD (the tests
    of the record's)."""
    if step == 1:
        return Values(1, initial_state(p), 0.0)
    return Values(step, expected("sgd", dtype, p)["before"][step - 1], tolerance)


def scatter_problem(e: Event, p: int, local: dict[str, Tensor], tol: float) -> str | None:
    """Why a reduce-scatter does not carry the rank's ``local`` gradient (:func:`local_grads`)
    of one sharded parameter (flat, zero-padded to p*s; as it is, or divided by p), or None."""
    size = e.nbytes // 4
    names = [n for n in SHARDED_PARAMS if shard_size(n, p) * p == size]
    values = carried(e)
    for name in names:
        want = torch.zeros(size, dtype=torch.float64)
        want[: NUMEL[name]] = local[name].double().reshape(-1)
        if any(within(values, c * want, tol)[0] for c in (1.0, 1.0 / p)):
            return None
    of = f"{names[0]}'s size" if names else f"{size} elements"
    return (
        f"the reduce-scatter at {e.at or '?'} ({of}) does not carry this rank's own gradient "
        f"of that parameter{RECORD}: reduce-scatter each sharded parameter's local gradient, "
        "flat and zero-padded to p*s elements"
    )


LAYER_OF = {n: SHARDED.index(n.split(".")[0]) for n in SHARDED_PARAMS}


def check_record(
    out: CallResult, r: int, p: int, dtype: str, kind: str, tolerance: float
) -> dict[str, Any]:
    """The broker's facts for rank ``r`` in every step (each needs the step before's updates
    from every rank); fails with the first broken rule of ``kind``, its step named after the
    first. ``tolerance``: how far a later step's gathered values may be from the grader's.
    Returns the first step's gathers."""
    first: dict[str, Any] = {}
    for number in range(1, STEPS + 1):
        step = step_of(out.traffic, r, number)
        values = values_before(number, dtype, tolerance, p)
        try:
            found = check_step(step, values, p, r, dtype, kind)
        except AssertionError as err:
            if number == 1:
                raise
            raise AssertionError(f"step {number}: {err}") from None
        first = first or found
    return first


def check_step(step: Step, values: Values, p: int, r: int, dtype: str, kind: str) -> dict[str, Any]:
    """One step's facts: what each gather carried, the forward's gathers and the backward's."""
    for phase, events in (("forward", step.forward), ("backward", step.backward)):
        for e in events:
            if e.op != OpName.ALL_GATHER:
                continue
            name = gathered(e, p, ITEMSIZE)
            require(
                name is not None and e.dtype == dtype,
                f"the {phase}'s all-gather at {e.at or '?'} carries {e.nbytes} bytes of "
                f"{e.dtype}: each gather must carry exactly one shard of one sharded parameter "
                f"in the compute dtype ({dtype})"
                + (", cast BEFORE communicating" if e.dtype != dtype else ""),
            )
            problem = shard_problem(e, name, p, r, dtype, phase, values)  # type: ignore[arg-type]
            require(problem is None, str(problem))
    return {
        "forward": _forward_gathers(step, p, kind),
        "backward": _backward_gathers(step, p, kind),
    }


def _forward_gathers(step: Step, p: int, kind: str) -> list[str]:
    """Every layer's forward starts after the gathers of its parameters (and, for the
    communication test, at most two layers ahead, in forward order)."""
    done: list[str] = []
    for position, e in enumerate([*step.forward, None]):
        for i in (i for i, start in enumerate(step.starts) if start == position):
            lacking = [n for n in SHARDED_PARAMS if LAYER_OF[n] == i and n not in done]
            require(
                not lacking,
                f"{SHARDED[i]} computed its forward before {', '.join(lacking)} was gathered",
            )
            ahead = {LAYER_OF[n] for n in done if LAYER_OF[n] > i + 2}
            if kind == "communication":
                require(
                    not ahead,
                    f"when {SHARDED[i]} starts its forward, layer(s) "
                    f"{', '.join(SHARDED[j] for j in sorted(ahead))} are gathered already: "
                    "prefetch at most two layers ahead, not everything up front",
                )
        if e is not None and e.op == OpName.ALL_GATHER:
            done.append(gathered(e, p, ITEMSIZE) or "?")
    order = [LAYER_OF[n] for n in done if n in LAYER_OF]
    if kind == "communication":
        require(
            order == sorted(order),
            f"the forward gathers the layers in the order {[SHARDED[i] for i in order]}, not "
            "in forward order",
        )
    return done


def _backward_gathers(step: Step, p: int, kind: str) -> list[str]:
    """Every Linear's backward is preceded by its weight's gather, in reverse order."""
    back = [gathered(e, p, ITEMSIZE) or "?" for e in step.backward if e.op == OpName.ALL_GATHER]
    linear_weights = [f"{m}.weight" for m in SHARDED if m != "embed"]
    missing = [n for n in linear_weights if n not in back]
    require(
        not missing,
        f"the backward gathers no {', '.join(missing)}: a Linear's backward needs its full "
        "weight, which must have been freed after forward and is gathered again",
    )
    back_layers = [LAYER_OF[n] for n in back]
    if kind == "communication":
        require(
            back_layers == sorted(back_layers, reverse=True),
            f"the backward gathers the layers in the order {[SHARDED[i] for i in back_layers]}: "
            "backward runs the layers in reverse, and gathers them so",
        )
    return back


def bytes_bound(p: int, dtype: str) -> float:
    """The bytes one step must move on a rank (:func:`grader.judge.communication.moved`): the
    gathers of the shards (again for the Linear weights) in the compute dtype, the
    reduce-scatters of the padded gradients in float32, the replicated gradients' all-reduce."""
    c, shard = ITEMSIZE[dtype], {n: shard_size(n, p) for n in SHARDED_PARAMS}
    linear = [f"{m}.weight" for m in SHARDED if m != "embed"]
    gathers = [shard[n] * c for n in [*SHARDED_PARAMS, *linear]]
    scatters = [p * shard[n] * 4 for n in SHARDED_PARAMS]
    replicated = sum(NUMEL[n] for n in REPLICATED) * 4
    return (
        sum(communication.moved(OpName.ALL_GATHER, p, b) for b in gathers)
        + sum(communication.moved(OpName.REDUCE_SCATTER, p, b) for b in scatters)
        + communication.moved(OpName.ALL_REDUCE, p, replicated)
    )


def step_messages(step: Step, p: int, local: dict[str, Tensor], tolerance: float) -> float:
    """The step's reduce-scatters: one float32 one per sharded parameter, carrying this rank's
    ``local`` gradient of it; fails with the first that is not. Returns the bytes it moved."""
    scatters = [e for e in step.backward if e.op == OpName.REDUCE_SCATTER]
    for e in scatters:
        require(
            e.dtype == "float32",
            f"a reduce-scatter at {e.at or '?'} carries {e.dtype}: gradients are "
            "reduce-scattered in float32",
        )
    sizes = sorted(e.nbytes for e in scatters)
    want = sorted(shard_size(n, p) * p * 4 for n in SHARDED_PARAMS)
    reduced = [e.nbytes for e in step.backward if e.op == OpName.ALL_REDUCE and e.nbytes in want]
    in_full = (
        "; the sharded gradients are all-reduced in full: reduce-scatter them, a rank "
        "needs only its shard's sum"
        if reduced
        else ""
    )
    require(
        sizes == want,
        f"the reduce-scatters carry {sizes} bytes; expected one per sharded parameter, "
        f"its padded gradient of p*s float32 elements: {want}{in_full}",
    )
    for e in scatters:
        problem = scatter_problem(e, p, local, tolerance)
        require(problem is None, str(problem))
    return sum(communication.moved(e.op, p, e.nbytes) for e in step.events)


def late_scatter(traffic: Traffic, r: int, number: int, p: int) -> str | None:
    """Why a layer's reduce-scatter was not posted during step ``number``'s backward, or None:
    each layer's (the last ones' first) must be among rank ``r``'s operations before the next
    layer's backward has computed its input's gradient (the gate ``back <layer>``, which that
    gradient cannot be computed without). The first layer has no next one: it is not judged."""
    passed = {g.label: g.after for g in traffic.gates[r]}
    events = traffic.per_rank[r]
    for i in range(len(SHARDED) - 1, 1, -1):
        label = f"step {number} back {SHARDED[i - 1]}"
        require(label in passed, f"step {number} never passed the grader's gate {label!r}")
        begin = passed[f"step {number} targets"]
        sizes = {
            e.nbytes // ITEMSIZE.get(e.dtype, 4)
            for e in events[begin : passed[label]]
            if e.op == OpName.REDUCE_SCATTER and traffic.among_all(e)
        }
        late = [n for n in SHARDED_PARAMS if LAYER_OF[n] == i and shard_size(n, p) * p not in sizes]
        if late:
            return (
                f"the reduce-scatter of {', '.join(late)} was not posted before "
                f"{SHARDED[i - 1]}'s backward had finished (the broker saw it later, or never, "
                f"against the grader's gate where {SHARDED[i - 1]}'s input gradient is "
                "computed): reduce-scatter each layer's gradient as soon as autograd has "
                "computed it, during the backward, not in finish_gradient_synchronization()"
            )
    return None
