"""What a rank's expert_parallel scenario returned, read into one checked record on the
trusted side (:mod:`grader.testkit.observed`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from grader.testkit.observed import (
    dict_of,
    read_every_rank,
    read_record,
    read_tensor_or_none,
    read_type_name,
)


@dataclass(frozen=True)
class Observed:
    """What a rank's :func:`grader.scenarios.expert_parallel.forward_backward` saw, read and
    checked here: the output (None: the layer returned an ``output_type``), the tokens'
    gradient and the layer's parameters' gradients by name (None: no ``.grad``; any names:
    the test says which it lacks)."""

    output_type: str
    output: Tensor | None
    input_grad: Tensor | None
    grads: Mapping[str, Tensor | None]

    @classmethod
    def read(cls, tree: Any) -> Observed:
        """The record of ``tree``, a rank's return; ProtocolError unless it has exactly this
        structure."""
        fields = {
            "output_type": read_type_name,
            "output": read_tensor_or_none,
            "input_grad": read_tensor_or_none,
            "grads": dict_of(read_tensor_or_none),
        }
        return cls(**read_record(tree, fields))


def observations(returned: Sequence[Any], case: str) -> list[Observed]:
    """Every rank's :class:`Observed` (:func:`~grader.testkit.observed.read_every_rank`)."""
    return read_every_rank(returned, Observed.read, "expert_parallel.forward_backward", case)
