"""Every collective form a strategy part may call gives on the broker what it gives on gloo.

``submissions/broker_forms/forms.py`` runs each form (the list forms, ``all_gather_into_tensor``
and ``reduce_scatter_tensor`` with their torch 2.13 names ``all_gather_single`` and
``reduce_scatter_single`` and the old ``_all_gather_base``/``_reduce_scatter_base``,
``all_to_all`` and ``all_to_all_single`` with and without uneven and zero-size splits), blocking
and with ``async_op=True``, on 3 ranks: once through the grader's broker backend, once on
real gloo, and the outputs must be the same tensors (or the same refusal).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from runner import SUBMISSIONS

from grader import sandbox
from grader.course.submission import stage
from grader.device import Device
from grader.launch.job import job_settings
from grader.launch.world import CallLimits, RankPool
from grader.protocol import CallRequest

FORMS = SUBMISSIONS / "broker_forms"
P = 3


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The same forms on real gloo, in a job of their own (``python forms.py``)."""
    out = tmp_path_factory.mktemp("gloo") / "gloo.pt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, str(FORMS / "forms.py"), str(P), str(port), str(out)]
    subprocess.run(command, check=True, timeout=180, capture_output=True)
    return torch.load(out)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    work = tmp_path_factory.mktemp("forms")
    stage(FORMS, work / "import")
    pool = RankPool(P, job_settings(work, sandbox.Level.NONE, Device.CPU))
    try:
        out = pool.call(CallRequest(P, "forms.run_forms", [()] * P), CallLimits(timeout=60))
        yield out.returned
    finally:
        pool.close()


def _forms() -> list[str]:
    sys.path.insert(0, str(FORMS))
    import forms

    return [f"{name}{suffix}" for name in forms.FORMS for suffix in ("", " async")]


@pytest.mark.parametrize("form", _forms())
def test_form_gives_gloos_result(form: str, gloo: list, broker: list) -> None:
    for rank in range(P):
        want, got = gloo[rank][form], broker[rank][form]
        assert isinstance(want, list), f"gloo refused {form}: {want}"
        assert isinstance(got, list), f"rank {rank}: the broker refused {form}: {got}"
        assert len(got) == len(want), f"rank {rank}: {form}: {len(got)} outputs, gloo {len(want)}"
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape, f"rank {rank}: {form}: {g} vs {w}"
            assert torch.equal(g, w), f"rank {rank}: {form}: broker {g.tolist()}, gloo {w.tolist()}"
