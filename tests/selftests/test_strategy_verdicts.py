"""Verdicts of the data_parallel and tensor_parallel graded tests.

The reference must pass every test of both parts, the stubs fail every one as "not
implemented". Each broken submission (``submissions/dp_*``, ``submissions/tp_*``) fails in
one way: the tests assert the verdict a careful TA would give (which tests fail, the first
thing the message tells the student to fix) and that every other test of the part passes.
One world size each keeps them cheap: a grader run costs 10-30 s here.
"""

from __future__ import annotations

from typing import Any

from runner import Graded

DP, TP = "data_parallel", "tensor_parallel"
BUCKETS = {"per_parameter": "0", "few_buckets": "0.000572205", "one_bucket": "25"}
TRAINING = [f"data_parallel_training[{o}-{b}]" for o in ("sgd", "adamw") for b in BUCKETS]
OVERLAP = [f"overlap[{b}]" for b in BUCKETS]
SHARDED = ["sharded_optimizer[sgd_momentum]", "sharded_optimizer[adamw]"]
ROW = [f"row_parallel_linear[input_is_parallel={v}]" for v in (True, False)]
EXPECTED = {  # every entry of results.json, by (name, world size)
    DP: {(n, w) for n in TRAINING + SHARDED for w in (1, 2, 4)}
    | {(n, w) for n in [*OVERLAP, "sharded_optimizer_state"] for w in (2, 4)},
    TP: {
        (n, w)
        for n in [
            *(f"column_parallel_linear[gather_output={v}]" for v in (False, True)),
            *ROW,
            *(f"region_function[{f}_parallel_region]" for f in ("copy_to", "reduce_from")),
            *(f"region_function[{f}_parallel_region]" for f in ("gather_from", "scatter_to")),
            "parallel_mlp",
            "indivisible_dimension[ColumnParallelLinear]",
            "indivisible_dimension[RowParallelLinear]",
        ]
        for w in (1, 2, 4)
    }
    | {("parallel_mlp_communication", w) for w in (2, 4)},
}


def entries(graded: Graded, part: str) -> dict[tuple[str, int], dict[str, Any]]:
    """The part's results.json entries by (test name, world size)."""
    return {
        (e["name"].split(": ", 1)[1].rsplit(" (world size", 1)[0], e["extra_data"]["world_size"]): e
        for e in graded.tests
        if e["extra_data"]["part"] == part
    }


def assert_only_these_fail(
    graded: Graded, part: str, failing: list[str], not_graded: tuple[str, ...] = ()
) -> None:
    """``failing`` fail, ``not_graded`` (costs of a failing target) are not run, the rest pass."""
    found = entries(graded, part)
    assert found, graded.stdout + graded.stderr
    for (name, size), entry in found.items():
        expected = "failed" if name in failing else "not_run" if name in not_graded else "passed"
        assert entry["extra_data"]["outcome"] == expected, (name, size, entry["output"])


def test_reference_passes_both_parts(grade) -> None:
    graded = grade("reference")
    for part in (DP, TP):
        found = entries(graded, part)
        assert set(found) == EXPECTED[part], graded.stdout + graded.stderr
        for key, entry in found.items():
            assert entry["status"] == "passed", (key, entry["output"])
        assert sum(e["score"] for e in found.values()) == 10
    overlap = entries(graded, DP)[("overlap[few_buckets]", 4)]["extra_data"]
    assert overlap["all_reduces"] == [3, 3] and overlap["all_reduce_bytes"] == [128, 512, 512]
    assert overlap["first_all_reduce_before_backward_returned_ms"] > 0
    state = entries(graded, DP)[("sharded_optimizer_state", 2)]["extra_data"]
    assert sum(state["state_bytes_per_rank"]) == state["unsharded_state_bytes"]  # each state once
    assert max(state["state_bytes_per_rank"]) <= state["allowed_bytes_per_rank"]
    calls = entries(graded, TP)[("parallel_mlp_communication", 4)]["extra_data"]
    assert calls["forward_calls"] == calls["backward_calls"] == {"all_reduce": 1}


def test_stubs_fail_both_parts_as_not_implemented(grade) -> None:
    graded = grade("stubs")
    for part in (DP, TP):
        found = entries(graded, part)
        assert set(found) == EXPECTED[part], graded.stdout + graded.stderr
        for key, entry in found.items():
            assert entry["score"] == 0
            if entry["extra_data"]["kind"] == "communication":
                # What code costs is graded only once the code works.
                assert entry["extra_data"]["outcome"] == "not_run", key
                assert entry["output"].startswith("not graded: "), (key, entry["output"])
                continue
            assert entry["extra_data"]["outcome"] == "failed", key
            assert "not implemented" in entry["output"], (key, entry["output"])


def test_summed_gradients_fail_training_with_the_averaging_hint(grade) -> None:
    graded = grade("dp_sums_not_averages", DP, world_sizes=(2,))
    assert_only_these_fail(graded, DP, TRAINING)
    for name in TRAINING:
        optimizer = "AdamW" if "adamw" in name else "SGD"
        size = BUCKETS[name.split("-")[1][:-1]]
        assert graded.test(name, 2, DP)["output"] == (
            f"rank 0: DataParallel(bucket_size_mb={size}) with {optimizer} on 2 ranks, step 1, "
            "after synchronization: every gradient is 2x the one-process gradient: the "
            "gradients were summed over the 2 ranks, not averaged (divide by the world size) "
            "(the same on rank 1)"
        )


def test_missing_broadcast_fails_training_before_step_1(grade) -> None:
    graded = grade("dp_no_initial_broadcast", DP, world_sizes=(2,))
    assert_only_these_fail(graded, DP, TRAINING)
    for name in TRAINING:
        message = graded.test(name, 2, DP)["output"]
        assert message.startswith("rank 0: DataParallel(bucket_size_mb="), message
        assert (
            "right after DataParallel(model), rank 1's parameter embed.weight differs from rank "
            "0's by " in message
        )
        assert "must make every rank's parameters and buffers equal to rank 0's" in message
        assert "(broadcast them; the ranks were seeded differently)" in message


def test_reducing_after_backward_fails_only_the_overlap_schedule(grade) -> None:
    graded = grade("dp_no_overlap", DP, world_sizes=(2,))
    assert_only_these_fail(graded, DP, OVERLAP)
    for name, count in zip(OVERLAP, (4, 3, 1), strict=True):
        entry = graded.test(name, 2, DP)
        extra = entry["extra_data"]
        assert extra["kind"] == "schedule"
        assert extra["all_reduces"] == [count]  # the buckets are right, only late
        assert extra["first_all_reduce_before_backward_returned_ms"] < 0
        assert entry["output"].startswith(
            f"rank 0: DataParallel(bucket_size_mb={BUCKETS[name[8:-1]]}) on 2 ranks, iteration "
            "1: the first gradient all-reduce was called "
        ), entry["output"]
        assert (
            " ms after loss.backward() returned, so no communication overlapped the backward "
            "pass: launch each bucket's all-reduce (async_op=True) from a gradient hook"
        ) in entry["output"]


def test_tied_weight_counted_twice_fails_training_naming_it(grade) -> None:
    graded = grade("dp_tied_weight_twice", DP, world_sizes=(4,))
    assert_only_these_fail(graded, DP, TRAINING)
    for name in TRAINING:
        message = graded.test(name, 4, DP)["output"]
        assert "on 4 ranks, step 1, after synchronization: the tied weight embed.weight " in message
        assert "(also head.weight) has 2x its gradient while the others are right" in message
        assert "summed" not in message and message.endswith("(the same on ranks 1, 2, 3)")


def test_bias_on_every_rank_fails_row_parallel_and_mlp_outputs(grade) -> None:
    graded = grade("tp_bias_every_rank", TP, world_sizes=(2,))
    assert_only_these_fail(
        graded, TP, [*ROW, "parallel_mlp"], not_graded=("parallel_mlp_communication",)
    )
    for name in ROW:
        message = graded.test(name, 2, TP)["output"]
        assert message.startswith(f"rank 0: RowParallelLinear({name[20:-1]}) on 2 ranks: output:")
        assert message.endswith(
            "(the bias is added on every rank before the reduction: the output is off by (p-1) "
            "x bias = 1 x bias; add it once, after the all-reduce) (the same on rank 1)"
        ), message
    message = graded.test("parallel_mlp", 2, TP)["output"]
    assert message.startswith("rank 0: ParallelMLP on 2 ranks: output: element [0, 0, 0]")
    assert "(fc2's bias is added on every rank before the reduction: the output is off by " in (
        message
    )
