"""Verdicts of the fully_sharded graded tests on the reference, stubs and broken submissions.

Each broken submission (``submissions/fsdp_*``) fails in one way; the tests assert the verdict
a careful TA would give: the test that fails, its outcome and the cause its message names.
Each is graded once, at world size 2 (every model size but some is then odd: padding
matters), on the tests that show its fault.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from forgeries import assert_broken_protocol, assert_earns_nothing

from grader.testkit import data
from grader.testkit.fully_sharded import (
    NUMEL,
    REPLICATED,
    SHARDED_PARAMS,
    STEPS,
    initial_state,
    observations,
    rank_state,
    shard_size,
)

PART = "fully_sharded"
CASES = [f"{o}-{d}" for o in ("sgd", "adamw") for d in ("float32", "float16", "bfloat16")]
NAMES = (
    [f"training[{c}]" for c in CASES]
    + [f"gradient_shards[{d}]" for d in ("float32", "float16")]
    + [f"memory_at_rest[{d}]" for d in ("float32", "bfloat16")]
    + [f"communication[{d}]" for d in ("float32", "float16")]
)


def test_reference_passes_everything(grade) -> None:
    graded = grade("reference")  # every part, shared with the other files' tests
    assert graded.returncode == 0, graded.stdout + graded.stderr
    mine = [t for t in graded.tests if t["extra_data"]["part"] == PART]
    assert {t["extra_data"]["outcome"] for t in mine} == {"passed"}
    names = {t["extra_data"]["test"] for t in mine}
    assert names == set(NAMES)
    assert len(mine) == 6 * 4 + 2 * 4 + 2 * 3 + 2 * 3
    assert abs(sum(t["score"] for t in mine) - 10) < 1e-9


def test_stubs_fail_everything_as_not_implemented(grade) -> None:
    graded = grade("stubs")  # every part, shared with the other files' tests
    mine = [t for t in graded.tests if t["extra_data"]["part"] == PART]
    assert len(mine) == 6 * 4 + 2 * 4 + 2 * 3 + 2 * 3
    for test in mine:
        assert test["extra_data"]["outcome"] == "failed", test["name"]
        assert "not implemented" in test["output"], test["name"]
        assert "FullyShardedDataParallel.__init__" in test["output"], test["name"]
        assert test["score"] == 0


def failed_because(graded, name: str, *causes: str, outcome: str = "failed") -> None:
    """``name`` at world size 2 has ``outcome``, and its message names every one of ``causes``."""
    message = graded.message(name, 2)
    assert graded.outcome(name, 2) == outcome, (name, message)
    for cause in causes:
        assert cause in message, message


def test_no_division_by_p_is_named(grade) -> None:
    graded = grade("fsdp_no_division", PART, k="gradient_shards", world_sizes=(2,))
    failed_because(graded, "gradient_shards[float32]", "2x the mean: divide the sum by p")


def test_padding_leaking_into_weights_fails_training(grade) -> None:
    graded = grade("fsdp_padding_leaks", PART, k="training", world_sizes=(2,))
    for case in ("sgd-float32", "adamw-float32"):
        failed_because(graded, f"training[{case}]", "padding of the last shard")


def test_gradient_padding_not_zeroed_is_named(grade) -> None:
    """Garbage in the padding of the flat gradient: only the last shard's padding is wrong,
    and the message says so (not "off the mean gradient by" a figure alone)."""
    graded = grade("fsdp_padding_from_empty", PART, k="gradient_shards", world_sizes=(2,))
    for dtype in ("float32", "float16"):
        failed_because(
            graded, f"gradient_shards[{dtype}]", "rank 1: ", "(only the padding is wrong: "
        )


def test_full_weights_kept_after_forward_fail_memory(grade) -> None:
    graded = grade("fsdp_keeps_full_weights", PART, k="memory", world_sizes=(2,))
    for dtype in ("float32", "bfloat16"):
        failed_because(
            graded, f"memory_at_rest[{dtype}]", "the backward gathers no", "freed after forward"
        )


def test_full_weights_kept_by_the_wrapper_fail_memory_by_the_kernel(grade) -> None:
    """Full weights kept in a list of the wrapper's own: the parameters' shapes and the
    broker's record are right; the rank's memory, as the kernel counts it, is not."""
    graded = grade("fsdp_keeps_in_a_list", PART, k="memory", world_sizes=(2,))
    for dtype, full in (("float32", "32"), ("bfloat16", "16")):
        failed_because(
            graded,
            f"memory_at_rest[{dtype}]",
            "after step 1's forward returned",
            f"the full weights weigh {full} MiB",
            "nor the wrapper's own references",
        )
    full_marks = grade("reference", PART, k="memory", world_sizes=(2,))
    assert {full_marks.outcome(f"memory_at_rest[{d}]", 2) for d in ("float32", "bfloat16")} == {
        "passed"
    }


def test_reduce_scatters_deferred_past_the_backward_fail_communication(grade) -> None:
    """Every reduce-scatter posted in finish_gradient_synchronization(): right values and
    bytes, but the gates in the backward show that none overlapped it."""
    graded = grade("fsdp_deferred_reduce_scatter", PART, k="communication", world_sizes=(2,))
    for dtype in ("float32", "float16"):
        failed_because(
            graded,
            f"communication[{dtype}]",
            "the reduce-scatter of head.weight, head.bias was not posted before fc2's backward",
            "not in finish_gradient_synchronization()",
        )


def test_everything_gathered_up_front_fails_only_communication(grade) -> None:
    graded = grade("fsdp_gathers_up_front", PART, k="float32]", world_sizes=(2,))
    assert graded.outcome("memory_at_rest[float32]", 2) == "passed"
    failed_because(graded, "communication[float32]", "prefetch at most two layers ahead")


def test_backward_gathers_in_forward_order(grade) -> None:
    graded = grade("fsdp_backward_forward_order", PART, k="communication", world_sizes=(2,))
    order = "backward gathers the layers in the order ['fc1', 'fc2', 'head']"
    failed_because(graded, "communication[float32]", order)


def test_gradients_reduced_in_float16(grade) -> None:
    graded = grade("fsdp_grads_float16", PART, k="communication", world_sizes=(2,))
    assert graded.outcome("communication[float32]", 2) == "passed"
    cause = "carries float16: gradients are reduce-scattered in float32"
    failed_because(graded, "communication[float16]", cause)


def test_gradients_all_reduced_at_full_shape(grade) -> None:
    graded = grade("fsdp_grads_full_shape", PART, k="communication", world_sizes=(2,))
    failed_because(graded, "communication[float32]", "all-reduced in full: reduce-scatter")


def test_cast_after_communication(grade) -> None:
    graded = grade("fsdp_cast_after_gather", PART, world_sizes=(2,))
    assert graded.outcome("communication[float32]", 2) == "passed"
    for name in ("memory_at_rest[bfloat16]", "communication[float16]"):
        failed_because(graded, name, "cast BEFORE communicating")


def test_indivisible_parameter_count(grade) -> None:
    graded = grade("fsdp_assumes_divisible", PART, k="sgd-float32", world_sizes=(2,))
    disagree = "the ranks disagree on a collective: rank 0 calls all_gather of "
    failed_because(graded, "training[sgd-float32]", disagree, outcome="error")


def test_decoy_gathers_in_the_backward_carry_no_shard(grade) -> None:
    """Full weights kept for backward, zeros of each shard's size gathered in reverse order
    where the reference gathers: the sizes and the order are right, the content is not."""
    graded = grade("fsdp_decoy_gathers", PART, k="]", world_sizes=(2,))
    decoy = (
        " in _decoy is the size of head.weight's shard but does not carry this rank's shard "
        "of it (the broker's record of what it carried)"
    )
    for name in ("memory_at_rest[float32]", "memory_at_rest[bfloat16]", "communication[float32]"):
        failed_because(graded, name, decoy)
    assert graded.outcome("training[sgd-float32]", 2) == "passed"


def test_forged_layer_marks_do_not_place_the_gathers(grade) -> None:
    """Every layer gathered up front, with the marks an earlier grader read posted after each
    layer's gathers: the gates where the layers take their inputs place them."""
    graded = grade("fsdp_forged_marks", PART, k="float32]", world_sizes=(2,))
    assert graded.outcome("memory_at_rest[float32]", 2) == "passed"
    failed_because(graded, "communication[float32]", "prefetch at most two layers ahead")


def test_each_rank_is_handed_the_model_in_its_own_shards_only() -> None:
    """Rank r's module holds the model's values exactly in its flat shard [r*s, (r+1)*s) of
    each sharded parameter, and at no element outside it, where its values are at the same
    scale; the replicated parameters whole; another world size's model shares no value."""
    data.configure(b"a course's secret", "shards")
    assert rank_state(1, 0).keys() == initial_state(1).keys()
    for p in (2, 3, 4):
        model = initial_state(p)
        assert not any(torch.equal(model[n], initial_state(p - 1)[n]) for n in model)
        for r in range(p):
            given = rank_state(p, r)
            for name in SHARDED_PARAMS:
                s, want = shard_size(name, p), model[name].reshape(-1)
                got = given[name].reshape(-1)
                mine = torch.zeros(len(want), dtype=torch.bool)
                mine[r * s : (r + 1) * s] = True
                assert torch.equal(got[mine], want[mine]), (p, r, name)
                assert int((got[~mine] == want[~mine]).sum()) == 0, (p, r, name)
                if int((~mine).sum()) >= 30:  # the same scale: not told apart by it
                    assert 0.5 < float(got[~mine].std() / want.std()) < 2, (p, r, name)
            assert all(torch.equal(given[n], model[n]) for n in REPLICATED)


def test_a_replica_broadcast_from_rank_0_earns_no_correctness_point(grade) -> None:
    """The reference, its module made rank 0's by broadcasts before sharding: each rank is
    handed the model's values in its own shards only, so rank 1 keeps a shard of rank 0's
    values that are not the model's, trains on them, and earns nothing; its first step's
    gathers carry that shard, not the model's."""
    graded = grade("fsdp_replica_from_rank0", PART, world_sizes=(2,))
    for name in NAMES:
        assert graded.test(name, 2)["score"] == 0, (name, graded.message(name, 2))
    failed_because(graded, "training[sgd-float32]", "from rank 0's module as handed")
    failed_because(graded, "gradient_shards[float32]", "off the mean gradient")
    failed_because(graded, "memory_at_rest[float32]", "does not carry this rank's shard of it")


def honest_observation() -> dict[str, Any]:
    """What an unpatched scenario returns, in the form the wire decodes it to."""
    shapes = {name: [n] for name, n in NUMEL.items()}
    grads = {name: torch.zeros(n) for name, n in NUMEL.items()}
    return {
        "grads": [dict(grads) for _ in range(STEPS)],
        "after_forward": [dict(shapes) for _ in range(STEPS)],
        "at_rest": [dict(shapes) for _ in range(STEPS + 1)],
        "full": {name: torch.zeros(n) for name, n in NUMEL.items()},
    }


def _parent(tree: dict, path: tuple) -> Any:
    for key in path[:-1]:
        tree = tree[key]
    return tree


def _set(path: tuple, value: Any) -> Callable[[dict], dict]:
    """A forgery that puts ``value`` at ``path`` of the tree."""

    def forge(tree: dict) -> dict:
        _parent(tree, path)[path[-1]] = value
        return tree

    return forge


def _drop(*path: Any) -> Callable[[dict], dict]:
    """A forgery that removes what is at ``path`` of the tree."""

    def forge(tree: dict) -> dict:
        _parent(tree, path).pop(path[-1])
        return tree

    return forge


FORGERIES: dict[str, tuple[Callable[[dict], Any], str]] = {
    "a list": (lambda t: list(t.values()), "observation: a list, not a dict of grads"),
    "an empty dict": (lambda t: {}, "lacks after_forward and 3 more"),
    "no grads": (_drop("grads"), "observation: lacks grads"),
    "a field more": (_set(("extra",), 1), "holds 1 key(s) that are not fields"),
    "a step short": (_drop("grads", 0), f"grads holds {STEPS - 1} entries, not {STEPS}"),
    "a step of another kind": (_set(("at_rest", 1), [1]), "at_rest[1] is a list, not a dict"),
    "a string for a gradient": (
        _set(("grads", 1, "fc1.weight"), "x"),
        "grads[1] holds a str where a tensor or None is due",
    ),
    "a parameter missing": (_drop("at_rest", 0, "head.bias"), "at_rest[0] lacks head.bias"),
    "a parameter more": (_set(("grads", 0, "x"), None), "grads[0] holds 1 key(s) that are not"),
    "a float in a shape": (_set(("after_forward", 2, "fc2.bias"), [1.5]), "a shape is due"),
    "a bool in a shape": (_set(("after_forward", 0, "fc2.bias"), [True]), "a shape is due"),
    "a number in full": (_set(("full", "fc1.bias"), 3.0), "full holds a float where a tensor"),
    "full a string": (_set(("full",), "x"), "full is a str, not None or a dict"),
}


def test_an_honest_observation_reads_into_the_record() -> None:
    """No gradient yet (None) and a gather_full_params() that returned no dict are the
    submission's to be judged on by the tests, not malformed returns."""
    tree = _set(("grads", 0, "fc1.bias"), None)(_set(("full",), None)(honest_observation()))
    (seen,) = observations([tree], "")
    assert seen.full is None and seen.grads[0]["fc1.bias"] is None
    assert torch.equal(seen.grads[1]["fc1.bias"], tree["grads"][1]["fc1.bias"])
    assert len(seen.at_rest) == STEPS + 1 and seen.after_forward[0]["fc1.weight"] == (230,)


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_malformed_observation_is_the_ranks_broken_protocol(forgery: str) -> None:
    """The trusted side reads each rank's return into one checked record: a malformed one fails
    in one line, the lowest rank's, charged to the submission as a protocol fault."""
    assert_broken_protocol(
        observations, honest_observation, FORGERIES[forgery], "fully_sharded.train"
    )


def test_a_forged_observation_earns_nothing(grade) -> None:
    """The scenario's result rewritten in the rank's process (a string where a gradient is
    due): every test that reads it fails in one line naming the malformed return, never a
    KeyError of the grader's; communication, judged on the broker's record alone, passes."""
    graded = grade("fsdp_forged_observation", PART, k="float32]", world_sizes=(2,))
    said = (
        "rank 0: fully_sharded.train returned a malformed observation: grads[0] holds a str "
        "where a tensor or None is due (the same on rank 1)"
    )
    names = ["training[sgd-float32]", "training[adamw-float32]", "gradient_shards[float32]"]
    for name in [*names, "memory_at_rest[float32]"]:
        assert_earns_nothing(graded.test(name, 2), said)
    assert graded.outcome("communication[float32]", 2) == "passed"
