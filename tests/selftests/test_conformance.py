"""What passes on the broker works on real gloo, and what fails there fails here with the
same cause: every variant of ``submissions/conformance/variants.py`` (a call the student API
allows, with one argument form each) runs on 3 real gloo processes and through the grader's
broker, and the outcomes must agree (see :func:`conformance.disagreement`).

The rules where the grader is stricter than gloo on purpose are docs/conformance.md's.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conformance import TABLE, Outcome, disagreement, on_broker, on_gloo

from grader.broker import rules
from grader.protocol import ProtocolError, TensorMeta
from grader.rank import backend

sys.path.insert(0, str(TABLE))
import variants

P = 3
NAMES = [v.name for v in variants.VARIANTS]


@pytest.fixture(scope="module")
def outcomes(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Outcome], dict[str, Outcome]]:
    """Every variant on gloo and on the broker, side by side: gloo's ranks spend much of their
    time waiting out the variants that hang them, which the broker's calls use."""
    with ThreadPoolExecutor(1) as pool:
        gloo = pool.submit(on_gloo, len(NAMES), P, tmp_path_factory.mktemp("gloo"))
        broker = on_broker(NAMES, P, tmp_path_factory.mktemp("broker"))
        return dict(zip(NAMES, gloo.result(), strict=True)), broker


def test_variant_names_are_unique() -> None:
    assert len(set(NAMES)) == len(NAMES), "two variants share a name"


@pytest.mark.parametrize("name", NAMES)
def test_broker_agrees_with_gloo(name: str, outcomes: tuple[dict, dict]) -> None:
    gloo, broker = outcomes
    problem = disagreement(variants.BY_NAME[name], gloo[name], broker[name])
    assert problem is None, f"{name}: {problem}"


VIEWS = {
    "contiguous": lambda: torch.zeros(2, 3),
    "transposed": lambda: torch.zeros(3, 2).T,
    "rows of a matrix": lambda: torch.zeros(4, 3)[1:3],
    "columns of a matrix": lambda: torch.zeros(2, 4)[:, 1:3],
    "every other element": lambda: torch.zeros(8)[::2],
    "expanded": lambda: torch.zeros(3, 1).expand(3, 4),
    "a column": lambda: torch.zeros(3, 4)[:, :1],
    "empty": lambda: torch.zeros(3, 0),
    "0-d": lambda: torch.tensor(1.0),
}


@pytest.mark.parametrize("view", VIEWS)
def test_the_broker_reads_a_views_layout_as_torch_does(view: str) -> None:
    """The broker decides from the shape and strides a rank reports: contiguous as torch
    says, dense where the elements fill one block of memory exactly once."""
    t = VIEWS[view]()
    meta = TensorMeta.read(backend._meta(t))
    offsets = torch.zeros(t.shape, dtype=torch.long)  # each element's place in memory
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride(), strict=True)):
        shape = [1] * t.dim()
        shape[dim] = size
        offsets = offsets + (torch.arange(size) * stride).view(shape)
    filled = sorted(offsets.reshape(-1).tolist())
    block = list(range(filled[0], filled[0] + len(filled))) if filled else []
    assert rules.contiguous(meta) == t.is_contiguous()
    assert rules.dense(meta) == (filled == block)


def test_a_rank_cannot_describe_a_tensor_of_another_size() -> None:
    with pytest.raises(ProtocolError):
        TensorMeta.read({"dtype": "float32", "numel": 6, "shape": [2, 2], "strides": [2, 1]})
