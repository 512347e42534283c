"""The built-in collectives, computed by the broker from every rank's contribution.

Only the strategy parts may call them (data, tensor and pipeline
parallelism build on collectives the course has already taught). The
results are what gloo or NCCL would give: the reduction runs in the
tensors' own dtype, in rank order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from grader.broker import rules
from grader.protocol import OpName

if TYPE_CHECKING:
    from grader.broker.ops import Op

REDUCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": torch.add,
    "avg": torch.add,  # divided by the group size afterwards
    "product": torch.mul,
    "max": torch.maximum,
    "min": torch.minimum,
    "band": torch.bitwise_and,
    "bor": torch.bitwise_or,
    "bxor": torch.bitwise_xor,
}
#: The collectives with a root, and how a message names it: a broadcast or a scatter starts at
#: it, a reduce or a gather ends there.
ROOTED = {
    OpName.BROADCAST: "from",
    OpName.SCATTER: "from",
    OpName.REDUCE: "to",
    OpName.GATHER: "to",
}


def reduce(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    result = tensors[0].clone()
    for tensor in tensors[1:]:
        result = REDUCTIONS[op](result, tensor)
    if op == "avg":
        result = result / len(tensors) if result.is_floating_point() else result // len(tensors)
    return result


def compute(
    name: str, inputs: list[list[torch.Tensor]], root: int, op: str
) -> list[list[torch.Tensor]]:
    """Every member's outputs, from every member's inputs (both in group order)."""
    p = len(inputs)
    if name == OpName.BARRIER:
        return [[] for _ in range(p)]
    if name == OpName.ALL_REDUCE:
        reduced = [reduce([inputs[r][i] for r in range(p)], op) for i in range(len(inputs[0]))]
        return [list(reduced) for _ in range(p)]
    if name == OpName.BROADCAST:
        return [list(inputs[root]) for _ in range(p)]
    if name == OpName.REDUCE:  # the others' tensors are left as they were
        reduced = [reduce([inputs[r][i] for r in range(p)], op) for i in range(len(inputs[0]))]
        return [reduced if s == root else list(inputs[s]) for s in range(p)]
    if name == OpName.GATHER:
        return [[inputs[r][0] for r in range(p)] if s == root else [] for s in range(p)]
    if name == OpName.SCATTER:
        return [[inputs[root][s]] for s in range(p)]
    if name == OpName.ALL_GATHER:
        return [[inputs[r][0] for r in range(p)] for _ in range(p)]
    if name == OpName.REDUCE_SCATTER:
        return [[reduce([inputs[r][s] for r in range(p)], op)] for s in range(p)]
    if name == OpName.ALL_TO_ALL:
        return [[inputs[r][s] for r in range(p)] for s in range(p)]
    raise ValueError(f"the broker does not provide {name}")


def produced(members: list[Op]) -> int:
    """The bytes of results :func:`compute` makes for ``members`` (every member's outputs
    together), from their inputs' sizes, before anything is computed."""
    sizes = [[len(buffer) for buffer in op.payload] for op in members]
    p, kind = len(members), members[0].kind
    if kind == OpName.ALL_GATHER:  # every member gets every member's tensor
        return p * sum(inputs[0] for inputs in sizes if inputs)
    if kind in (OpName.REDUCE_SCATTER, OpName.ALL_TO_ALL):  # each piece lands once, or one sum of p
        return sum(map(sum, sizes)) // (p if kind == OpName.REDUCE_SCATTER else 1)
    if kind == OpName.BROADCAST:  # every member gets the root's tensors
        root = members[0].collective.root
        return p * sum(sizes[root]) if 0 <= root < p else 0
    return p * max(map(sum, sizes), default=0)  # all_reduce: every member gets one sum


class CollectiveError(ValueError):
    """The members of a collective disagree, or their contributions cannot be combined."""


def run(members: list[Op]) -> list[list[torch.Tensor]]:
    """Every member's outputs for one collective, after checking that the members agree."""
    from grader.broker.ops import describe_collective, tensor_of

    first = members[0]
    for op in members:
        refused = rules.refusal(op.kind, op.collective, len(members))
        if refused is not None:
            raise CollectiveError(f"rank {op.rank}: {refused} (at {op.at or '?'})")

    def signature(op: Op) -> tuple:
        call = op.collective  # an all-to-all's pieces may differ in size from rank to rank
        # and only a scatter's root has inputs
        return (op.kind, call.root, call.reduce_op,
                len(call.inputs) if op.kind == OpName.ALL_TO_ALL else
                call.outputs if op.kind == OpName.SCATTER else call.inputs)  # fmt: skip

    for op in members[1:]:
        if signature(op) != signature(first):
            raise CollectiveError(
                f"the ranks disagree on a collective: rank {first.rank} calls "
                f"{describe_collective(first)} while rank {op.rank} calls {describe_collective(op)}"
            )
    if first.kind == OpName.ALL_TO_ALL:
        _check_splits(members)
    root = first.collective.root
    if first.kind in ROOTED and not 0 <= root < len(first.group):
        raise CollectiveError(f"{first.kind} {ROOTED[first.kind]} rank {root}, outside the group")
    try:
        inputs = [
            [tensor_of(m, buf) for m, buf in zip(op.collective.inputs, op.payload, strict=True)]
            for op in members
        ]
        return compute(first.kind, inputs, root, first.collective.reduce_op)
    except (ValueError, RuntimeError, IndexError, KeyError) as err:
        raise CollectiveError(f"{first.kind} failed: {err}") from None


def _check_splits(members: list[Op]) -> None:
    """In an all-to-all, what rank r sends to rank s is what s expects from r (gloo aborts the
    process otherwise): receive sizes that do not come from the exchanged counts are named."""
    for op in members:
        call = op.collective
        if len(call.inputs) != len(members) or len(call.outputs) != len(members):
            raise CollectiveError(
                f"all_to_all: rank {op.rank} gives {len(call.inputs)} input and "
                f"{len(call.outputs)} output pieces for a group of {len(members)} ranks "
                f"(at {op.at or '?'})"
            )
    for sender, op in enumerate(members):
        for receiver, target in enumerate(members):
            sent = op.collective.inputs[receiver]
            expected = target.collective.outputs[sender]
            if (sent.numel, sent.dtype) != (expected.numel, expected.dtype):
                raise CollectiveError(
                    f"all_to_all: rank {op.rank} sends {sent} to rank {target.rank} (at "
                    f"{op.at or '?'}), which expects {expected} from it (at {target.at or '?'}): "
                    "each rank's output split sizes must be what the others send it (exchange "
                    "the counts first)"
                )
