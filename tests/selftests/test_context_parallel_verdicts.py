"""Verdicts of the context_parallel graded tests on the reference, stubs and broken submissions.

Each broken submission (``submissions/cp_*``) fails in one way; the tests assert the verdict
a careful TA would give (outcome, kind, the cause named in the message) and that every other
test of that submission still passes. One grader run per submission, at world size 2 (and 1
where one rank behaves differently), shared by the tests of that submission.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from forgeries import assert_broken_protocol, assert_earns_nothing, setting, without

from grader.testkit.attention import observations

PART = "context_parallel"
FUNCTIONS = ("ring_attention", "ulysses_attention")
CASES = (
    "float32",
    "float32-causal",
    "float64",
    "float64-causal",
    "one-position-blocks-causal",
    "scores-beyond-88",
)
CAUSAL = ("float32-causal", "float64-causal", "one-position-blocks-causal")


def attention(function: str, case: str) -> str:
    return f"attention[{function}-{case}]"


def expect_only(graded, failing: dict[tuple[str, int], str]) -> None:
    """Every test of the part passed but those in ``failing``, which had that outcome."""
    outcomes = graded.outcomes()
    assert outcomes, graded.stdout + graded.stderr
    for key, outcome in outcomes.items():
        assert outcome == failing.get(key, "passed"), (key, outcome, graded.stdout)
    assert set(failing) <= set(outcomes), set(failing) - set(outcomes)


def test_reference_earns_every_point(grade) -> None:
    graded = grade("reference")  # every part, shared with the other files' tests
    assert graded.returncode == 0, graded.stdout + graded.stderr
    mine = [t for t in graded.tests if t["extra_data"]["part"] == PART]
    assert len(mine) == (2 * 6 + 2) * 4 + 2 * 3
    assert {t["extra_data"]["outcome"] for t in mine} == {"passed"}
    assert sum(t["score"] for t in mine) == sum(t["max_score"] for t in mine) == 11
    ring = graded.test("ring_attention_communication", 4, PART)["extra_data"]
    # The broker's record: rank r forwarded its own block, then r-1's, then r-2's.
    assert ring["forward_blocks"] == [[0, 3, 2], [1, 0, 3], [2, 1, 0], [3, 2, 1]]
    assert ring["backward_bytes"] == [ring["backward_bound"]] * 4
    ulysses = graded.test("ulysses_attention_communication", 4, PART)["extra_data"]
    assert ulysses["forward_all_to_alls"] == ulysses["backward_all_to_alls"] == [4] * 4


def test_stubs_earn_nothing_and_name_every_target(grade) -> None:
    graded = grade("stubs")  # every part, shared with the other files' tests
    mine = [t for t in graded.tests if t["extra_data"]["part"] == PART]
    assert len(mine) == 62
    for test in mine:
        assert test["extra_data"]["outcome"] == "failed", test["name"]
        assert test["score"] == 0
        target = test["extra_data"]["target"].split(".", 1)[1]
        assert test["output"].startswith(
            f"not implemented yet: {target} raises NotImplementedError"
        ), test["output"]
    assert {t["extra_data"]["target"] for t in mine} == {f"{PART}.{f}" for f in FUNCTIONS}


@pytest.fixture(scope="module")
def at_two(grade):
    """``at_two(name)``: one grader run of the broken submission, the whole part at p = 2."""
    return lambda name: grade(name, PART, world_sizes=(2,))


def test_mask_on_every_block_fails_the_causal_ring_only(at_two) -> None:
    graded = at_two("cp_mask_every_block")
    # Blocks of one position have no triangle: only the longer causal blocks go wrong, there
    # and in the tests that run causal blocks of 8 and check the results before the rest.
    wrong = [attention("ring_attention", c) for c in ("float32-causal", "float64-causal")]
    wrong += ["causality[ring_attention]"]
    # The messages are right: the communication test leaves the values' cause to the above.
    expect_only(graded, {(name, 2): "failed" for name in wrong})
    assert "values" in graded.test("ring_attention_communication", 2)["extra_data"]
    for name in wrong:
        message = graded.message(name, 2)
        assert message.startswith("rank 1: ring_attention ("), message
        assert ": output: element " in message
        assert "the triangular mask was applied to every block" in message


def test_future_blocks_computed_break_causality(at_two) -> None:
    graded = at_two("cp_future_blocks")
    wrong = [attention("ring_attention", c) for c in CAUSAL]
    expect_only(graded, {(name, 2): "failed" for name in [*wrong, "causality[ring_attention]"]})
    for name in wrong:
        assert "the later ranks' blocks were computed" in graded.message(name, 2)
    probe = graded.message("causality[ring_attention]", 2)
    assert probe.startswith("rank 0: ring_attention (causality probe) on 2 ranks: changing the ")
    assert "changed output at position 0" in probe
    assert "here: the later ranks' blocks were computed" in probe
    # The ring itself is right: no picture of it.
    assert "the ring's steps" not in graded.stdout + graded.message(wrong[0], 2)


def test_no_max_shift_overflows_beyond_88(at_two) -> None:
    graded = at_two("cp_no_max_shift")
    wrong = [attention(f, "scores-beyond-88") for f in FUNCTIONS]
    expect_only(graded, {(name, 2): "failed" for name in wrong})
    for name in wrong:
        message = graded.message(name, 2)
        assert message.startswith(f"rank 0: {name.split('[')[1].split('-')[0]} ("), message
        assert ": output" in message and "the scores reach " in message, message
        assert "exp overflows beyond 88 in float32" in message
        assert "subtract the row's running maximum before exp" in message


def test_backward_with_step0_kv_fails_the_ring_gradients(at_two) -> None:
    graded = at_two("cp_backward_step0_kv")
    failing = {(attention("ring_attention", c), 2): "failed" for c in CASES}
    failing[("causality[ring_attention]", 2)] = "failed"  # its own later keys leak into dq
    failing[("ring_attention_communication", 2)] = "failed"  # right messages, wrong results
    expect_only(graded, failing)
    for case in CASES:
        message = graded.message(attention("ring_attention", case), 2)
        assert ": output: " not in message  # the forward is right
        assert ": dq: element " in message or ": dk: element " in message, message
    assert "changed dq at position" in graded.message("causality[ring_attention]", 2)


def test_dkv_never_sent_home_fails_dk_with_the_cause(at_two) -> None:
    graded = at_two("cp_dkv_not_sent_home")
    wrong = [attention("ring_attention", c) for c in CASES] + ["causality[ring_attention]"]
    expect_only(graded, {(name, 2): "failed" for name in wrong})
    assert "values" in graded.test("ring_attention_communication", 2)["extra_data"]
    for name in wrong:
        message = graded.message(name, 2)
        assert ": dk: element " in message, message
        assert "the dK/dV partials that the other ranks computed for this block never came " in (
            message
        )


def test_blocking_ring_deadlocks_named_by_the_broker(grade) -> None:
    graded = grade("cp_blocking_ring", PART, world_sizes=(1, 2))
    ring = [attention("ring_attention", c) for c in CASES] + ["causality[ring_attention]"]
    ring.append("ring_attention_communication")
    expect_only(graded, {(name, 2): "timeout" for name in ring})  # one rank sends nothing
    for name in ring:
        message = graded.message(name, 2)
        assert message.startswith("deadlock: rank 0 waits in send to rank 1 at "), message
        assert " while rank 1 waits in send to rank 0 at " in message
        assert "context_parallel.py" in message


def test_ulysses_wrong_permute_fails_its_results(at_two) -> None:
    graded = at_two("cp_ulysses_wrong_permute")
    failing = {(attention("ulysses_attention", c), 2): "failed" for c in CASES}
    failing[("causality[ulysses_attention]", 2)] = "failed"
    failing[("ulysses_attention_communication", 2)] = "failed"
    expect_only(graded, failing)
    # What it sends is right: the communication test fails on its results, not its messages.
    assert ": output: element " in graded.message("ulysses_attention_communication", 2)
    for case in CASES:
        message = graded.message(attention("ulysses_attention", case), 2)
        assert message.startswith("rank 0: ulysses_attention ("), message
        assert ": output: element " in message


def test_other_calls_and_layouts_earn_every_point(grade) -> None:
    """K and V as two messages by isend/irecv; Ulysses by async all_to_all_single, pieces
    laid out transposed: an honest equivalent, which the checks on content must accept."""
    graded = grade("cp_other_calls", PART, world_sizes=(3,))
    expect_only(graded, {})
    assert sum(t["score"] for t in graded.tests) == sum(t["max_score"] for t in graded.tests)
    ring = graded.test("ring_attention_communication", 3)["extra_data"]
    assert ring["forward_blocks"] == [[0, 2], [1, 0], [2, 1]]  # read from K and V apart


def test_all_gathered_kv_fails_the_ring_communication_only(grade) -> None:
    graded = grade("cp_all_gather_kv", PART, k="ring_attention", world_sizes=(2,))
    expect_only(graded, {("ring_attention_communication", 2): "failed"})
    assert graded.message("ring_attention_communication", 2).startswith(
        "rank 0: ring_attention on 2 ranks: it called all_gather: the ring passes the K/V "
        "blocks with messages only"
    )


def test_a_gate_passed_early_moves_the_whole_forward_after_it(grade) -> None:
    """The attack on the forward's end: the rank passes the gate "backward" itself, first,
    and answers the scenario's own pass from what it got. Its results are right, but every
    message of its forward now lies after the gate, where the broker saw it: no K/V block
    was passed on in the forward, and the communication test says so."""
    graded = grade("cp_early_gate", PART, k="ring_attention", world_sizes=(2,))
    expect_only(graded, {("ring_attention_communication", 2): "failed"})
    message = graded.message("ring_attention_communication", 2)
    assert message.startswith("rank 0: ring_attention on 2 ranks: "), message
    assert "forward" in message, message


def test_ring_turning_the_wrong_way_is_named_and_drawn_once(grade) -> None:
    """At p = 3 (at 2 both ways are one) causal attention computes blocks by the rule of
    another: the hypothesis of the ring turned the wrong way accounts for every value, and
    the picture paints the steps that carried the wrong block, once."""
    graded = grade("cp_ring_wrong_way", PART, k="ring_attention", world_sizes=(3,))
    causal = [attention("ring_attention", c) for c in CAUSAL]
    wrong = [*causal, "causality[ring_attention]", "ring_attention_communication"]
    expect_only(graded, {(name, 3): "failed" for name in wrong})
    for name in causal:
        assert "(the ring turns the wrong way: the blocks came from rank r+1" in (
            graded.message(name, 3)
        )
    assert graded.message("ring_attention_communication", 3).startswith(
        "rank 0: ring_attention on 3 ranks: rank 0 sent a message to rank 2"
    )
    pictures = {graded.test(name, 3)["output"].rsplit("drawn in ", 1)[-1] for name in causal}
    assert len(pictures) == 1, pictures  # one cause, one picture
    tables = [line for line in graded.stdout.splitlines() if line.strip() == "the ring's steps"]
    assert len(tables) == 1, graded.stdout
    assert " KV2 (want KV0) " in graded.stdout and " KV0 (want KV1) " in graded.stdout
    assert "KV0 tri" in graded.stdout  # step 0 holds the own block: right, not red


def test_last_dkv_hop_missing_gives_the_next_ranks_dk(at_two) -> None:
    graded = at_two("cp_dkv_last_hop_missing")
    wrong = [attention("ring_attention", c) for c in CASES] + ["causality[ring_attention]"]
    expect_only(graded, {(name, 2): "failed" for name in wrong})
    for name in wrong[:-1]:
        message = graded.message(name, 2)
        assert ": dk: element " in message, message
        assert "(it is rank 1's expected value: the dK/dV of the block this rank held at the " in (
            message
        )
    # Its messages are right but one hop short; the values' cause is the tests' above.
    details = graded.test("ring_attention_communication", 2)["extra_data"]
    assert details["values"].startswith("wrong, for the cause the correctness tests name: rank 0")
    assert "rank 0 backward" in graded.stdout and "1 of 2" in graded.stdout


def test_diagonal_masked_too_is_traced_to_rows_with_no_key(at_two) -> None:
    graded = at_two("cp_diagonal_tril_minus1")
    causal = [attention(f, c) for f in FUNCTIONS for c in CAUSAL]
    wrong = [*causal, "causality[ring_attention]", "causality[ulysses_attention]"]
    wrong.append("ring_attention_communication")
    expect_only(graded, {(name, 2): "failed" for name in wrong})
    for name in wrong:
        message = graded.message(name, 2)
        assert "NaN in exactly the rows of the queries left with no key to attend to" in message
        assert "a future key" not in message and "changing the keys" not in message
    assert "the ring's steps" not in graded.stdout  # the ring is right: no picture


def test_merge_without_rescale_is_named(at_two) -> None:
    graded = at_two("cp_merge_no_rescale")
    wrong = [attention("ring_attention", c) for c in CASES] + ["causality[ring_attention]"]
    expect_only(graded, {(name, 2): "failed" for name in wrong})
    for name in wrong:
        assert "normalised by its own sum of exps, was added as it is" in (graded.message(name, 2))
    assert "values" in graded.test("ring_attention_communication", 2)["extra_data"]
    assert "the ring's steps" not in graded.stdout


def test_ulysses_interleaved_positions_are_named(at_two) -> None:
    graded = at_two("cp_ulysses_interleaved")
    wrong = [attention("ulysses_attention", c) for c in CAUSAL if "one-position" not in c]
    wrong.append("causality[ulysses_attention]")
    expect_only(graded, {(name, 2): "failed" for name in wrong})
    for name in wrong:
        assert "the positions are interleaved" in graded.message(name, 2)
    assert "skip the later blocks" not in graded.message("causality[ulysses_attention]", 2)


def test_ulysses_without_backward_names_the_missing_all_to_all(at_two) -> None:
    graded = at_two("cp_ulysses_not_differentiable")
    message = graded.message(attention("ulysses_attention", "float32"), 2)
    assert message.startswith("rank 0: ulysses_attention (float32) on 2 ranks: dq is missing: ")
    assert "ulysses_attention's output has no grad_fn" in message
    assert "dist.all_to_all has no backward" in message
    assert "element 0 of tensors does not require grad" not in graded.stdout


def honest_observation() -> dict:
    """A return of the shape that grader/scenarios/context_parallel.py builds."""
    block = torch.zeros(2, 12, 8, 4)
    return {
        "output_type": "Tensor",
        "output": block,
        "differentiable": True,
        "dq": block,
        "dk": block,
        "dv": block,
    }


FORGERIES: dict[str, tuple[Callable[[dict], Any], str]] = {
    "a list": (lambda t: list(t.values()), "observation: a list, not a dict of output_type, "),
    "an empty dict": (lambda t: {}, "observation: lacks differentiable and 5 more"),
    "no dq": (without("dq"), "observation: lacks dq"),
    "a field more": (setting(extra=1), "holds 1 key(s) that are not fields"),
    "a string for a gradient": (setting(dq="x"), "dq holds a str where a tensor or None is due"),
    "a list for the output": (setting(output=[1.0]), "output holds a list where a tensor or None"),
    "a number for differentiable": (setting(differentiable=1), "holds an int where a bool is due"),
    "a sentence for a type's name": (
        setting(output_type="Tensor; full marks"),
        "output_type holds a str where a type's name is due",
    ),
}


def test_an_honest_observation_reads_into_the_record() -> None:
    """A function that returned no tensor, with no gradient, is the submission's to be judged
    on by the tests, not a malformed return."""
    tree = setting(output_type="tuple", output=None, differentiable=False, dq=None)(
        honest_observation()
    )
    (seen,) = observations([tree], "")
    assert (seen.output_type, seen.output, seen.differentiable) == ("tuple", None, False)
    assert seen.result("dq") is None and seen.result("dk") is tree["dk"]


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_malformed_observation_is_the_ranks_broken_protocol(forgery: str) -> None:
    """The trusted side reads each rank's return into one checked record: a malformed one fails
    in one line, the lowest rank's, charged to the submission as a protocol fault."""
    assert_broken_protocol(
        observations, honest_observation, FORGERIES[forgery], "context_parallel.attention"
    )


def test_a_forged_observation_earns_nothing(grade) -> None:
    """The scenario's result rewritten in the rank's process (a string where dq is due): every
    test fails in one line naming the malformed return, never a KeyError or TypeError of the
    grader's; the communication tests too, which judge the messages only with right values."""
    graded = grade("cp_forged_observation", PART, world_sizes=(2,))
    said = (
        "rank 0: context_parallel.attention returned a malformed observation: dq holds a str "
        "where a tensor or None is due (the same on rank 1)"
    )
    tests = [t for t in graded.tests if t["extra_data"]["part"] == PART]
    assert len(tests) == 2 * len(CASES) + 2 + 2
    for test in tests:
        assert_earns_nothing(test, said)
