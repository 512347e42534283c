"""The end-of-run summary a student reads: a matrix per part, and what to fix first.

A table of every test (8 functions x 4 world sizes, and their costs) buries the
one line that matters. The matrix answers "which function fails, and where"
at a glance; the list under it gives one root cause per function, at its
smallest world size (the simplest case to debug), and counts the tests that
only repeat it instead of printing them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from rich import box
from rich.table import Table
from rich.text import Text

from grader import protocol
from grader.course.config import COST_KINDS
from grader.failures import Cause
from grader.report.results import GradedResult, Points

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
    if Points.of(results).partial:
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
    return str(Points.of(results))


def matrix_rows(results: list[GradedResult]) -> dict[str, list[GradedResult]]:
    """The matrix's rows: one per function, with its cost tests; a function's other
    correctness tests (``indivisible_dimension`` beside ``column_parallel_linear``) get a
    row of their own under it, so that a cell says which test it is."""
    by_target: dict[str, dict[str, list[GradedResult]]] = {}
    first: dict[str, str] = {}  # each function's first correctness test
    for result in results:
        test, row = result.test, ""  # "": the function's own row
        base = test.name.split("[", 1)[0]
        if test.kind not in COST_KINDS and first.setdefault(test.target, base) != base:
            row = base
        by_target.setdefault(test.target, {}).setdefault(row, []).append(result)
    rows: dict[str, list[GradedResult]] = {}
    for target, by_row in by_target.items():
        name = function_name(target)
        for row, mine in by_row.items():
            rows[f"{name} ({row})" if row else name] = mine
    return rows


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
    for row, mine in matrix_rows(results).items():
        correctness = [r for r in mine if r.test.kind not in COST_KINDS]
        cells = [_cell([r for r in correctness if r.test.world_size == s]) for s in sizes]
        cells += [_cost_cell([r for r in mine if r.test.kind == k]) for k in kinds]
        table.add_row(Text(row), *cells, _points(mine))
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
    """What to fix first: one failure per cause, the tests it also failed, the counts."""

    shown: list[GradedResult]
    repeated: int  # failures that repeat a cause already shown (named on its line)
    not_run: int
    same_functions: bool  # every test counted is of a function already shown
    also: dict[int, list[GradedResult]] = field(default_factory=dict)  # by id of a shown one

    @property
    def hidden(self) -> int:
        return self.repeated + self.not_run

    def summary_line(self) -> str:
        """What the causes above leave unsaid. Each failure that repeats a cause is named on
        that cause's line (:meth:`affected`), so only the tests not run are counted here."""
        if self.not_run:
            plural = "s" if self.not_run > 1 else ""
            whose = " of the same functions" if self.same_functions and self.shown else ""
            counted = f"{self.not_run} {'more ' if self.shown else ''}test{plural}{whose}"
            lead = "and " if self.shown else ""
            return f"{lead}{counted} not run: `grader run --verbose` lists them"
        if self.repeated:
            return "`grader run --verbose` lists every test"
        return ""

    def affected(self, shown: GradedResult, limit: int = 6) -> str:
        """The other tests that failed of ``shown``'s cause: name (world sizes), ..."""
        sizes: dict[str, list[int]] = {}
        for result in self.also.get(id(shown), []):
            sizes.setdefault(result.test.name, []).append(result.test.world_size)
        names = [f"{n} (p={','.join(map(str, sorted(set(w))))})" for n, w in sizes.items()]
        more = f" and {len(names) - limit} more" if len(names) > limit else ""
        return ", ".join(names[:limit]) + more


def cause(result: GradedResult) -> tuple[str, str]:
    """What a failure is, as the trusted side typed it where it was raised: its
    :class:`Cause` and the check that failed. Two failures of one cause are one line.

    A wrong result is one cause per function (a cost test checks the call's result first,
    so a wrong sum fails it too, with other sizes and numbers); so is a failure of no
    named check (a deadlock of the function, whatever its world size).
    """
    verdict = result.verdict
    kind = str(verdict.cause or verdict.outcome)
    if verdict.cause is Cause.WRONG_RESULT or not verdict.check:
        return kind, result.test.target
    return kind, verdict.check


def fix_first(results: list[GradedResult], collapse: bool = True) -> FixList:
    """One line per cause: its simplest failure (smallest world size, correctness before
    costs), with the other tests it failed; tests not run are counted, not printed. With
    ``collapse`` False every failure is printed."""
    failures = [r for r in results if not r.verdict.passed]
    ran = [r for r in failures if r.verdict.outcome != protocol.NOT_RUN]
    skipped = [r for r in failures if r.verdict.outcome == protocol.NOT_RUN]
    if not collapse:
        return FixList(ran + skipped, 0, 0, True)
    order = {id(r): i for i, r in enumerate(results)}

    def simplest(r: GradedResult) -> tuple[int, int, int]:
        kind = COST_KINDS.index(r.test.kind) + 1 if r.test.kind in COST_KINDS else 0
        return r.test.world_size, kind, order[id(r)]

    first: dict[tuple[str, str], GradedResult] = {}
    also: dict[int, list[GradedResult]] = {}
    for result in sorted(ran, key=simplest):
        shown = first.setdefault(cause(result), result)
        if shown is not result:
            also.setdefault(id(shown), []).append(result)
    shown = sorted(first.values(), key=lambda r: order[id(r)])
    same = {r.test.target for r in skipped} <= {r.test.target for r in shown}
    repeated = sum(len(v) for v in also.values())
    return FixList(shown, repeated, len(skipped), same, also)
