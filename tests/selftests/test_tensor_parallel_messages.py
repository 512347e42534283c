"""The tensor_parallel messages that lead to the fix: one broken submission per mistake.

Each ``submissions/tp_*`` makes one mistake a student makes; its test asserts which tests
fail and the cause their message names (the dimension that is split, the shape expected,
the factor, whose shard), not its wording. One world size (2) each, the whole part: every
other test must still pass.
"""

from __future__ import annotations

from runner import Graded

TP = "tensor_parallel"
COLUMN = [f"column_parallel_linear[gather_output={v}]" for v in (False, True)]
ROW = [f"row_parallel_linear[input_is_parallel={v}]" for v in (True, False)]
MLP = ["parallel_mlp", "parallel_mlp_communication"]


def failing(graded: Graded) -> dict[str, str]:
    """The part's tests that did not pass, with their outcome (world size 2 only)."""
    outcomes = graded.outcomes()
    assert outcomes, graded.stdout + graded.stderr
    return {name: outcome for (name, _), outcome in outcomes.items() if outcome != "passed"}


def test_from_linear_losing_a_float64_layers_dtype_is_named(grade) -> None:
    graded = grade("tp_from_linear_float32", TP, world_sizes=(2,))
    assert failing(graded) == dict.fromkeys(COLUMN + MLP, "failed")  # fc1 is column parallel
    assert "fc1" in graded.message("parallel_mlp", 2)
    for name in COLUMN:
        message = graded.message(name, 2)
        assert "ColumnParallelLinear.from_linear" in message, message
        assert "float64 nn.Linear" in message and "float32 weight" in message
        assert "keeps the layer's dtype" in message


def test_column_weight_split_along_in_features_is_named_before_the_matmul(grade) -> None:
    graded = grade("tp_column_wrong_split", TP, world_sizes=(2,))
    assert failing(graded) == dict.fromkeys(COLUMN + MLP, "failed")  # not torch's error
    for name in COLUMN:
        message = graded.message(name, 2)
        assert ".weight has shape (12, 4), expected (6, 8)" in message, message
        assert "(split along the wrong dimension)" in message
        assert "splits the weight's rows (out_features=12)" in message
        assert "mat1 and mat2" not in message
    message = graded.message("parallel_mlp", 2)
    assert "fc1" in message and ".weight has shape (16, 4), expected (8, 8)" in message


def test_gather_along_dim_0_names_the_shape_and_the_dimension(grade) -> None:
    graded = grade("tp_gather_dim0", TP, world_sizes=(2,))
    gathering = {"column_parallel_linear[gather_output=True]": "failed"}
    gathering["region_function[gather_from_parallel_region]"] = "failed"
    # scatter's backward all-gathers: autograd refuses the gradient's shape, naming the function
    gathering["region_function[scatter_to_parallel_region]"] = "error"
    gathering["row_parallel_linear[input_is_parallel=False]"] = "error"
    assert failing(graded) == gathering
    message = graded.message("column_parallel_linear[gather_output=True]", 2)
    assert "output has shape (4, 3, 6), expected (2, 3, 12)" in message, message
    assert "concatenated along dim 0" in message and "along the last dimension" in message
    message = graded.message("region_function[gather_from_parallel_region]", 2)
    assert "output has shape (4, 3), expected (2, 6)" in message, message
    for name in ("region_function[scatter_to_parallel_region]", ROW[1]):
        message = graded.message(name, 2)
        assert "_ScatterToModelParallelRegionBackward" in message, message
        assert "all-gathers the ranks' gradients along the last dimension" in message


def test_bias_sliced_with_the_wrong_size_names_its_shape(grade) -> None:
    graded = grade("tp_bias_wrong_size", TP, world_sizes=(2,))
    assert failing(graded) == dict.fromkeys(COLUMN + MLP, "failed")
    for name in COLUMN:
        message = graded.message(name, 2)
        assert ".bias has shape (4,), expected (6,)" in message, message
        assert "the same 6 entries of the bias" in message
    assert ".bias has shape (4,), expected (8,)" in graded.message("parallel_mlp", 2)


def test_averaging_where_a_sum_is_needed_is_named_as_1_over_p(grade) -> None:
    graded = grade("tp_average_not_sum", TP, world_sizes=(2,))
    regions = [f"region_function[{f}_parallel_region]" for f in ("copy_to", "reduce_from")]
    assert failing(graded) == dict.fromkeys([*COLUMN, *ROW, *regions, "parallel_mlp"], "failed")
    for name in COLUMN:
        message = graded.message(name, 2)
        assert "the input's gradient" in message and "1/2 of the expected" in message, message
        assert "not averaging" in message
    for name in ROW:
        assert "averaged (1/2 of their sum)" in graded.message(name, 2), graded.message(name, 2)
    for name in regions:
        assert "1/2 of the sum over ranks" in graded.message(name, 2), graded.message(name, 2)


def test_a_rank_holding_another_ranks_shard_is_told_whose(grade) -> None:
    graded = grade("tp_wrong_rank_slice", TP, world_sizes=(2,))
    assert failing(graded) == dict.fromkeys(COLUMN + MLP, "failed")
    for name in COLUMN:
        message = graded.message(name, 2)
        assert message.startswith("rank 0: "), message
        assert ".weight holds rank 1's shard, not rank 0's" in message
        assert "dist.get_rank(group)" in message


def test_a_gate_passed_early_moves_the_forward_all_reduce_after_it(grade) -> None:
    """The attack on the forward's end: the MLP passes the gate "backward" itself, before its
    all-reduce, and answers the scenario's own pass from what it got. Its outputs and
    gradients are right, but the broker saw the forward's all-reduce after the gate: the
    forward made no communication, and the communication test says so."""
    graded = grade("tp_early_gate", TP, k="parallel_mlp", world_sizes=(2,))
    assert failing(graded) == {"parallel_mlp_communication": "failed"}
    message = graded.message("parallel_mlp_communication", 2)
    assert message.startswith(
        "rank 0: ParallelMLP on 2 ranks: its forward made no communication"
    ), message
