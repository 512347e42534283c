"""A pipeline stage's messages, read from the broker's record and identified by what they hold.

The trusted side computes, for every microbatch, each stage's activation (what it sends to
the next stage) and the gradient of its input (what it sends back), in float64
(:class:`Expected`). A message of the right size holding anything else is a wrong message:
an activation must equal one microbatch's (float32 rounding aside), a gradient must be a
positive multiple of one microbatch's (1 when each loss is divided by ``m`` before its
backward, ``m`` when the parameters' gradients are divided afterwards), the same multiple
for every microbatch. Every other operation is refused, so no input reaches a stage but
through these messages and stage 0's gates: what the schedule tests read
(:class:`Bounds`) cannot be bypassed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from grader import wire
from grader.broker.traffic import Event, Traffic
from grader.judge.verdict import Cell, backward, forward
from grader.protocol import OpName

RECORD = " (the broker's record of its messages)"
Found = tuple[int, float] | None  # a message's microbatch and multiple, or none
ALLOWED_COLLECTIVES = (OpName.BARRIER,)  # carries no data


@dataclass(frozen=True)
class Expected:
    """Per stage, per microbatch: the activation it sends on and its input's gradient."""

    activations: list[list[Tensor]]
    gradients: list[list[Tensor]]


@dataclass
class Bounds:
    """Where each pass of a stage could start and had ended, as positions among its events:
    ``start[c]`` events came before its input reached the stage, and the send of its result
    is event ``end[c]``."""

    start: dict[Cell, int] = field(default_factory=dict)
    end: dict[Cell, int] = field(default_factory=dict)


def carried(event: Event, like: Tensor) -> Tensor | None:
    """What a send carried, as float64 of ``like``'s shape; None if it is not a floating-point
    tensor of ``like``'s size (in the dtype the broker saw it sent in)."""
    dtype = wire.DTYPES.get(event.dtype)
    if dtype is None or not dtype.is_floating_point:
        return None
    if len(event.payload) != dtype.itemsize * like.numel():
        return None
    values = torch.frombuffer(bytearray(event.payload), dtype=dtype)
    return values.double().view(like.shape)


def activation_of(event: Event, activations: list[Tensor]) -> int | None:
    """The microbatch whose activation the send carried, or None."""
    x = carried(event, activations[0])
    if x is None or not bool(x.isfinite().all()):
        return None
    return next((j for j, a in enumerate(activations) if float((x - a).abs().max()) <= 1e-4), None)


def gradient_of(event: Event, gradients: list[Tensor]) -> tuple[int, float] | None:
    """The microbatch whose gradient the send carried, and at what multiple; or None."""
    x = carried(event, gradients[0])
    if x is None or not bool(x.isfinite().all()):
        return None
    for j, g in enumerate(gradients):
        norm = float((g * g).sum())
        scale = float((x * g).sum()) / norm if norm > 0 else 0.0
        if scale > 0 and float((x - scale * g).norm()) <= 1e-3 * float(x.norm()):
            return j, scale
    return None


def foreign_problem(events: list[Event], rank: int) -> str | None:
    """Any operation that is not a message to or from a neighbouring stage."""
    for e in events:
        if e.op == OpName.MARK or e.op in ALLOWED_COLLECTIVES:
            continue
        if e.op in (OpName.SEND, OpName.RECV) and e.peer in (rank - 1, rank + 1):
            continue
        way = "to" if e.op == OpName.SEND else "from"
        did = f"called {e.op}" if e.peer < 0 else f"{e.op} {way} stage {e.peer}"
        return (
            f"stage {rank} {did}{RECORD}: a pipeline stage sends activations to the next "
            "stage and gradients back to the previous one, and nothing else"
        )
    return None


def sequence_problem(seen: list[int], rank: int, peer: int, what: str, title: str) -> str | None:
    """Why the stage's messages to ``peer`` do not hold microbatch 0, 1, ... in turn."""
    i = next((i for i, j in enumerate(seen) if j != i), None)
    if i is None:
        return None
    sent, j = f"stage {rank} sent", seen[i]
    if j in seen[:i]:
        return (
            f"{sent} microbatch {j}'s {what} to stage {peer} twice{RECORD}: each microbatch "
            "takes one forward and one backward"
        )
    reverse = " (in reverse order)" if seen == list(reversed(range(len(seen)))) else ""
    rule = (
        "runs the forwards in microbatch order"
        if what == "activation"
        else "backpropagates in forward order, microbatch 0 first"
    )
    return (
        f"{sent} microbatch {j}'s {what} to stage {peer} before microbatch {i}'s{reverse}"
        f"{RECORD}: {title} {rule}"
    )


def sends_to(events: list[Event], peer: int) -> list[int]:
    return [i for i, e in enumerate(events) if e.op == OpName.SEND and e.peer == peer]


def identify(traffic: Traffic, sender: int, to: int, expected: Expected) -> list[Found]:
    """Which microbatch each of ``sender``'s sends to ``to`` carried, and at what multiple
    (an activation's is 1), or None."""
    events = traffic.per_rank[sender]
    positions = sends_to(events, to)
    if to == sender + 1:
        acts = expected.activations[sender]
        return [_with_one(activation_of(events[i], acts)) for i in positions]
    return [gradient_of(events[i], expected.gradients[sender]) for i in positions]


def _with_one(j: int | None) -> Found:
    return None if j is None else (j, 1.0)


def sent_problem(
    traffic: Traffic, rank: int, peer: int, m: int, expected: Expected, title: str
) -> str | None:
    """What is wrong with the stage's messages to ``peer``: their number, what each holds,
    their order, a gradient's multiple."""
    what = "activation" if peer == rank + 1 else "gradient"
    found = identify(traffic, rank, peer, expected)
    if len(found) != m:
        return (
            f"stage {rank} sent {len(found)} {what}s to stage {peer} for {m} microbatches{RECORD}"
        )
    for i, one in enumerate(found):
        if one is None:
            return (
                f"stage {rank}'s {what} message {i} to stage {peer} holds no microbatch's "
                f"{what} as the grader computes it{RECORD}: "
                + ("the stage's output" if what == "activation" else "the gradient of its input")
            )
    problem = sequence_problem([j for j, _ in found], rank, peer, what, title)  # type: ignore[misc]
    scales = [scale for _, scale in found]  # type: ignore[misc]
    usual = sorted(scales)[len(scales) // 2]
    odd = next((k for k, c in enumerate(scales) if abs(c - usual) > 1e-3 * usual), None)
    if problem or odd is None:
        return problem
    return (
        f"stage {rank} sent microbatch {odd}'s gradient back at {scales[odd] / usual:.3g}x "
        f"the scale of its other microbatches'{RECORD}: each microbatch takes one backward, "
        "its loss scaled as the others'"
    )


def arrivals(traffic: Traffic, rank: int, peer: int, expected: Expected) -> dict[int, int]:
    """Microbatch -> how many of ``rank``'s events came before the broker handed it that
    microbatch's message from ``peer`` (sends and receives matched in order per tag, as the
    broker matches them)."""
    found = identify(traffic, peer, rank, expected)
    sender = traffic.per_rank[peer]
    by_tag: dict[int, list[Found]] = defaultdict(list)
    for position, one in zip(sends_to(sender, rank), found, strict=True):
        by_tag[sender[position].tag].append(one)
    taken: dict[int, int] = defaultdict(int)
    came: dict[int, int] = {}
    for i, e in enumerate(traffic.per_rank[rank]):
        if e.op != OpName.RECV or e.peer != peer:
            continue
        queue, k = by_tag[e.tag], taken[e.tag]
        taken[e.tag] += 1
        one, handed = queue[k] if k < len(queue) else None, traffic.handed_after(rank, i)
        if one is not None and handed is not None:
            came[one[0]] = min(came.get(one[0], handed), handed)
    return came


def read_stage(
    traffic: Traffic, rank: int, p: int, m: int, expected: Expected, title: str
) -> tuple[Bounds, str | None]:
    """The bounds of the stage's passes, and what is wrong with its messages (or None)."""
    bounds = Bounds()
    neighbours = [peer for peer in (rank + 1, rank - 1) if 0 <= peer < p]
    problem = foreign_problem(traffic.per_rank[rank], rank)
    for peer in neighbours:
        problem = problem or sent_problem(traffic, rank, peer, m, expected, title)
        pass_of = forward if peer == rank + 1 else backward
        for i, position in enumerate(sends_to(traffic.per_rank[rank], peer)[:m]):
            bounds.end[pass_of(i)] = position
        came_as = forward if peer == rank - 1 else backward
        for j, after in arrivals(traffic, rank, peer, expected).items():
            bounds.start[came_as(j)] = after
    for passed in traffic.gates[rank] if rank == 0 else []:
        label = passed.label.removeprefix("microbatch ")
        if label.isdigit():
            bounds.start[forward(int(label))] = passed.after
    return bounds, problem
