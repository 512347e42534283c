"""The class at a glance: ``report.html`` beside a batch's gradebook.

One self-contained page (no script, no file beside it): per part, a histogram of the
students' scores; each test's pass rate; and the most common causes of failure with the
students they affected, grouped by the verdicts' machine causes (``extra_data.cause``,
:class:`grader.failures.Cause`) and the function they hit, never by their text. It reads
only the students' results.json files, as the gradebook does.
"""

from __future__ import annotations

import html
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

BINS = 10  # the histogram's bars: tenths of a part's points

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; }
td, th { padding: 0.2em 0.7em; text-align: left; border-bottom: 1px solid #ddd; }
.bar { background: #4a7bd0; height: 1em; display: inline-block; }
.low { background: #d05a4a; }
.num { text-align: right; font-variant-numeric: tabular-nums; }
"""


@dataclass
class PartReport:
    """What a part's section shows, from every student's results."""

    name: str
    possible: float = 0.0
    scores: dict[str, float] = field(default_factory=dict)  # student: points
    passes: dict[str, list[bool]] = field(default_factory=lambda: defaultdict(list))
    causes: dict[tuple[str, str], set[str]] = field(default_factory=lambda: defaultdict(set))

    def add(self, student: str, tests: list[Mapping[str, Any]]) -> None:
        self.possible = max(self.possible, sum(t.get("max_score", 0) for t in tests))
        self.scores[student] = sum(t.get("score", 0) for t in tests)
        for test in tests:
            extra = test.get("extra_data", {})
            passed = test.get("status") == "passed"
            self.passes[f"{extra.get('test')} (p={extra.get('world_size')})"].append(passed)
            if not passed:
                key = (str(extra.get("cause", extra.get("outcome", "?"))), str(extra.get("target")))
                self.causes[key].add(student)

    def histogram(self) -> list[int]:
        counts = [0] * BINS
        for score in self.scores.values():
            share = score / self.possible if self.possible else 0.0
            counts[min(BINS - 1, int(share * BINS))] += 1
        return counts


def build(results: Mapping[str, Mapping[str, Any]]) -> list[PartReport]:
    """Each part's report, from ``results`` (student: results.json's document)."""
    parts: dict[str, PartReport] = {}
    for student, document in sorted(results.items()):
        by_part: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
        for test in document.get("tests", []):
            by_part[str(test.get("extra_data", {}).get("part", "?"))].append(test)
        for part, tests in by_part.items():
            parts.setdefault(part, PartReport(part)).add(student, tests)
    return list(parts.values())


def render(results: Mapping[str, Mapping[str, Any]], title: str = "The class at a glance") -> str:
    """The page."""
    sections = [_section(part, len(results)) for part in build(results)]
    body = "\n".join(sections) or "<p>No student has results yet.</p>"
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>\n<body>\n"
        f"<h1>{html.escape(title)}: {len(results)} students</h1>\n{body}\n</body></html>\n"
    )


def _section(part: PartReport, students: int) -> str:
    e = html.escape
    counts, widest = part.histogram(), max(1, *part.histogram())
    rows = []
    for i, count in enumerate(counts):
        low, high = part.possible * i / BINS, part.possible * (i + 1) / BINS
        style = "bar low" if i < BINS // 2 else "bar"
        bar = f'<span class="{style}" style="width: {200 * count / widest:.0f}px"></span>'
        rows.append(f'<tr><td class="num">{low:g}-{high:g}</td><td>{bar}</td>'
                    f'<td class="num">{count}</td></tr>')  # fmt: skip
    rates = []
    for test, passed in part.passes.items():
        rate = 100 * sum(passed) / len(passed)
        rates.append(f'<tr><td>{e(test)}</td><td class="num">{rate:.0f}%</td></tr>')
    common = Counter({key: len(who) for key, who in part.causes.items()}).most_common(10)
    causes = [
        f'<tr><td>{e(cause)}</td><td>{e(target)}</td><td class="num">{count}</td>'
        f"<td>{e(', '.join(sorted(part.causes[(cause, target)])))}</td></tr>"
        for (cause, target), count in common
    ]
    return (
        f"<h2>{e(part.name)}</h2>\n"
        f"<h3>Scores (of {part.possible:g} points, {students} students)</h3>\n"
        f'<table class="histogram">{"".join(rows)}</table>\n'
        f"<h3>Pass rate per test</h3>\n"
        f'<table class="rates"><tr><th>test</th><th>passed</th></tr>{"".join(rates)}</table>\n'
        f"<h3>Most common causes</h3>\n"
        f'<table class="causes"><tr><th>cause</th><th>function</th><th>students</th>'
        f"<th>who</th></tr>{''.join(causes)}</table>"
    )
