"""Verdicts of the fully_sharded graded tests on the reference, stubs and broken submissions.

Each broken submission (``submissions/fsdp_*``) fails in one way; the tests assert the verdict
a careful TA would give: the test that fails, its outcome and the cause its message names.
Each is graded once, at world size 2 (every model size but some is then odd: padding
matters), on the tests that show its fault.
"""

from __future__ import annotations

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
