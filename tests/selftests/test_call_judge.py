"""The judge of a call alone, on reports made by hand: who is blamed, in which order, and
what the message says, whatever order the ranks ended in (fast: no job)."""

from __future__ import annotations

import pytest

from grader import failures, protocol
from grader.broker.ops import Problem, Returned
from grader.broker.traffic import Traffic
from grader.failures import Fault
from grader.judge.call import Died, Finished, Stuck, judge_finished, judge_stopped
from grader.protocol import RankError, RankExit

OK = Returned(returned=7)
REFUSED = RankError(protocol.REFUSED_ERROR, "the broker refused the operation")


def finished(outcomes, problems=()) -> Finished:
    return Finished(len(outcomes), outcomes, list(problems), Traffic(), 0.1)


def test_every_rank_returned_is_the_result() -> None:
    result = judge_finished(finished([OK, OK]), "small")
    assert result.returned == [7, 7] and result.args == [(), ()]


def test_a_ranks_own_exception_comes_before_the_deadlock_it_caused() -> None:
    own = RankError("ValueError", "bad split", ("collectives.py:12 in scatter",))
    report = finished([OK, own, REFUSED], [Problem(Fault.DEADLOCK, "rank 2 waits in recv")])
    with pytest.raises(failures.StudentError) as raised:
        judge_finished(report, "3 ranks")
    assert str(raised.value) == (
        "rank 1: ValueError: bad split (at collectives.py:12 in scatter) (case: 3 ranks); "
        "then ranks 0, 2 waited in vain"
    )


def test_the_most_telling_problem_whatever_the_order_seen() -> None:
    problems = [Problem(Fault.DEADLOCK, "no rank can go on"), Problem(Fault.MISMATCH, "sizes")]
    for seen in (problems, problems[::-1]):
        with pytest.raises(failures.CommunicationError, match=r"^sizes \(case: c\)$"):
            judge_finished(finished([OK, OK], seen), "c")


def test_a_forbidden_collective_comes_first() -> None:
    problems = [Problem(Fault.MISMATCH, "sizes"), Problem(Fault.FORBIDDEN, "all_reduce called")]
    with pytest.raises(failures.ForbiddenCall, match="all_reduce called"):
        judge_finished(finished([RankError("RuntimeError", "x"), OK], problems), "")


def test_not_implemented_names_the_function() -> None:
    stub = RankError("NotImplementedError", "", raiser="all_gather")
    with pytest.raises(failures.NotImplementedYet, match="not implemented yet: all_gather"):
        judge_finished(finished([stub, stub]), "")


def test_the_rank_that_died_on_its_own_is_blamed_not_those_stopped_after() -> None:
    stopped, died = RankExit(-9), RankExit(-11)  # SIGKILL by the grader; SIGSEGV
    failure, culprit = judge_stopped(Died({0: stopped, 1: died}, {}), "c")
    assert culprit == 1 and isinstance(failure, failures.Crashed)
    assert str(failure) == "rank 1: the process died during the call (killed by SIGSEGV) (case: c)"


def test_a_rank_that_dies_importing_says_so() -> None:
    failure, _ = judge_stopped(Died({0: RankExit(1, "boom")}, {0: "collectives"}), "")
    assert str(failure) == (
        "rank 0: the process died while importing the submission (exit status 1); "
        "its last output: boom"
    )


def test_stuck_ranks_say_where_they_wait() -> None:
    report = Stuck(
        [0, 1, 2], {0: "recv from rank 1"}, {1: ["f", "collectives.py:9 in ring"]}, {}, 30
    )
    failure, culprit = judge_stopped(report, "")
    assert culprit == 0 and isinstance(failure, failures.TimedOut)
    assert str(failure) == (
        "rank 0 waits in recv from rank 1; rank 1 is stuck at collectives.py:9 in ring; "
        "rank 2 is stuck outside the submission's code (stopped after 30 s)"
    )


def test_a_rank_that_stopped_reading_says_so() -> None:
    report = Stuck([1], {}, {}, {}, 10, unread={1})
    failure, culprit = judge_stopped(report, "")
    assert culprit == 1
    assert str(failure) == "rank 1 stopped reading what the grader sends it (stopped after 10 s)"
