"""ZeRO-1's owners, read from the broker's record of a call, not from anything a rank reports.

A parameter element's owner is the rank that sent its updated value: the root of a broadcast
that carried it, or the rank whose input to an all-gather or an all-reduce (the others adding
zeros there) held it, in a collective of every rank (the default group): one of a smaller
group, of the rank alone, never sent anything to the others. Values are matched by
content against the unsharded optimizer's updated parameters (computed here), so that neither
the order of the messages nor their grouping into tensors matters: whole parameters, flat
element ranges and buckets of several parameters are all read the same way.
What each rank's scenario returned is read into one checked record (:class:`Stepped`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grader.broker.traffic import Event, Traffic
from grader.protocol import OpName
from grader.testkit.compare import carried, nearest
from grader.testkit.data import generator
from grader.testkit.observed import (
    list_of,
    read_every_rank,
    read_index,
    read_record,
    read_tensor,
)
from grader.tolerances import FLOAT64_ORACLE

HOW = (
    "ZeRO-1 brings every rank's parameters up to date from their owners: broadcast each "
    "parameter from the rank that updated it (or all-gather every rank's updated shard)"
)


@dataclass(frozen=True)
class Owners:
    """Per parameter, the rank owning each element (flattened): the one that sent its update."""

    of: list[Tensor]  # int64, one per parameter, shaped like it

    def mask(self, i: int, rank: int) -> Tensor:
        """Where ``rank`` owns parameter ``i``."""
        return self.of[i] == rank

    def counts(self, p: int) -> list[list[int]]:
        """Per rank, how many elements of each parameter it owns."""
        return [[int((o == r).sum()) for o in self.of] for r in range(p)]


def update_of(event: Event, rank: int) -> Tensor | None:
    """The values an updating event of ``rank`` sent, in float64: a broadcast's payload if the
    rank is its root, its input to an all-gather or an all-reduce; None for anything else."""
    sends = event.op in (OpName.ALL_GATHER, OpName.ALL_REDUCE) or (
        event.op == OpName.BROADCAST and event.root == rank
    )
    return carried(event) if sends else None


def matches(values: Tensor, flat: Tensor) -> Tensor:
    """The positions in ``flat`` of the elements of ``values`` that one of its elements equals
    (within :data:`~grader.tolerances.FLOAT64_ORACLE`: float64 steps in another order)."""
    order = flat.argsort()
    ordered = flat[order]
    at = nearest(values, ordered)
    found = (ordered[at] - values).abs() <= FLOAT64_ORACLE.bound(ordered[at])
    return order[at[found]]


def senders(traffic: Traffic, updated: list[list[Tensor]]) -> Tensor:
    """(p, elements): whether rank r sent element j's updated value, after any step.

    ``updated``: the unsharded optimizer's parameters after each step; elements are numbered
    through the parameters in order, flattened.
    """
    flats = [torch.cat([t.detach().double().flatten() for t in step]) for step in updated]
    sent = torch.zeros(len(traffic.per_rank), len(flats[0]), dtype=torch.bool)
    for rank in range(len(traffic.per_rank)):
        for event in traffic.exchanged(rank):  # what another rank received: every rank's
            values = update_of(event, rank)
            if values is None or not len(values):
                continue
            for flat in flats:
                sent[rank, matches(values, flat)] = True
    return sent


def owners(traffic: Traffic, updated: list[list[Tensor]]) -> tuple[Owners | None, str | None]:
    """The owners of every parameter element, or why the record shows none: an element whose
    update no rank sent, or one that two ranks sent."""
    sent = senders(traffic, updated)
    shapes = [t.shape for t in updated[0]]
    starts = [0, *itertools.accumulate(math.prod(s) for s in shapes)]

    def parameter(j: int) -> int:
        return next(i for i in range(len(shapes)) if j < starts[i + 1])

    count = sent.sum(0)
    if bool((count == 0).any()):
        i = parameter(int((count == 0).nonzero()[0]))
        return None, (
            f"no rank sent parameter {i}'s updated value, in a broadcast from its root or in "
            f"its input to an all-gather or an all-reduce, of every rank (the broker's record "
            f"of what each carried; one of a smaller group, of the rank alone, reaches no other "
            f"rank): {HOW}"
        )
    if bool((count > 1).any()):
        j = int((count > 1).nonzero()[0])
        ranks = ", ".join(str(r) for r in sent[:, j].nonzero().flatten().tolist())
        return None, (
            f"parameter {parameter(j)}'s updated value was sent by ranks {ranks}: ZeRO-1 "
            "gives each parameter (or element) one owner, the only rank that steps it and "
            "holds its optimizer state, and that rank sends the update to the others"
        )
    owner = sent.long().argmax(0)
    return Owners(
        [owner[a:b].reshape(s) for a, b, s in zip(starts[:-1], starts[1:], shapes, strict=True)]
    ), None


def owned_grads(
    grads: list[list[Tensor | None]], owned: Owners, rank: int, key: str
) -> list[list[Tensor | None]]:
    """``grads`` where ``rank`` owns them, and elsewhere gradients drawn from the secret seed
    (``key``), as random as the true ones: only the owner can know how a parameter moves."""
    out: list[list[Tensor | None]] = []
    for step, row in enumerate(grads, start=1):
        gen = generator(f"{key}/rank{rank}/step{step}")
        out.append(
            [
                None
                if g is None
                else torch.where(
                    owned.mask(i, rank), g, torch.randn(g.shape, generator=gen, dtype=g.dtype)
                )
                for i, g in enumerate(row)
            ]
        )
    return out


def loads(owned: Owners, p: int, per_param: list[int], scalars: list[int]) -> list[int]:
    """Per rank, the bytes of optimizer state its elements need: of each parameter's state
    (``per_param``), the share of the elements it owns, and the parameter's scalars (such as
    ``step``) whole if it owns any of it."""
    numels = [o.numel() for o in owned.of]
    return [
        sum(
            (c * (state - scalar)) // n + (scalar if c else 0)
            for c, state, scalar, n in zip(row, per_param, scalars, numels, strict=True)
        )
        for row in owned.counts(p)
    ]


@dataclass(frozen=True)
class Stepped:
    """What a rank's :func:`grader.scenarios.data_parallel.sharded` saw: every parameter after
    each step, and after each ``zero_grad()`` the parameters still holding a nonzero gradient."""

    params: tuple[tuple[Tensor, ...], ...]
    kept: tuple[tuple[int, ...], ...]

    @classmethod
    def read(cls, tree: Any, steps: int, count: int) -> Stepped:
        """The record of ``tree``, a rank's return for ``steps`` steps of ``count`` parameters;
        ProtocolError unless it has exactly that structure."""
        fields = {
            "params": list_of(list_of(read_tensor, count), steps),
            "kept": list_of(list_of(read_index), steps),
        }
        return cls(**read_record(tree, fields))


def stepped(returned: Sequence[Any], steps: int, count: int, case: str) -> list[Stepped]:
    """Every rank's :class:`Stepped` (:func:`~grader.testkit.observed.read_every_rank`)."""
    return read_every_rank(
        returned, lambda tree: Stepped.read(tree, steps, count), "data_parallel.sharded", case
    )
