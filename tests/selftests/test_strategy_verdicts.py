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
BUCKETS = {
    "per_parameter": "0",
    "few_buckets": "0.000572205",
    "one_bucket": "25",
    "cap_below_parameter": "3.8147e-05",
}
TRAINING = [f"data_parallel_training[{o}-{b}]" for o in ("sgd", "adamw") for b in BUCKETS]
UNUSED = [f"unused_parameter[{b}]" for b in BUCKETS]
OVERLAP = [f"overlap[{b}]" for b in BUCKETS]
SHARDED = ["sharded_optimizer[sgd_momentum]", "sharded_optimizer[adamw]"]
FIRST = [f"sharded_optimizer_first_group[{o}]" for o in ("sgd_momentum", "adamw")]
NO_OWNER = [f"sharded_optimizer_no_owner[{o}]" for o in ("sgd_momentum", "adamw")]
ROW = [f"row_parallel_linear[input_is_parallel={v}]" for v in (True, False)]
EXPECTED = {  # every entry of results.json, by (name, world size)
    DP: {(n, w) for n in TRAINING + UNUSED + SHARDED + FIRST for w in (1, 2, 4)}
    | {(n, w) for n in [*OVERLAP, "sharded_optimizer_state"] for w in (2, 4)}
    | {(n, 4) for n in NO_OWNER},
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
        (e["extra_data"]["test"], e["extra_data"]["world_size"]): e
        for e in graded.tests
        if e["extra_data"]["part"] == part
    }


def assert_only_these_fail(
    graded: Graded,
    part: str,
    failing: list[str],
    not_graded: tuple[str, ...] = (),
    outcome: str = "failed",
) -> None:
    """``failing`` end in ``outcome`` (failed; error: the submission raised), ``not_graded``
    (costs of a failing target) are not run, the rest pass."""
    found = entries(graded, part)
    assert found, graded.stdout + graded.stderr
    for (name, size), entry in found.items():
        expected = outcome if name in failing else "not_run" if name in not_graded else "passed"
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
    # Before backward reached the embedding: the buckets of head.bias and hidden.bias, and of
    # hidden.weight; embed.weight's gradient is computed after it.
    assert overlap["all_reduces_before_the_embedding"] == [2, 2]
    assert overlap["all_reduce_dtypes"] == ["float64"]
    tiny = entries(graded, DP)[("overlap[cap_below_parameter]", 2)]["extra_data"]
    assert tiny["all_reduces"] == [4, 4] and tiny["all_reduce_bytes"] == [64, 64, 512, 512]
    state = entries(graded, DP)[("sharded_optimizer_state", 2)]["extra_data"]
    owned = state["owned_state_bytes_per_rank"]  # as the broker saw who sent each update
    assert sum(owned) == state["unsharded_state_bytes"]  # each parameter has one owner
    assert max(owned) <= state["allowed_bytes_per_rank"]
    # The allowance, by decision: ceil(7/2) = 4 largest parameters' AdamW state (round-robin's
    # worst) at p = 2; 1/4 of the state plus the largest parameter's and the counters at p = 4.
    assert state["allowed_bytes_per_rank"] == state["allowed_by_count"] == 2512
    state = entries(graded, DP)[("sharded_optimizer_state", 4)]["extra_data"]
    assert state["allowed_bytes_per_rank"] == state["allowed_by_size"] == 839 + 772 + 28
    calls = entries(graded, TP)[("parallel_mlp_communication", 4)]["extra_data"]
    assert calls["forward_calls"] == calls["backward_calls"] == {"all_reduce": 1}
    assert calls["all_reduces"] == [2, 2, 2, 2]  # the broker's count over the whole call


def test_stubs_fail_both_parts_as_not_implemented(grade) -> None:
    graded = grade("stubs")
    for part in (DP, TP):
        found = entries(graded, part)
        assert set(found) == EXPECTED[part], graded.stdout + graded.stderr
        for key, entry in found.items():
            assert entry["score"] == 0
            assert entry["extra_data"]["outcome"] == "failed", key
            assert "not implemented" in entry["output"], (key, entry["output"])


def test_dp_summed_gradients_fail_training_with_the_averaging_hint(grade) -> None:
    graded = grade("dp_sums_not_averages", DP, world_sizes=(2,))
    assert_only_these_fail(graded, DP, TRAINING + UNUSED)
    for name in TRAINING:
        optimizer = "AdamW" if "adamw" in name else "SGD"
        size = BUCKETS[name.split("-")[1][:-1]]
        assert graded.test(name, 2, DP)["output"] == (
            f"rank 0: DataParallel(bucket_size_mb={size}) with {optimizer} on 2 ranks, step 1, "
            "after synchronization: every gradient is 2x the one-process gradient: the "
            "gradients were summed over the 2 ranks, not averaged (divide by the world size) "
            "(the same on rank 1)"
        )


def test_dp_missing_broadcast_fails_training_before_step_1(grade) -> None:
    graded = grade("dp_no_initial_broadcast", DP, world_sizes=(2,))
    assert_only_these_fail(graded, DP, TRAINING + UNUSED)
    for name in TRAINING:
        optimizer = "AdamW" if "adamw" in name else "SGD"
        size = BUCKETS[name.split("-")[1][:-1]]
        message = graded.test(name, 2, DP)["output"]
        assert message.startswith(
            f"DataParallel(bucket_size_mb={size}) with {optimizer} on 2 ranks: right after "
            "DataParallel(model), rank 1's parameter embed.weight differs from rank 0's by "
        ), message
        assert "must make every rank's parameters and buffers equal to rank 0's" in message
        assert "(broadcast them; the ranks were seeded differently)" in message


def test_dp_reducing_after_backward_fails_only_the_overlap_schedule(grade) -> None:
    """Every bucket launched in finish: late, by the broker's gate at the embedding. One bucket
    can only start once backward is done, so its test passes."""
    graded = grade("dp_no_overlap", DP, world_sizes=(2,))
    late = [n for n in OVERLAP if n != "overlap[one_bucket]"]
    assert_only_these_fail(graded, DP, late)
    for name, count in zip(OVERLAP, (4, 3, 1, 4), strict=True):
        entry = graded.test(name, 2, DP)
        extra = entry["extra_data"]
        assert extra["kind"] == "schedule"
        assert extra["all_reduces"] == [count, count]  # the buckets are right, only late
        assert extra["all_reduces_before_the_embedding"] == [0, 0]
        if name in late:
            assert entry["output"].startswith(
                f"rank 0: DataParallel(bucket_size_mb={BUCKETS[name[8:-1]]}) on 2 ranks: "
                "iteration 1: backward reached the first layer (the embedding) before any "
                "all-reduce of the gradients it had already computed"
            ), entry["output"]


def test_dp_tied_weight_counted_twice_fails_training_naming_it(grade) -> None:
    graded = grade("dp_tied_weight_twice", DP, world_sizes=(4,))
    assert_only_these_fail(graded, DP, TRAINING + UNUSED + OVERLAP)
    for name in TRAINING + UNUSED:
        message = graded.test(name, 4, DP)["output"]
        assert "on 4 ranks, step 1, after synchronization: the tied weight embed.weight " in message
        assert "(also head.weight) has 2x its gradient while the others are right" in message
        assert "summed" not in message and message.endswith("(the same on ranks 1, 2, 3)")
    for name in OVERLAP:  # its buckets carried twice the tied weight's gradient: wrong messages
        message = graded.test(name, 4, DP)["output"]
        assert "its all-reduces carried 288 values, but not the 288 local gradients its " in (
            message
        )
        assert "computed (embed.weight's gradient in iterations 1, 2 not among them), by " in (
            message
        )


def test_dp_float32_bucket_is_named_in_training_and_in_the_overlap_bytes(grade) -> None:
    graded = grade("dp_float32_bucket", DP, world_sizes=(2,))
    assert_only_these_fail(graded, DP, TRAINING + UNUSED + OVERLAP)
    for name in TRAINING + UNUSED:
        message = graded.test(name, 2, DP)["output"]
        assert ", step 1, after synchronization: parameter embed.weight's gradient differs " in (
            message
        )
        expected, got = message.split("expected ")[1].split(")")[0].split(", got ")
        assert expected != got, message  # enough digits to tell them apart
        assert (
            "within float32 rounding: the bucket is in a lower precision than the gradients "
            "(float64): flatten each bucket in its gradients' dtype" in message
        )
    for name in OVERLAP:
        message = graded.test(name, 2, DP)["output"]
        assert (
            "iteration 1: the all-reduces carried 576 bytes of float32, the trainable "
            "gradients hold 1152 bytes of float64: the bucket is in a lower precision than the "
            "gradients" in message
        ), message
        assert "reduce each gradient exactly once" not in message
        assert graded.test(name, 2, DP)["extra_data"]["all_reduce_dtypes"] == ["float32"]


def test_dp_gradients_divided_twice_are_named_as_a_uniform_factor(grade) -> None:
    graded = grade("dp_divides_twice", DP, world_sizes=(2,))
    assert_only_these_fail(graded, DP, TRAINING + UNUSED)
    for name in TRAINING + UNUSED:
        assert graded.test(name, 2, DP)["output"].endswith(
            "step 1, after synchronization: every gradient is 0.5x the one-process gradient "
            "(the same factor for all): the mean over the 2 ranks is their sum divided by 2, "
            "exactly once (these were divided by 4) (the same on rank 1)"
        )


def test_dp_unused_parameter_left_unreduced_fails_only_the_unused_test(grade) -> None:
    graded = grade("dp_unused_never_launched", DP, world_sizes=(2,))
    assert_only_these_fail(graded, DP, UNUSED)
    for name in UNUSED:
        message = graded.test(name, 2, DP)["output"]
        assert "with SGD on 2 ranks, step 2, after synchronization: embed.weight's gradient " in (
            message
        )
        assert (
            "(in iteration 2 the model skips its hidden layer on every rank: hidden.weight and "
            "hidden.bias get no gradient and their hooks never fire, so "
            "finish_gradient_synchronization() must launch every bucket still waiting" in message
        ), message


def test_dp_cap_below_one_parameter_fails_only_its_overlap(grade) -> None:
    graded = grade("dp_cap_ignored_for_large", DP, world_sizes=(2,))
    assert_only_these_fail(graded, DP, ["overlap[cap_below_parameter]"])
    assert graded.test("overlap[cap_below_parameter]", 2, DP)["output"] == (
        "rank 0: DataParallel(bucket_size_mb=3.8147e-05) on 2 ranks, iteration 1: 1 gradient "
        "all-reduces in one step, expected 4: a cap of 40 bytes is smaller than every gradient "
        "(the smallest holds 64 bytes), and a parameter larger than the cap gets a bucket of "
        "its own: 4 (the tied weight counts once, the frozen layer not at all) (the same on "
        "rank 1)"
    )


def test_dp_added_group_never_stepped_is_named(grade) -> None:
    graded = grade("dp_added_group_dropped", DP, world_sizes=(2,))
    assert_only_these_fail(graded, DP, [*SHARDED, *FIRST, "sharded_optimizer_state"])
    for name in [*SHARDED, *FIRST, "sharded_optimizer_state"]:
        message = graded.test(name, 2, DP)["output"]
        assert ": after step 1: parameter 4 (group 1) differs by " in message, message
        assert (
            "it was not updated on any rank: add_param_group must assign the new group's "
            "parameters to owners and add them, with the group's settings, to the optimizer "
            "that steps them" in message
        )
        assert "broadcast" not in message


def test_an_unsharded_optimizer_hidden_from_a_measurement_owns_nothing(grade) -> None:
    """Every parameter stepped by a hidden unsharded optimizer, a 1/p decoy where a rank-side
    measurement would look, no message: the broker saw no rank send an update."""
    graded = grade("zero_hidden_unsharded", DP, world_sizes=(2,))
    assert_only_these_fail(graded, DP, ["sharded_optimizer_state"])
    assert graded.test("sharded_optimizer_state", 2, DP)["output"].startswith(
        "ShardedOptimizer(AdamW) on 2 ranks: no rank sent parameter 0's updated value, in a "
        "broadcast from its root or in its input to an all-gather or an all-reduce"
    )


def test_decoy_broadcasts_from_the_owners_do_not_hide_an_unsharded_optimizer(grade) -> None:
    """The reference's broadcasts made, their results dropped, every parameter stepped
    locally: given the true gradient only of what it owns, a rank steps the rest wrong."""
    graded = grade("zero_decoy_broadcasts", DP, world_sizes=(4,))
    assert_only_these_fail(graded, DP, ["sharded_optimizer_state"])
    message = graded.test("sharded_optimizer_state", 4, DP)["output"]
    assert message.startswith("rank 0: ShardedOptimizer(AdamW) on 4 ranks: after step 1: ")
    assert message.endswith(
        "(in this call each rank was given the true gradient only of what it owns (as its "
        "messages in the first call showed) and random ones elsewhere: a rank must take the "
        "parameters it does not own from their owners, not step them itself)"
    )


def test_dp_zero_grad_of_own_shard_fails_steps_but_not_the_state(grade) -> None:
    graded = grade("dp_zero_grad_own_shard", DP, world_sizes=(2,))
    assert_only_these_fail(graded, DP, [*SHARDED, *FIRST])  # the state is measured on its own
    for name in [*SHARDED, *FIRST]:
        assert (
            "zero_grad() must clear every parameter's gradient"
            in (graded.test(name, 2, DP)["output"])
        )


def test_dp_round_robin_owners_pass_the_state_bound(grade) -> None:
    graded = grade("dp_round_robin_owners", DP, world_sizes=(2,))
    assert_only_these_fail(graded, DP, [])
    state = graded.test("sharded_optimizer_state", 2, DP)["extra_data"]
    assert state["owned_state_bytes_per_rank"] == [2512, 844]  # parameters 0, 2, 4, 6 on rank 0
    assert state["allowed_bytes_per_rank"] == 2512


def test_dp_first_group_stepped_with_defaults_fails_only_its_test(grade) -> None:
    graded = grade("dp_first_group_defaults", DP, world_sizes=(2,))
    assert_only_these_fail(graded, DP, FIRST)
    assert graded.test(FIRST[0], 2, DP)["output"].endswith(
        "updated with {'lr': 0.1, 'momentum': 0.9}, not its param group's own {'lr': 0.02, "
        "'momentum': 0.5} (the same on rank 1)"
    )
    assert (
        "after step 1: parameter 0 (group 0) differs by " in graded.test(FIRST[1], 2, DP)["output"]
    )


def test_dp_rank_owning_nothing_must_not_crash(grade) -> None:
    graded = grade("dp_empty_shard_crashes", DP, world_sizes=(4,))
    assert_only_these_fail(graded, DP, NO_OWNER, outcome="error")  # the submission raised
    for name in NO_OWNER:
        message = graded.test(name, 4, DP)["output"]
        assert message.startswith("ranks 2, 3: ValueError: optimizer got an empty parameter list")
        assert message.endswith(
            "(3 parameters on 4 ranks: some rank owns none of a param group's parameters, or "
            "none at all, and must still build its optimizer (a param group with an empty "
            "params list is allowed), step it and take part in every broadcast)"
        ), message


def test_bias_on_every_rank_fails_row_parallel_and_mlp_outputs(grade) -> None:
    graded = grade("tp_bias_every_rank", TP, world_sizes=(2,))
    # Its communication is right (one all-reduce each way): that test passes.
    assert_only_these_fail(graded, TP, [*ROW, "parallel_mlp"])
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


def test_a_decoy_all_reduce_of_the_right_size_earns_no_communication_points(grade) -> None:
    """The whole MLP on every rank, and one all-reduce of zeros each way: the count and the
    bytes are right, what they carry is not (issue: operations counted by name and size)."""
    graded = grade("tp_mlp_decoy", TP, k="parallel_mlp", world_sizes=(2,))
    test = graded.test("parallel_mlp_communication", 2, TP)
    assert test["score"] == 0, test["output"]
    assert "all-reduce carried something other than this rank's partial output" in test["output"]


def test_forged_marks_earn_no_overlap_points(grade) -> None:
    """Every all-reduce in finish, between marks of the rank's own saying backward had begun and
    then returned: no mark is read, the broker's gate at the embedding says none started in
    time. One bucket can only start once backward is done: that test it passes."""
    graded = grade("dp_forged_marks", DP, k="overlap", world_sizes=(2,))
    for name in OVERLAP:
        test = graded.test(name, 2, DP)
        if name == "overlap[one_bucket]":  # one bucket can only start once backward is done
            continue
        assert test["score"] == 0, (name, test["output"])
        assert (
            "backward reached the first layer (the embedding) before any all-reduce"
            in (test["output"])
        ), test["output"]


def test_decoy_all_reduces_of_the_right_size_earn_no_overlap_points(grade) -> None:
    """Zeros all-reduced from the gradient hooks, sized like each bucket, and the averaging done
    by an all-gather after backward (issue: operations counted by name and size): training is
    right, every overlap test fails on what the all-reduces carried."""
    graded = grade("dp_decoy_overlap", DP, k="overlap", world_sizes=(2,))
    for name in OVERLAP:
        test = graded.test(name, 2, DP)
        assert test["score"] == 0, (name, test["output"])
    assert (
        "before any all-reduce of the gradients it had already computed"
        in (graded.test("overlap[per_parameter]", 2, DP)["output"])
    )
    assert (
        "its all-reduces carried 288 values, but not the 288 local gradients"
        in (graded.test("overlap[one_bucket]", 2, DP)["output"])
    )


def forged_observations_fail(graded: Graded, part: str, said: dict[str, str]) -> None:
    """Every test of ``said`` fails in one line naming its malformed return, charged to the
    submission as a protocol fault; every other test of the part passes."""
    assert_only_these_fail(graded, part, list(said), outcome="error")
    for name, message in said.items():
        test = graded.test(name, 2, part)
        assert test["score"] == 0 and test["extra_data"]["cause"] == "protocol", test
        assert test["output"].startswith(message), (name, test["output"])
        assert "\n" not in test["output"].strip() and "Error" not in test["output"]


def test_a_forged_dp_observation_earns_nothing(grade) -> None:
    """The scenarios' results rewritten in the rank's process (a string where a gradient, an
    iteration's gradients or the kept parameters are due): every test fails in one line naming
    the malformed return, never a KeyError or TypeError of the grader's."""
    graded = grade("dp_forged_observation", DP, world_sizes=(2,))
    train = "rank 0: data_parallel.train returned a malformed observation: grads[0] holds a str"
    overlap = "rank 0: data_parallel.overlap returned a malformed observation: grads[0] holds a str"
    sharded = "rank 0: data_parallel.sharded returned a malformed observation: kept[1] holds a str"
    said = dict.fromkeys(TRAINING + UNUSED, train) | dict.fromkeys(OVERLAP, overlap)
    said |= dict.fromkeys([*SHARDED, *FIRST, "sharded_optimizer_state"], sharded)
    forged_observations_fail(graded, DP, said)


def test_a_forged_tp_observation_earns_nothing(grade) -> None:
    """No output, a number for its type, a string for a bool, a number for a ValueError's
    message: each test that reads them fails in one line; the row parallel layer (its
    scenario left alone) and the MLP's communication (the broker's record) pass."""
    graded = grade("tp_forged_observation", TP, world_sizes=(2,))
    malformed = "rank 0: tensor_parallel.{} returned a malformed observation: {}"
    said = {
        f"column_parallel_linear[gather_output={v}]": malformed.format(
            "column_forward_backward", "lacks output"
        )
        for v in (False, True)
    }
    for f in ("copy_to", "reduce_from", "gather_from", "scatter_to"):
        region = malformed.format("region_forward_backward", "output_type holds an int")
        said[f"region_function[{f}_parallel_region]"] = region
    said["parallel_mlp"] = malformed.format("mlp_forward_backward", "has_column holds a str")
    for layer in ("ColumnParallelLinear", "RowParallelLinear"):
        construct = malformed.format("construct", "what it raised holds an int")
        said[f"indivisible_dimension[{layer}]"] = construct
    forged_observations_fail(graded, TP, said)
