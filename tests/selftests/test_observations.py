"""Each scenario's observation record, read on the trusted side from forged returns.

A scenario runs in the rank's process, so what it returns is the submission's word: the
records of :mod:`grader.testkit.data_parallel`, :mod:`~grader.testkit.zero`,
:mod:`~grader.testkit.shards`, :mod:`~grader.testkit.tensor_parallel` and
:mod:`~grader.testkit.pipeline_parallel` read it, and anything but the scenario's structure
is the rank's broken protocol in one line, never a KeyError or TypeError of the grader's.
(The fully sharded record has its own, in ``test_fully_sharded_verdicts.py``.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from grader.failures import Cause, CommunicationError
from grader.protocol import ProtocolError
from grader.testkit import data_parallel as dp
from grader.testkit import pipeline_parallel as pp
from grader.testkit import tensor_parallel as tp
from grader.testkit import zero
from grader.testkit.observed import list_of, read_every_rank, read_text, read_value
from grader.testkit.shards import Shard

T = torch.zeros(2)


def trained() -> dict:
    grads = [{"embed.weight": T, "frozen.weight": None} for _ in range(dp.STEPS)]
    params = [{"embed.weight": T} for _ in range(dp.STEPS)]
    return {"module": "", "initial": {"scale": T}, "grads": grads, "params": params}


def stepped() -> dict:
    return {"params": [[T, T, T] for _ in range(4)], "kept": [[], [1], [], []]}


def shard() -> dict:
    return {"linear_weight": T, "weight": T, "bias": None, "float64_dtypes": ["torch.float64"] * 2}


def region() -> dict:
    return {"output_type": "Tensor", "output": T, "input_grad": None}


def layer() -> dict:
    held = {"linear_weight": T, "weight": T, "bias": T}
    return {**held, **region(), "weight_grad": T, "bias_grad": None}


def mlp_run() -> dict:
    grads = dict.fromkeys(tp.MLP_GRADS, T)
    return {"has_column": True, "has_row": False, **region(), **grads}


def pp_step() -> dict:
    return {"loss_type": "None", "loss": None, "loss_requires_grad": False, "grads": {"0.bias": T}}


READERS: dict[str, tuple[Callable[[Any], Any], Callable[[], Any]]] = {
    "dp.train": (lambda t: dp.Trained.read(t, dp.STEPS), trained),
    "dp.overlap": (lambda t: dp.Overlapped.read(t, 2), lambda: [{"head.bias": T}] * 2),
    "zero.sharded": (lambda t: zero.Stepped.read(t, 4, 3), stepped),
    "tp.shard": (Shard.read, shard),
    "tp.layer": (tp.LayerRun.read, layer),
    "tp.region": (tp.RegionRun.read, region),
    "tp.mlp_shards": (tp.MlpShards.read, lambda: {"fc1": shard(), "fc2": None}),
    "tp.mlp": (tp.MlpRun.read, mlp_run),
    "tp.construct": (tp.raised, lambda: "in_features=5 is not divisible by 2"),
    "pp.step": (pp.Stepped.read, pp_step),
}


def put(path: tuple, value: Any) -> Callable[[Any], Any]:
    """A forgery that puts ``value`` at ``path`` of the tree (the whole tree at ())."""

    def forge(tree: Any) -> Any:
        if not path:
            return value
        inner = tree
        for key in path[:-1]:
            inner = inner[key]
        inner[path[-1]] = value
        return tree

    return forge


def drop(*path: Any) -> Callable[[Any], Any]:
    """A forgery that removes what is at ``path`` of the tree."""

    def forge(tree: Any) -> Any:
        inner = tree
        for key in path[:-1]:
            inner = inner[key]
        inner.pop(path[-1])
        return tree

    return forge


FORGERIES = {  # (record, forgery, what the message says)
    "dp a list": ("dp.train", put((), [1]), "a list, not a dict of module, initial"),
    "dp no grads": ("dp.train", drop("grads"), "lacks grads"),
    "dp a step short": ("dp.train", drop("params", 0), f"params holds {dp.STEPS - 1} entries"),
    "dp a string gradient": (
        "dp.train",
        put(("grads", 1, "embed.weight"), "x"),
        "grads[1] holds a str where a tensor is due",
    ),
    "dp a None parameter": ("dp.train", put(("params", 0, "embed.weight"), None), "params[0]"),
    "dp trained with a module named": ("dp.train", put(("module",), "Net"), "module names"),
    "dp a module of another kind": ("dp.train", put((), {"module": 3}), "module holds an int"),
    "dp an empty module": ("dp.train", put((), {"module": ""}), "module is empty"),
    "dp overlap a dict": ("dp.overlap", put((), {}), "grads holds a dict where a list is due"),
    "dp overlap an iteration more": ("dp.overlap", put((), [{}] * 3), "3 entries, not 2"),
    "zero a parameter short": ("zero.sharded", drop("params", 2, 0), "params[2] holds 2 entries"),
    "zero a bool kept": ("zero.sharded", put(("kept", 1, 0), True), "kept[1][0] holds a bool"),
    "zero a field more": ("zero.sharded", put(("extra",), 1), "1 key(s) that are not fields"),
    "tp a dtype's name forged": (
        "tp.shard",
        put(("float64_dtypes", 0), "torch.float64 (honest)"),
        "float64_dtypes[0] holds a str where a dtype's name is due",
    ),
    "tp a dtype short": ("tp.shard", drop("float64_dtypes", 1), "1 entries, not 2"),
    "tp no linear weight": ("tp.shard", put(("linear_weight",), None), "linear_weight holds None"),
    "tp a layer without output": ("tp.layer", drop("output"), "lacks output"),
    "tp a string output": ("tp.layer", put(("output",), "y"), "output holds a str"),
    "tp a type of another kind": ("tp.region", put(("output_type",), 1), "output_type holds"),
    "tp a shard a string": ("tp.mlp_shards", put(("fc2",), "x"), "a str, not a dict of"),
    "tp has_column a string": ("tp.mlp", put(("has_column",), "yes"), "has_column holds a str"),
    "tp an mlp gradient missing": ("tp.mlp", drop("fc2 bias"), "lacks fc2 bias"),
    "tp construct a number": ("tp.construct", put((), 3), "what it raised holds an int"),
    "pp a string loss": ("pp.step", put(("loss",), "0.5"), "loss holds a str"),
    "pp grads a list": ("pp.step", put(("grads",), [T]), "grads holds a list where a dict"),
    "pp requires_grad a number": ("pp.step", put(("loss_requires_grad",), 0), "holds an int"),
}


@pytest.mark.parametrize("name", READERS)
def test_an_honest_return_reads_into_its_record(name: str) -> None:
    read, honest = READERS[name]
    read(honest())


def test_the_records_hold_what_was_returned() -> None:
    seen = dp.Trained.read(trained(), dp.STEPS)
    assert seen.grads[0]["frozen.weight"] is None and seen.params[2]["embed.weight"] is T
    assert dp.Trained.read({"module": "NoneType"}, dp.STEPS).module == "NoneType"
    assert zero.Stepped.read(stepped(), 4, 3).kept == ((), (1,), (), ())
    run = tp.MlpRun.read(mlp_run())
    assert run.has_column and not run.has_row and run.grads["fc1 bias"] is T
    assert Shard.read(shard()).held.tensors() == {"weight": T, "bias": None}
    assert tp.raised(None) is None and pp.Stepped.read(pp_step()).grads["0.bias"] is T


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_malformed_return_is_a_protocol_error(forgery: str) -> None:
    record, forge, said = FORGERIES[forgery]
    read, honest = READERS[record]
    with pytest.raises(ProtocolError) as caught:
        read(forge(honest()))
    assert said in str(caught.value)


def test_a_malformed_return_is_the_ranks_broken_protocol_in_one_line() -> None:
    bad = put(("loss",), "0.5")(pp_step())
    with pytest.raises(CommunicationError) as caught:
        pp.steps([pp_step(), bad, bad], "2 microbatches")
    message = str(caught.value)
    assert message == (
        "rank 1: pipeline_parallel.step returned a malformed observation: loss holds a str "
        "where a tensor is due (the same on rank 2) (case: 2 microbatches)"
    )
    assert caught.value.cause is Cause.PROTOCOL


def test_the_path_into_nested_lists_is_named_and_text_is_cleaned() -> None:
    read = list_of(list_of(read_text, 2))
    with pytest.raises(ProtocolError, match=r"^x\[1\]\[0\] holds an int where a str is due$"):
        read_value([["a", "b"], [3, "c"]], "x", read)
    assert read_text("a\x1b[31mb\n\tc") == "ab c"
    with pytest.raises(CommunicationError, match="rank 0: s returned a malformed observation"):
        read_every_rank([1], lambda v: read_value(v, "v", read_text), "s", "")
