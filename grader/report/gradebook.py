"""The gradebook: ``student,total,<a column per part>``, a row per student, in points.

A student's name is a folder name, which anyone can choose: a cell that a spreadsheet would
run as a formula (starting with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return, or
with ``'``) starts with ``'``, OWASP's advice against CSV injection; :func:`from_cell`
reads it back.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping
from typing import Any

_FORMULA = ("=", "+", "-", "@", "\t", "\r")  # what a spreadsheet may run (OWASP), and "'":
_QUOTE = "'"  # the prefix that neutralises them, so that a name beginning with it is quoted too


def to_cell(text: str) -> str:
    """A gradebook cell that a spreadsheet shows as the text it is, never runs."""
    return _QUOTE + text if text.startswith((*_FORMULA, _QUOTE)) else text


def from_cell(cell: str) -> str:
    """The text of a cell :func:`to_cell` wrote."""
    quoted = cell.startswith(_QUOTE) and cell[1:].startswith((*_FORMULA, _QUOTE))
    return cell[1:] if quoted else cell


def row(student: str, results: Mapping[str, Any] | None, parts: list[str]) -> list[str]:
    """A student's row: total and each part's points, or empty cells if not graded."""
    if results is None:
        return [student, "", *([""] * len(parts))]
    by_part = dict.fromkeys(parts, 0.0)
    for test in results["tests"]:
        part = test.get("extra_data", {}).get("part")
        if part in by_part:
            by_part[part] += float(test.get("score", 0))
    return [student, points(results["score"]), *(points(by_part[p]) for p in parts)]


def points(value: float) -> str:
    return f"{value:.4f}".rstrip("0").rstrip(".")


def text(parts: list[str], rows: list[list[str]]) -> str:
    """The whole file, its cells made safe."""
    out = io.StringIO()
    table = [["student", "total", *parts], *rows]
    csv.writer(out, lineterminator="\n").writerows([list(map(to_cell, line)) for line in table])
    return out.getvalue()
