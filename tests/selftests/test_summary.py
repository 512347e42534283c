"""The terminal summary, from made-up results: fast, no job.

A student reads a matrix (function x world size, then the costs) and one root
cause per function; the rest is counted, not printed. Partial credit is shown as
such, never as a failure. Piped output is not cut at 80 columns.
"""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from grader import protocol
from grader.course.catalog import GradedTest
from grader.course.config import TestSettings as Settings
from grader.failures import Cause, StudentError
from grader.judge.plugin import check_of
from grader.judge.verdict import Verdict
from grader.report.results import GradedResult
from grader.report.summary import fix_first, part_matrix
from grader.report.terminal import print_summary
from grader.testkit.compare import require

WRONG = "rank 0: {f} of float32[{n}]: element 0: expected 0.5, got 0.25 (rank 1's input alone)"


def result(
    name: str,
    size: int,
    outcome: str = protocol.PASSED,
    *,
    kind: str = "correctness",
    message: str = "",
    points: float = 1.0,
    score: float | None = None,
    target: str = "",
    wrong_result: bool = False,
    check: str = "",
) -> GradedResult:
    settings = Settings((size,), points, 10.0, "visible", True)
    function = target or name.split("[")[-1].rstrip("]")
    test = GradedTest("collectives", name, name, f"collectives.{function}", kind, size, settings)
    earned = (points if outcome == protocol.PASSED else 0.0) if score is None else score
    verdict = Verdict(outcome, message, cause=cause_of(outcome, wrong_result, score), check=check)
    return GradedResult(test, verdict, earned)


def cause_of(outcome: str, wrong_result: bool, score: float | None) -> Cause | None:
    """The cause the trusted side would have typed for such a failure."""
    if outcome == protocol.PASSED:
        return None
    if wrong_result:
        return Cause.WRONG_RESULT
    if score:
        return Cause.COST
    causes = {protocol.TIMEOUT: Cause.DEADLOCK, protocol.NOT_RUN: Cause.NOT_RUN}
    return causes.get(outcome, Cause.CHECK)


def broken_all_reduce() -> list[GradedResult]:
    """all_reduce wrong at every world size (its cost tests too), broadcast right but slow."""
    results = [result("broadcast", p) for p in (1, 2, 3, 4)]
    results += [result("all_reduce", 1)]
    results += [
        result(
            "all_reduce",
            p,
            protocol.FAILED,
            message=WRONG.format(f="all_reduce", n=p),
            wrong_result=True,
        )
        for p in (2, 3, 4)
    ]
    results += [
        result(
            "communication[all_reduce]",
            p,
            protocol.FAILED,
            kind="communication",
            points=0.5,
            message=WRONG.format(f="all_reduce", n=49152),
            wrong_result=True,
        )
        for p in (2, 3, 4)
    ]
    results += [
        result(
            "communication[broadcast]",
            p,
            protocol.FAILED,
            kind="communication",
            points=0.5,
            score=0.25,
            message=f"the busiest rank moved 1.{p}x the bound",
        )
        for p in (2, 3)
    ]
    results += [result("communication[broadcast]", 4, kind="communication", points=0.5)]
    results += [
        result(
            "performance[all_reduce]",
            2,
            protocol.NOT_RUN,
            kind="performance",
            points=0.5,
            message="not run: the job ended",
        )
    ]
    return results


def render(results: list[GradedResult], *, verbose: bool = False, width: int = 200) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None)
    print_summary(console, results, 1.0, verbose=verbose)
    return out.getvalue()


def test_matrix_has_a_row_per_function_and_a_column_per_world_size() -> None:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(
        part_matrix("collectives", broken_all_reduce())
    )
    lines = out.getvalue().splitlines()
    header = next(line for line in lines if "function" in line)
    assert header.split() == [
        "function",
        "p=1",
        "p=2",
        "p=3",
        "p=4",
        "communication",
        "performance",
        "points",
    ]
    broadcast = next(line for line in lines if line.split()[:1] == ["broadcast"])
    assert broadcast.split() == [
        "broadcast",
        "✓",
        "✓",
        "✓",
        "✓",
        "partial",
        "p=2,3",
        "5",
        "/",
        "5.5",
    ]
    all_reduce = next(line for line in lines if line.split()[:1] == ["all_reduce"])
    assert all_reduce.split() == [
        "all_reduce",
        "✓",
        "✗",
        "✗",
        "✗",
        "✗",
        "not",
        "run",
        "1",
        "/",
        "6",
    ]
    assert next(line for line in lines if "total" in line).split()[-3:] == ["6", "/", "11.5"]


def test_a_cost_column_marks_the_world_sizes_that_did_not_pass() -> None:
    results = [
        result("communication[all_gather]", 3, protocol.ERROR, kind="communication", points=0.5),
        result("communication[all_gather]", 4, kind="communication", points=0.5),
    ]
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(part_matrix("collectives", results))
    row = next(line for line in out.getvalue().splitlines() if "all_gather" in line)
    assert row.split() == ["all_gather", "error", "p=3", "0.5", "/", "1"]


def test_root_cause_per_function_at_its_smallest_world_size_then_one_line() -> None:
    fixes = fix_first(broken_all_reduce())
    shown = [(r.test.name, r.test.world_size) for r in fixes.shown]
    assert shown == [("all_reduce", 2), ("communication[broadcast]", 2)]
    assert (fixes.repeated, fixes.not_run) == (6, 1)
    text = render(broken_all_reduce())
    # The 6 repeats are named on their cause's line: only the test not run is counted.
    assert "and 1 more test of the same functions not run: `grader run --verbose`" in text
    assert "the same cause failed" in text and "failing the same way" not in text
    assert "--verbose" in text


def test_a_different_problem_of_the_same_function_is_still_shown() -> None:
    results = [
        result(
            "gather", 2, protocol.FAILED, message=WRONG.format(f="gather", n=1), wrong_result=True
        ),
        result("gather", 3, protocol.TIMEOUT, message="rank 1 still in recv from rank 0"),
        result("gather", 4, protocol.TIMEOUT, message="rank 3 still in recv from rank 0"),
    ]
    fixes = fix_first(results)
    assert [r.test.world_size for r in fixes.shown] == [2, 3]
    assert (fixes.repeated, fixes.not_run) == (1, 0)


def test_partial_credit_is_partial_not_failed() -> None:
    text = render(broken_all_reduce())
    line = next(
        line for line in text.splitlines() if "communication[broadcast] (world size 2" in line
    )
    assert "partial: 0.25 of 0.5 points" in line
    assert "2 with partial credit" in text


def test_verbose_lists_every_test_and_every_failure() -> None:
    text = render(broken_all_reduce(), verbose=True)
    assert "communication[all_reduce]" in text and "world size" in text
    assert "more tests" not in text
    for name, size in [("all_reduce", 3), ("all_reduce", 4), ("communication[all_reduce]", 4)]:
        assert f"{name} (world size {size}): " in text


def test_a_long_message_stays_on_one_line_in_a_log() -> None:
    long = "x" * 150
    results = [result("gather", 2, protocol.FAILED, message=long)]
    text = render(results, width=200)
    assert any(line.endswith(long) for line in text.splitlines())


def test_what_a_submission_chose_reaches_the_terminal_without_escape_codes() -> None:
    """A file name and a message with escape codes (clear the screen, retitle the window):
    the terminal gets their text, not the codes."""
    said = "rank 0 said \x1b[2J\x1b]0;owned\x07hello"
    results = [result("broadcast", 2, protocol.FAILED, message=said)]
    out = io.StringIO()
    console = Console(file=out, width=200, color_system=None)
    print_summary(console, results, 1.0, review=["left out of the submission: x\x1b[31m.so"])
    shown = out.getvalue()
    assert "\x1b" not in shown and "\x07" not in shown
    assert "rank 0 said ]0;ownedhello" in shown and "left out of the submission: x.so" in shown


def test_one_line_per_cause_names_the_tests_it_failed() -> None:
    detached = "rank 1: {f} with {m} on {p} stages: return the loss detached (loss.detach())"
    wait = "rank {r} waits in send to rank {s} at assignments/pipeline_parallel.py:97 in _send"
    results = [
        result(
            f"{f}_gradients[m<p]",
            p,
            protocol.FAILED,
            message=detached.format(
                f=f, m="1 microbatch" if p == 2 else f"{p - 1} microbatches", p=p
            ),
            target=f,
            check="test_pipeline_parallel.py:177",  # one check of the test, for both
        )
        for f in ("gpipe_step", "one_f_one_b_step")
        for p in (2, 3)
    ]
    results += [  # one deadlock, its waits listed in another order at every world size
        result(
            "one_f_one_b_schedule",
            p,
            protocol.TIMEOUT,
            kind="schedule",
            message="deadlock: "
            + " while ".join(wait.format(r=r, s=r ^ 1) for r in range(p - p % 2)),
            target="one_f_one_b_step",
        )
        for p in (2, 4)
    ]
    fixes = fix_first(results)
    assert [(r.test.name, r.test.world_size) for r in fixes.shown] == [
        ("gpipe_step_gradients[m<p]", 2),
        ("one_f_one_b_schedule", 2),
    ]
    assert fixes.affected(fixes.shown[0]) == (
        "one_f_one_b_step_gradients[m<p] (p=2,3), gpipe_step_gradients[m<p] (p=3)"
    )
    text = render(results)
    assert text.count("return the loss detached") == 1 and text.count("deadlock: ") == 1
    assert "the same cause failed one_f_one_b_schedule (p=4)" in text


def test_a_second_correctness_test_of_a_class_has_its_own_row() -> None:
    target = "ColumnParallelLinear"
    results = [result(f"column_parallel_linear[gather_output={v}]", 2, target=target) for v in "FT"]
    message = "ColumnParallelLinear(12, 8) on 2 ranks did not raise ValueError"
    results.append(
        result(
            f"indivisible_dimension[{target}]", 2, protocol.FAILED, message=message, target=target
        )
    )
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(part_matrix("tensor_parallel", results))
    lines = out.getvalue().splitlines()
    row = next(line for line in lines if "ColumnParallelLinear" in line and "(" not in line)
    assert row.split()[1:] == ["✓", "2", "/", "2"]
    line = next(line for line in lines if "ColumnParallelLinear (indivisible_dimension)" in line)
    assert line.split()[-4:] == ["✗", "0", "/", "1"]


def test_verbose_prints_every_test_after_the_matrix() -> None:
    text = render(broken_all_reduce(), verbose=True)
    legend, table = text.index("p = world size"), text.index("world size ┃")
    assert legend < table < text.index("What to fix first")


def test_a_part_that_did_not_run_says_why() -> None:
    """A part none of whose tests ran (its file is gone) says why, not only how many."""
    missing = "not submitted: the submission has no collectives.py"
    text = render([result("broadcast", p, protocol.NOT_RUN, message=missing) for p in (1, 2)])
    assert f"  {missing}" in text
    assert "2 tests not run: `grader run --verbose` lists them" in text


def test_a_failed_check_is_named_where_the_graded_test_raised_it() -> None:
    """The check's name is the graded test's line that failed, not its message: a helper's
    own line (``require``) is not it, and a call's failure is typed by its cause."""
    try:
        require(False, "rank 1: element 3 differs")
    except AssertionError as err:
        line = err.__traceback__.tb_lineno if err.__traceback__ else 0
        assert check_of(err, Path(__file__)) == f"test_summary.py:{line}"
    assert check_of(StudentError("rank 0: TypeError"), Path(__file__)) == ""


def test_one_check_failed_with_other_figures_is_one_cause_and_two_checks_are_two() -> None:
    def failed(size: int, check: str, message: str) -> GradedResult:
        return result("gather", size, protocol.FAILED, message=message, check=check)

    results = [
        failed(2, "test_collectives.py:40", "rank 1: 3 items, expected 2"),
        failed(3, "test_collectives.py:40", "ranks 1, 2: 4 items, expected 3"),
        failed(4, "test_collectives.py:52", "rank 3: 4 items, expected 4"),
    ]
    fixes = fix_first(results)
    assert [r.test.world_size for r in fixes.shown] == [2, 4]
    assert fixes.affected(fixes.shown[0]) == "gather (p=3)"
