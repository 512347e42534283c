"""What a rank's pipeline step returned, read on the trusted side into one checked record.

The scenario (:func:`grader.scenarios.pipeline_parallel.step`) runs in the rank's process, so
its return is the submission's word: :class:`Stepped` reads it, and a malformed one is the
rank's broken protocol (:func:`~grader.testkit.observed.read_every_rank`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from grader.testkit.observed import (
    dict_of,
    or_none,
    read_bool,
    read_every_rank,
    read_record,
    read_tensor,
    read_text,
)

FIELDS = {  # each field of the record, and its reader
    "loss_type": read_text,
    "loss": or_none(read_tensor),
    "loss_requires_grad": read_bool,
    "grads": dict_of(or_none(read_tensor)),
}


@dataclass(frozen=True)
class Stepped:
    """What a rank's step saw: the type the schedule returned ("None" for None), the loss (None:
    not a tensor) and whether it requires grad, and each parameter's gradient of the stage by
    name (None: no ``.grad``; any names: the test says which are missing)."""

    loss_type: str
    loss: Tensor | None
    loss_requires_grad: bool
    grads: Mapping[str, Tensor | None]

    @classmethod
    def read(cls, tree: Any) -> Stepped:
        """The record of ``tree``; ProtocolError unless it has exactly that structure."""
        return cls(**read_record(tree, FIELDS))


def steps(returned: Sequence[Any], case: str) -> list[Stepped]:
    """Every rank's :class:`Stepped` (:func:`~grader.testkit.observed.read_every_rank`)."""
    return read_every_rank(returned, Stepped.read, "pipeline_parallel.step", case)
