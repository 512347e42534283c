"""The end-of-run summary a student reads: a matrix per part, and what to fix first.

A table of every test (8 functions x 4 world sizes, and their costs) buries the
one line that matters. The matrix answers "which function fails, and where"
at a glance; the list under it gives one root cause per function, at its
smallest world size (the simplest case to debug), and counts the tests that
only repeat it instead of printing them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from rich import box
from rich.table import Table
from rich.text import Text

from grader import protocol
from grader.report.results import GradedResult

PASS_MARK, FAIL_MARK, PARTIAL = "✓", "✗", "partial"
OUTCOME_STYLE = {
    protocol.PASSED: "green",
    protocol.FAILED: "red",
    protocol.ERROR: "red",
    protocol.TIMEOUT: "magenta",
    protocol.CRASHED: "red bold",
    protocol.FORBIDDEN: "yellow",
    protocol.NOT_RUN: "dim",
}
PARTIAL_STYLE = "yellow"
LEGEND = "p = world size; ✓ passed, ✗ failed, partial: some of the points"
# Costs are graded on top of correctness: their columns follow the world sizes.
COST_KINDS = ("communication", "performance", "schedule")
_WRONG_RESULT = re.compile(r"(: element \S+.*: expected .*, got )|(: expected (shape|dtype) )")
_NUMBER = re.compile(r"\d+(\.\d+)?(e[-+]?\d+)?")


def is_partial(result: GradedResult) -> bool:
    """Some of the points, not all: shown as partial, not failed."""
    return 0 < result.score < result.max_score


def label(result: GradedResult) -> str:
    """The word for a result: the outcome, or ``partial`` for partial credit."""
    return PARTIAL if is_partial(result) else result.verdict.outcome


def function_name(target: str) -> str:
    """``collectives.all_reduce`` -> ``all_reduce``: the part is the table's title."""
    return target.split(".", 1)[-1]


def _cell(results: list[GradedResult]) -> Text:
    """One mark for the tests of a function at a world size (or of one cost kind)."""
    if not results:
        return Text("")
    if all(r.verdict.passed for r in results):
        return Text(PASS_MARK, style=OUTCOME_STYLE[protocol.PASSED])
    if 0 < sum(r.score for r in results) < sum(r.max_score for r in results):
        return Text(PARTIAL, style=PARTIAL_STYLE)
    outcomes = {r.verdict.outcome for r in results if not r.verdict.passed}
    outcome = outcomes.pop() if len(outcomes) == 1 else protocol.FAILED
    word = FAIL_MARK if outcome == protocol.FAILED else outcome.replace("_", " ")
    return Text(word, style=OUTCOME_STYLE.get(outcome, "red"))


def _cost_cell(results: list[GradedResult]) -> Text:
    """A cost kind over every world size: the mark of those that did not pass, and which
    they are when others did (an error at p=3 is not "partial" because p=4 passed)."""
    failing = [r for r in results if not r.verdict.passed]
    if not failing:
        return _cell(results)
    cell = _cell(failing)
    if len(failing) < len(results):
        cell.append(" p=" + ",".join(map(str, sorted({r.test.world_size for r in failing}))))
    return cell


def _points(results: Iterable[GradedResult]) -> str:
    results = list(results)
    return f"{sum(r.score for r in results):g} / {sum(r.max_score for r in results):g}"


def part_matrix(part: str, results: list[GradedResult]) -> Table:
    """One row per function, one column per world size (correctness), then one per cost kind."""
    sizes = sorted({r.test.world_size for r in results if r.test.kind not in COST_KINDS})
    kinds = [k for k in COST_KINDS if any(r.test.kind == k for r in results)]
    table = Table(
        title=Text(part, style="bold"),
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
    )
    table.add_column("function")
    for size in sizes:
        table.add_column(f"p={size}", justify="center")
    for kind in kinds:
        table.add_column(kind, justify="center")
    table.add_column("points", justify="right")
    targets = list(dict.fromkeys(r.test.target for r in results))
    for target in targets:
        mine = [r for r in results if r.test.target == target]
        correctness = [r for r in mine if r.test.kind not in COST_KINDS]
        cells = [_cell([r for r in correctness if r.test.world_size == s]) for s in sizes]
        cells += [_cost_cell([r for r in mine if r.test.kind == k]) for k in kinds]
        table.add_row(Text(function_name(target)), *cells, _points(mine))
    table.add_section()
    table.add_row(Text("total", style="bold"), *[""] * (len(sizes) + len(kinds)), _points(results))
    return table


def per_test_table(part: str, results: list[GradedResult]) -> Table:
    """Every test on its own row (``grader run --verbose``)."""
    table = Table(title=Text(part, style="bold"), title_justify="left")
    table.add_column("test")
    table.add_column("target")
    table.add_column("world size", justify="right")
    table.add_column("outcome")
    table.add_column("points", justify="right")
    for result in results:
        word = label(result)
        style = PARTIAL_STYLE if word == PARTIAL else OUTCOME_STYLE.get(word, "")
        table.add_row(
            Text(result.test.name),
            Text(result.test.target),
            str(result.test.world_size),
            Text(word, style=style),
            f"{result.score:g} / {result.max_score:g}",
        )
    table.add_section()
    table.add_row("[bold]total", "", "", "", f"[bold]{_points(results)}")
    return table


@dataclass(frozen=True)
class FixList:
    """What to fix first: the failures to print, and what the summary line counts."""

    shown: list[GradedResult]
    repeated: int  # failures that repeat a problem already shown
    not_run: int
    same_functions: bool  # every test counted is of a function already shown

    @property
    def hidden(self) -> int:
        return self.repeated + self.not_run

    def summary_line(self) -> str:
        if not self.hidden:
            return ""
        counts = [
            f"{self.repeated} failing the same way" if self.repeated else "",
            f"{self.not_run} not run" if self.not_run else "",
        ]
        whose = " of the same functions" if self.same_functions else ""
        plural = "s" if self.hidden > 1 else ""
        return (
            f"and {self.hidden} more test{plural}{whose} "
            f"({', '.join(c for c in counts if c)}): `grader run --verbose` lists them"
        )


def problem(result: GradedResult) -> str:
    """What a failure says, without the figures: two failures alike here are one problem.

    Every wrong result is one problem per function: a cost test checks the call's
    result first, so a wrong sum fails it too, with other sizes and numbers.
    """
    message = result.verdict.message
    if _WRONG_RESULT.search(message):
        return "a wrong result"
    return result.verdict.outcome + ": " + _NUMBER.sub("#", message.split(" (case: ")[0])


def fix_first(results: list[GradedResult], collapse: bool = True) -> FixList:
    """Root causes first: each function's failure at its smallest world size; then failures
    that say something new; tests not run, and failures that repeat a listed problem, are
    counted, not printed (unless ``collapse`` is False)."""
    failures = [r for r in results if not r.verdict.passed]
    ran = [r for r in failures if r.verdict.outcome != protocol.NOT_RUN]
    skipped = [r for r in failures if r.verdict.outcome == protocol.NOT_RUN]
    if not collapse:
        return FixList(ran + skipped, 0, 0, True)
    order = {id(r): i for i, r in enumerate(results)}

    def simplest(r: GradedResult) -> tuple[int, int, int]:
        kind = COST_KINDS.index(r.test.kind) + 1 if r.test.kind in COST_KINDS else 0
        return r.test.world_size, kind, order[id(r)]

    roots: dict[str, GradedResult] = {}
    for result in sorted(ran, key=simplest):
        roots.setdefault(result.test.target, result)
    shown = sorted(roots.values(), key=lambda r: order[id(r)])
    seen = {(r.test.target, problem(r)) for r in shown}
    repeated, listed = 0, {id(r) for r in shown}
    for result in sorted(ran, key=simplest):
        if id(result) in listed:
            continue
        key = (result.test.target, problem(result))
        if key in seen:
            repeated += 1
            continue
        seen.add(key)
        shown.append(result)
    same = {r.test.target for r in skipped} <= {r.test.target for r in shown}
    return FixList(shown, repeated, len(skipped), same)
