"""Verdicts of the expert_parallel graded tests on the reference, stubs and broken submissions.

Each broken submission (``submissions/ep_*``) fails in one way; the tests assert the
verdict a careful TA would give (which tests fail, and the cause the message names) and
that the tests its mistake cannot touch still pass. One grader run per submission, at
world size 2 (and 3 where p = 2 cannot show the mistake everywhere).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from forgeries import assert_broken_protocol, assert_earns_nothing, setting, without

from grader.testkit.moe_observed import observations

PART = "expert_parallel"
TOP1 = ["moe_top1[E=p]", "moe_top1[E=2p]"]
TOP2 = ["moe_top2[E=p]", "moe_top2[E=2p]"]
CAPACITY = ["capacity[top-1]", "capacity[top-2]"]
COMMUNICATION = ["communication[capacity_factor=None]", "communication[capacity_factor=0.5]"]
ALL = [*TOP1, *TOP2, *CAPACITY, "identity_experts", *COMMUNICATION]


def sizes(name: str) -> tuple[int, ...]:
    return (2, 3, 4) if name in TOP2 else (1, 2, 3, 4)


def test_reference_passes_everything(grade) -> None:
    graded = grade("reference")  # every part, shared with the other files' tests
    assert graded.returncode == 0, graded.stdout + graded.stderr
    mine = [t for t in graded.tests if t["extra_data"]["part"] == PART]
    assert len(mine) == sum(len(sizes(name)) for name in ALL) == 34
    assert {t["extra_data"]["outcome"] for t in mine} == {"passed"}
    assert sum(t["score"] for t in mine) == 10
    # The broker counted every rank's dispatch: exactly its kept pairs' rows, 32 bytes each.
    sent = graded.test("communication[capacity_factor=0.5]", 4, PART)["extra_data"]
    assert all(n % 32 == 0 for n in sent["dispatch_bytes_sent"])
    assert sum(sent["dispatch_bytes_sent"]) == sum(sent["dispatch_bytes_received"])


def test_stubs_fail_everything_as_not_implemented(grade) -> None:
    graded = grade("stubs")  # every part, shared with the other files' tests
    mine = [t for t in graded.tests if t["extra_data"]["part"] == PART]
    assert len(mine) == 34
    for test in mine:
        assert test["extra_data"]["outcome"] == "failed", test["name"]
        assert test["extra_data"]["target"] == "expert_parallel.ExpertParallelMoE"
        assert "not implemented yet: ExpertParallelMoE.__init__" in test["output"], test["name"]
        assert test["score"] == 0


def verdicts(graded, size: int) -> tuple[set[str], set[str]]:
    """The tests that failed and those that passed at ``size``."""
    outcomes = {n: o for (n, s), o in graded.outcomes().items() if s == size}
    assert set(outcomes) == set(ALL)
    failed = {n for n, o in outcomes.items() if o != "passed"}
    return failed, set(outcomes) - failed


# The graded tests draw their data from the machine's secret, but route by construction
# (token i of rank r prefers the (i + r)-th expert in play; expert 0 starved where k < E):
# what each broken submission must fail, and must pass, below holds for every draw. Cases
# it may or may not fail, depending on the draw, are left unasserted.


@pytest.mark.parametrize("honest", ["ep_own_all_to_all", "ep_nn_functional"])
def test_honest_variants_pass_everything(grade, honest: str) -> None:
    """The student's own all-to-all from isend/irecv (judged per peer from the broker's
    messages), and torch's differentiable all_to_all_single."""
    graded = grade(honest, PART, world_sizes=(3,))
    assert graded.returncode == 0, graded.stdout + graded.stderr
    assert verdicts(graded, 3) == (set(), set(ALL))


def test_guessed_splits_fail_every_exchange(grade) -> None:
    graded = grade("ep_splits_guessed", PART, world_sizes=(2,))
    failed, _ = verdicts(graded, 2)
    # Rank 1 routes its single token unlike rank 0's five: every receive size guessed from
    # this rank's own counts is wrong, and the all-to-alls cannot match.
    assert failed == set(ALL)
    for name in ALL:
        assert graded.test(name, 2)["score"] == 0
        assert graded.test(name, 2)["extra_data"]["outcome"] == "error"
        # The broker names the cause: the receive sizes do not match what the others send.
        assert (
            "output split sizes must be what the others send it" in (graded.test(name, 2)["output"])
        )


def test_rank_major_rows_taken_as_expert_major(grade) -> None:
    graded = grade("ep_rank_expert_order", PART, world_sizes=(2,))
    failed, passed = verdicts(graded, 2)
    # Two experts per rank, each with rows from both ranks: the mistake shows. One expert
    # per rank (E = p) makes both orders one; identity experts cannot tell experts apart.
    assert {"moe_top1[E=2p]", "moe_top2[E=2p]", "communication[capacity_factor=None]"} <= failed
    assert {"moe_top1[E=p]", "moe_top2[E=p]", "identity_experts"} <= passed
    message = graded.message("moe_top1[E=2p]", 2)
    assert "ExpertParallelMoE of 4 experts, top-1, on 2 ranks" in message
    assert ": output: element " in message
    assert "rows that arrive are rank-major" in message
    assert "but were split among the experts as if expert-major" in message


def test_combine_not_undoing_the_permutation(grade) -> None:
    graded = grade("ep_combine_not_unpermuted", PART, world_sizes=(2,))
    failed, _ = verdicts(graded, 2)
    assert {"identity_experts", "moe_top1[E=2p]", *TOP2, *COMMUNICATION} <= failed
    message = graded.message("identity_experts", 2)
    assert "it is another token of this rank: the combine did not undo the permutation" in message


ROUTER_MISTAKES = {
    "ep_gates_detached": "it is zero: no gradient reached the router; are the gates detached?",
    "ep_router_not_averaged": "this rank's gradient alone: all-reduce the router's gradients",
}


@pytest.mark.parametrize("broken", sorted(ROUTER_MISTAKES))
def test_router_gradient_mistakes(grade, broken: str) -> None:
    """Gates detached from the graph, or the router's gradients never all-reduced: only
    the router's gradient is wrong, and with top-1 it is zero anyway (every gate is 1)."""
    graded = grade(broken, PART, world_sizes=(2,))
    failed, _ = verdicts(graded, 2)
    # Detached gates still all-reduce the router's (zero) gradients: the exchange is right,
    # and the communication tests leave the values to the correctness tests.
    exchange = set() if broken == "ep_gates_detached" else set(COMMUNICATION)
    assert failed == {*TOP2, "capacity[top-2]", *exchange}
    for name in [*TOP2, "capacity[top-2]"]:
        message = graded.message(name, 2)
        assert "router.weight gradient" in message
        assert ROUTER_MISTAKES[broken] in message


def test_capacity_from_local_counts(grade) -> None:
    graded = grade("ep_local_capacity", PART, world_sizes=(2,))
    failed, _ = verdicts(graded, 2)
    assert failed == {*CAPACITY, "communication[capacity_factor=0.5]"}
    for name in CAPACITY:
        message = graded.message(name, 2)
        # Rank 0 comes first in the global order: its pairs are kept alike by both rules.
        assert message.startswith("rank 1: "), message
        assert ": output: element " in message
        assert "shared by all ranks' pairs" in message or "from this rank's" in message
    # The values' cause is the capacity tests'; the rows it sends are wrong in themselves.
    message = graded.message("communication[capacity_factor=0.5]", 2)
    assert message.startswith("rank 0: "), message
    assert "its all-to-alls of token rows carried " in message


def test_the_assignment_gives_the_graders_moe() -> None:
    """The layer students read is the layer the grader builds and its oracle runs."""
    import torch

    from assignments.expert_parallel import MoE as Given
    from grader.scenarios.expert_parallel import MoE as Graders

    torch.manual_seed(0)
    given = Given(8, 16, 4, 2)
    torch.manual_seed(0)
    graders = Graders(8, 16, 4, 2)
    x = torch.randn(9, 8)
    assert given.state_dict().keys() == graders.state_dict().keys()
    assert torch.equal(given(x), graders(x))
    assert torch.equal(given(x, capacity=2), graders(x, capacity=2))


def test_every_secret_gives_the_prescribed_routing() -> None:
    """The graded data is built for whatever secret a machine holds: every token prefers the
    expert it is meant to, with a clear top-k margin, so the reference never fails on a draw
    (the rows were once found by chance, and about one grading in seven found none)."""
    import hashlib

    from grader.scenarios.expert_parallel import build_moe
    from grader.testkit import data
    from grader.testkit.moe import MARGIN, Case, draw_layer, draw_tokens

    for secret in range(40):
        data.configure(hashlib.sha256(str(secret).encode()).digest(), "routing")
        for p in (1, 2, 3, 4):
            for case in (Case(p, p, 1), Case(p, 2 * p, 1), Case(p, 2 * p, 2, 0.5)):
                moe = build_moe(draw_layer(case), case.num_experts, case.top_k).double()
                in_play = list(range(1 if case.top_k < case.num_experts else 0, case.num_experts))
                for r, x in enumerate(draw_tokens(case, moe)):
                    assert len(x) == case.tokens[r]
                    probs = moe.router(x.double()).softmax(-1).detach()
                    for i, row in enumerate(probs):
                        assert int(row.argmax()) == in_play[(i + r) % len(in_play)], case
                        if case.top_k < case.num_experts:
                            ranked = row.sort(descending=True).values
                            assert ranked[case.top_k - 1] - ranked[case.top_k] > MARGIN, case


def test_a_combine_of_zeros_earns_no_communication_points(grade) -> None:
    """The home rank runs its tokens' experts on its own copy and the forward's combine
    carries zeros of the right size: the outputs, gradients and split sizes are right, the
    content is not."""
    graded = grade("ep_decoy_combine", PART, world_sizes=(2,))
    failed, _ = verdicts(graded, 2)
    assert failed == {n for n in ALL if n.startswith("communication")}
    message = graded.message("communication[capacity_factor=None]", 2)
    assert ": its combine all-to-all sent rank 0 " in message  # how many: the draw's
    assert " values that are not its experts' outputs for the rows that rank dispatched " in (
        message
    )


@pytest.mark.parametrize(
    "decoy",
    [
        "ep_decoy_combine+ep_own_all_to_all",  # zeros, in the student's own messages
        "ep_decoy_combine+ep_scrambled_combine",  # the outputs' values, not their rows
        "ep_decoy_combine+ep_own_all_to_all+ep_scrambled_combine",
    ],
)
def test_a_combine_that_carries_no_rows_earns_no_communication_points(grade, decoy) -> None:
    """The same attack with the combine of the right size carrying zeros through the
    student's own all-to-all of isend/irecv messages (whose bytes per peer are right), or the
    outputs' values regrouped so that they are no longer rows (every peer's values sorted)."""
    graded = grade(decoy, PART, world_sizes=(2,))
    failed, _ = verdicts(graded, 2)
    assert failed == {n for n in ALL if n.startswith("communication")}
    message = graded.message("communication[capacity_factor=None]", 2)
    how = "messages to rank " if "own_all_to_all" in decoy else "all-to-all sent rank "
    assert f": its combine {how}" in message
    assert " values that are not its experts' outputs for the rows that rank dispatched " in (
        message
    )


def test_rows_in_token_order_are_named(grade) -> None:
    """Rows dispatched in token order under the grouped order's split sizes: the outputs
    are explained by that mistake, not guessed as a rounding of bfloat16."""
    graded = grade("ep_rows_token_order", PART, world_sizes=(2,))
    failed, passed = verdicts(graded, 2)
    assert {"moe_top1[E=2p]", *COMMUNICATION} <= failed
    assert "identity_experts" in passed  # every gate is 1 and no expert changes a row
    message = graded.message("moe_top1[E=2p]", 2)
    assert ": output: element " in message
    assert "(the rows were dispatched in token order, not grouped by destination" in message
    assert "bfloat16" not in message


def test_one_missing_division_by_p_is_deducted_once(grade) -> None:
    """The experts' gradients not divided by p: the correctness tests that check them fail
    with the factor; the communication tests, whose exchanges are right, pass and say so."""
    graded = grade("ep_experts_not_divided", PART, world_sizes=(2,))
    failed, passed = verdicts(graded, 2)
    assert set(COMMUNICATION) | {"identity_experts"} <= passed
    assert "moe_top2[E=2p]" in failed
    assert "2x the expected: divide each local expert's gradient by p" in (
        graded.message("moe_top2[E=2p]", 2)
    )
    for name in COMMUNICATION:
        values = graded.test(name, 2)["extra_data"]["values"]
        assert values.startswith("wrong, for the cause the correctness tests name: rank 0: ")
        assert "divide each local expert's gradient by p" in values


def test_an_all_to_all_without_backward_is_named(grade) -> None:
    graded = grade("ep_all_to_all_not_differentiable", PART, k="moe_top1", world_sizes=(2,))
    message = graded.message("moe_top1[E=2p]", 2)
    assert ".grad is None): no gradient came back through the all-to-alls: " in message
    assert "dist.all_to_all_single has no backward" in message
    # With one expert in play the experts' gradients are none of this rank's: the tokens'.
    message = graded.message("moe_top1[E=p]", 2)
    assert "the tokens' gradient: element " in message
    assert "(it is zero: no gradient came back through the all-to-alls: " in message


def honest_observation() -> dict:
    """A return of the shape that grader/scenarios/expert_parallel.py builds."""
    rows = torch.zeros(5, 8)
    grads = {"router.weight": torch.zeros(2, 8), "router.bias": None}
    return {"output_type": "Tensor", "output": rows, "input_grad": rows, "grads": grads}


FORGERIES: dict[str, tuple[Callable[[dict], Any], str]] = {
    "a tensor": (lambda t: torch.zeros(1), "observation: a Tensor, not a dict of output_type, "),
    "no input_grad": (without("input_grad"), "observation: lacks input_grad"),
    "a field more": (setting(extra="x"), "holds 1 key(s) that are not fields"),
    "a string for the output": (setting(output="x"), "output holds a str where a tensor or None"),
    "a list for the grads": (setting(grads=[]), "grads holds a list where a dict is due"),
    "a string for a gradient": (
        setting(grads={"router.weight": "full marks"}),
        "grads holds a str where a tensor or None is due",
    ),
    "no type's name": (setting(output_type=None), "output_type holds None where a type's"),
}


def test_an_honest_observation_reads_into_the_record() -> None:
    """A layer that returned no tensor, with no gradients and parameters of its own names, is
    the submission's to be judged on by the tests (which say what is missing)."""
    tree = setting(output_type="list", output=None, input_grad=None, grads={"mine": None})(
        honest_observation()
    )
    (seen,) = observations([tree], "")
    assert (seen.output_type, seen.output, seen.input_grad) == ("list", None, None)
    assert seen.grads == {"mine": None}
    (seen,) = observations([honest_observation()], "")
    assert seen.grads["router.bias"] is None and seen.output is not None


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_malformed_observation_is_the_ranks_broken_protocol(forgery: str) -> None:
    """The trusted side reads each rank's return into one checked record: a malformed one fails
    in one line, the lowest rank's, charged to the submission as a protocol fault."""
    assert_broken_protocol(
        observations, honest_observation, FORGERIES[forgery], "expert_parallel.forward_backward"
    )


def test_a_forged_observation_earns_nothing(grade) -> None:
    """The scenario's result rewritten in the rank's process (the tokens' gradient dropped):
    every test fails in one line naming the malformed return, never a KeyError of the
    grader's; the communication tests too, which judge the exchange only with the values."""
    graded = grade("ep_forged_observation", PART, world_sizes=(2,))
    said = (
        "rank 0: expert_parallel.forward_backward returned a malformed observation: lacks "
        "input_grad (the same on rank 1)"
    )
    failed, _ = verdicts(graded, 2)
    assert failed == set(ALL)
    for name in ALL:
        assert_earns_nothing(graded.test(name, 2), said)


def test_a_rank_with_no_rows_that_skips_its_backward_all_to_all_is_told_why(grade) -> None:
    """With top-1 of E = p experts expert 0 gets no token, so rank 0 receives no rows; its
    backward skips the all-to-all the others post, and the broker sees the ranks disagree:
    the verdict stands, and the message says why."""
    graded = grade("ep_no_rows_skips_backward", PART, k="moe_top1", world_sizes=(2,))
    test = graded.test("moe_top1[E=p]", 2)
    message = test["output"]
    assert test["extra_data"]["outcome"] == "error" and test["score"] == 0
    assert test["extra_data"]["cause"] == "disagreement"
    assert message.startswith("the ranks disagree on a collective: rank 0 calls all_reduce of ")
    assert "while rank 1 calls all_to_all of " in message
    assert "in this case rank 0 receives no rows for its experts: " in message
    assert "every rank must take part in every all-to-all, forward and backward, " in message
    assert "even with zero-sized splits" in message
    # Every rank has rows both ways with E = 2p: the same layer passes.
    assert graded.outcome("moe_top1[E=2p]", 2) == "passed"
