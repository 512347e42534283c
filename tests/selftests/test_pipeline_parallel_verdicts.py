"""Verdicts of the pipeline_parallel graded tests on the reference, stubs and broken submissions.

Each broken submission (``submissions/pp_*``) fails in one way; the tests assert the
verdict a careful TA would give (outcome, kind, the hint in the message) and that every
other test of that submission still passes.
"""

from __future__ import annotations

import re

PART = "pipeline_parallel"
REGIMES = ("m<p", "m=p", "m>p")
GRADIENTS = [f"{s}_gradients[{r}]" for s in ("gpipe", "one_f_one_b") for r in REGIMES]
SCHEDULES = ["gpipe_schedule", "one_f_one_b_schedule"]


def test_reference_passes_everything(grade) -> None:
    graded = grade("reference")  # every part, shared with the other files' tests
    assert graded.returncode == 0, graded.stdout + graded.stderr
    mine = {
        (t["extra_data"]["test"], t["extra_data"]["world_size"]): t
        for t in graded.tests
        if t["extra_data"]["part"] == PART
    }
    assert set(mine) == {(name, size) for name in GRADIENTS + SCHEDULES for size in (2, 3, 4)}
    assert {t["extra_data"]["outcome"] for t in mine.values()} == {"passed"}
    assert sum(t["score"] for t in mine.values()) == 30
    schedule = mine[("one_f_one_b_schedule", 4)]["extra_data"]
    assert schedule["timeline"] == schedule["expected_timeline"]
    # The broker's record alone shows stage r with p - r microbatches in flight, no more.
    assert schedule["in_flight_lower_bound_from_messages"] == [4, 3, 2]


def test_stubs_fail_everything_as_not_implemented(grade) -> None:
    graded = grade("stubs")  # every part, shared with the other files' tests
    assert graded.returncode == 1
    mine = [t for t in graded.tests if t["extra_data"]["part"] == PART]
    assert len(mine) == 24
    for test in mine:
        assert test["extra_data"]["outcome"] == "failed", test["name"]
        assert "not implemented" in test["output"], test["name"]
        assert test["score"] == 0


GPIPE_IN_1F1B = (
    "rank 0: one_f_one_b_step with 9 microbatches on 4 stages: stage 0 sent microbatch 4's "
    "activation to stage 1 before microbatch 0's gradient reached it (the broker's record of "
    "its messages): 1F1B runs B0 before F4; 1F1B's warm-up on stage 0 of 4 is 3 forwards"
)


def test_1f1b_running_gpipe_fails_only_the_1f1b_schedule(grade) -> None:
    graded = grade("pp_1f1b_runs_gpipe", PART, world_sizes=(2, 4))
    for (name, size), outcome in graded.outcomes().items():
        assert outcome == ("failed" if name == "one_f_one_b_schedule" else "passed"), (name, size)
    entry = graded.test("one_f_one_b_schedule", 4)
    assert entry["extra_data"]["kind"] == "schedule"
    assert entry["output"].startswith(GPIPE_IN_1F1B), entry["output"]
    assert "at most 4 microbatches are in flight" in entry["output"]
    gpipe = [f"F{i}" for i in range(9)] + [f"B{i}" for i in range(9)]
    assert entry["extra_data"]["timeline"][:3] == [gpipe] * 3  # as the broker saw it
    # Every stage sent all 9 activations before the first gradient came back.
    assert entry["extra_data"]["in_flight_lower_bound_from_messages"] == [9, 9, 9]
    expected = entry["extra_data"]["expected_timeline"]
    assert expected[0][:6] == ["F0", "F1", "F2", "F3", "B0", "F4"]
    assert expected[3][:4] == ["F0", "B0", "F1", "B1"]
    assert "stage 0 of 2 is 1 forward," in graded.message("one_f_one_b_schedule", 2)


def test_a_forged_timeline_fails_on_the_brokers_record(grade) -> None:
    """GPipe run, then any timeline the stage keeps rewritten to 1F1B's: nothing the rank
    holds is read, and the verdict fails on what the broker saw of the messages."""
    graded = grade("pp_forged_timeline", PART, world_sizes=(2, 4))
    for (name, size), outcome in graded.outcomes().items():
        assert outcome == ("failed" if name == "one_f_one_b_schedule" else "passed"), (name, size)
    entry = graded.test("one_f_one_b_schedule", 4)
    assert entry["score"] == 0
    assert entry["extra_data"]["timeline"] != entry["extra_data"]["expected_timeline"]
    assert entry["output"].startswith(GPIPE_IN_1F1B), entry["output"]
    assert entry["extra_data"]["in_flight_lower_bound_from_messages"] == [9, 9, 9]


def test_receives_asked_for_early_do_not_hide_the_order_of_the_messages(grade) -> None:
    """Every receive posted and polled at the start, each schedule running the other: a
    message reaches a stage only when it was sent, and the order of the sends shows."""
    graded = grade("pp_asked_early", PART, world_sizes=(4,))
    assert failing(graded) == dict.fromkeys(SCHEDULES, "failed")  # the gradients are right
    assert graded.message("one_f_one_b_schedule", 4).startswith(GPIPE_IN_1F1B)
    # Stage 1 runs 1F1B: microbatch 0's gradient leaves once activations 0 to 2 are in. Which
    # later one the broker handed over last depends on when the stage polled for it (8 on an
    # idle machine; another once, in a full run of the self-tests): the message names it.
    message = graded.message("gpipe_schedule", 4)
    assert re.match(
        r"rank 1: gpipe_step with 9 microbatches on 4 stages: stage 1 sent microbatch 0's "
        r"gradient back to stage 0 before microbatch [3-8]'s activation reached it \(the "
        r"broker's record of its messages\): GPipe runs every forward before any backward",
        message,
    ), message


def test_unscaled_loss_fails_gradients_with_the_scaling_hint(grade) -> None:
    graded = grade("pp_loss_not_scaled", PART, world_sizes=(2, 3))
    for name in SCHEDULES:
        assert graded.outcome(name, 2) == graded.outcome(name, 3) == "passed"
    for name in GRADIENTS:
        for size in (2, 3):
            if size == 2 and name.endswith("[m<p]"):  # one microbatch: 1/m changes nothing
                assert graded.outcome(name, size) == "passed"
                continue
            m = {"m<p": size - 1, "m=p": size, "m>p": 2 * size + 1}[name[-4:-1]]
            assert graded.outcome(name, size) == "failed", (name, size)
            assert graded.test(name, size)["extra_data"]["kind"] == "correctness"
            message = graded.message(name, size)
            assert message.startswith(f"rank 0: {name.split('_gradients')[0]}"), message
            assert "stage 0, parameter 0.weight: gradient differs by" in message
            assert f"about {m}x the expected: is each microbatch's loss scaled by " in message


def test_blocking_sends_deadlock_in_1f1b(grade) -> None:
    graded = grade("pp_blocking_send_1f1b", PART, world_sizes=(2,))
    deadlocked = ["one_f_one_b_gradients[m=p]", "one_f_one_b_gradients[m>p]"]
    deadlocked.append("one_f_one_b_schedule")
    for (name, size), outcome in graded.outcomes().items():
        assert outcome == ("timeout" if name in deadlocked else "passed"), (name, size, outcome)
    for name in deadlocked:
        message = graded.message(name, 2)
        assert message.startswith("deadlock: rank 0 waits in send to rank 1 at "), message
        assert " while rank 1 waits in send to rank 0 at " in message
        assert "assignments/pipeline_parallel.py" in message


def failing(graded) -> dict[str, str]:
    """The tests that did not pass, with their outcome (one world size per submission)."""
    outcomes = graded.outcomes()
    assert outcomes, graded.stdout + graded.stderr
    return {name: outcome for (name, _), outcome in outcomes.items() if outcome != "passed"}


def test_gpipe_backwards_in_reverse_order_fail_its_schedule(grade) -> None:
    graded = grade("pp_gpipe_reverse_backward", PART, world_sizes=(2,))
    assert failing(graded) == {"gpipe_schedule": "failed"}  # the gradients are right
    message = graded.message("gpipe_schedule", 2)
    assert "sent microbatch 4's gradient to stage 0 before microbatch 0's (in reverse order)" in (
        message
    )
    assert "forward order, microbatch 0 first" in message


def test_1f1b_warmup_without_min_fails_with_one_microbatch_on_3_stages(grade) -> None:
    graded = grade("pp_1f1b_no_min", PART, world_sizes=(3,))
    assert failing(graded) == {"one_f_one_b_schedule": "error"}  # m = 1 is in that test only
    message = graded.message("one_f_one_b_schedule", 3)
    assert message.startswith("rank 0: IndexError: "), message
    assert "with 1 microbatch on 3 stages" in message and "min(p - r - 1, m)" in message


def test_an_activation_without_requires_grad_is_named_in_the_deadlock(grade) -> None:
    graded = grade("pp_no_requires_grad", PART, world_sizes=(2,))
    assert failing(graded) == dict.fromkeys(GRADIENTS + SCHEDULES, "timeout")
    for name in GRADIENTS + SCHEDULES:
        message = graded.message(name, 2)
        assert message.startswith("deadlock: rank 0 waits in recv from rank 1 at "), message
        assert "requires_grad_()" in message and ".grad is None" in message
        if "rank 1 waits" not in message:  # rank 1 returned: what it never sent is said
            assert "but rank 1 returned without sending it" in message


def test_gpipe_backward_before_the_forwards_are_done_is_a_schedule_error(grade) -> None:
    graded = grade("pp_gpipe_backward_early", PART, world_sizes=(2,))
    early = ["gpipe_gradients[m=p]", "gpipe_gradients[m>p]", "gpipe_schedule"]
    assert failing(graded) == dict.fromkeys(early, "timeout")  # one microbatch: GPipe's order
    for name in early:
        message = graded.message(name, 2)
        assert message.startswith("deadlock: "), message
        assert "a schedule error: stage 1 started a backward" in message
        assert "every forward before any backward" in message


def test_a_microbatch_backpropagated_twice_is_named(grade) -> None:
    graded = grade("pp_microbatch_twice", PART, world_sizes=(2,))
    assert failing(graded) == dict.fromkeys(GRADIENTS + SCHEDULES, "failed")
    for name in GRADIENTS:
        message = graded.message(name, 2)
        if name.endswith("[m<p]"):  # one microbatch: twice it is 2x
            assert "about 2x the expected" in message, message
        else:
            assert "microbatch 0's share is there twice" in message, message
    for name in SCHEDULES:
        message = graded.message(name, 2)
        assert "sent microbatch 0's gradient back at 2x the scale of its other" in message


def test_a_forged_observation_earns_nothing(grade) -> None:
    """The scenario's result rewritten in the rank's process (a string where the stage's
    gradients are due): every gradients test fails in one line naming the malformed return,
    never a KeyError or AttributeError of the grader's; the schedules, judged on the broker's
    record alone, pass."""
    graded = grade("pp_forged_observation", PART, world_sizes=(2,))
    said = (
        "rank 0: pipeline_parallel.step returned a malformed observation: grads holds a str "
        "where a dict is due (the same on rank 1)"
    )
    for (name, size), outcome in graded.outcomes().items():
        assert outcome == ("error" if name in GRADIENTS else "passed"), (name, size)
    for name in GRADIENTS:
        test = graded.test(name, 2)
        assert test["score"] == 0 and test["extra_data"]["cause"] == "protocol"
        assert graded.message(name, 2).startswith(said), graded.message(name, 2)
        assert "\n" not in test["output"].strip() and "Error" not in test["output"]
