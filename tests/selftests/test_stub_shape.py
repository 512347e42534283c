"""The stubs teach rather than dictate: the contract first, the hints below, one style.

Each stub of ``assignments/`` opens with its contract (arguments, result, what is graded,
the communication budget) and keeps the step-by-step derivation under a "Hints" heading
below it, so a student chooses to read it. Every docstring uses one markup style (single
backticks, "-" bullets), and every stub raises NotImplementedError with the same form of
message. What the docstrings say of the grading is test_stub_docs.py's.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from runner import REPO

ASSIGNMENTS = REPO / "assignments"
# The contract a stub opens with: at most this many lines of text before its "Hints" heading
# (the fully sharded wrapper's, the longest, has 26).
CONTRACT_LINES = 26
# What a docstring of another markup style would hold: reST's double backticks and roles,
# Google-style section headings, "*" bullets.
OTHER_MARKUP = re.compile(
    r"``|:(?:func|class|meth|mod):`|^\s*(?:Args|Returns|Raises):\s*$|^\s*\* ", re.M
)


def stubs(path: Path) -> list[ast.FunctionDef | ast.ClassDef]:
    """The top-level functions and classes of a stub file that raise NotImplementedError."""
    return [
        node
        for node in ast.parse(path.read_text()).body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not_implemented(node)
    ]


def not_implemented(node: ast.AST) -> list[ast.Raise]:
    return [
        found
        for found in ast.walk(node)
        if isinstance(found, ast.Raise)
        and isinstance(found.exc, ast.Call)
        and getattr(found.exc.func, "id", None) == "NotImplementedError"
    ]


STUBS = [(path, node) for path in sorted(ASSIGNMENTS.glob("*.py")) for node in stubs(path)]


def test_every_part_has_its_stubs() -> None:
    files = {path.name for path, _ in STUBS}
    assert files == {p.name for p in ASSIGNMENTS.glob("*.py") if p.name != "__init__.py"}


@pytest.mark.parametrize(("path", "node"), STUBS, ids=lambda x: getattr(x, "name", ""))
def test_a_stub_opens_with_its_contract_and_keeps_the_hints_below(
    path: Path, node: ast.FunctionDef | ast.ClassDef
) -> None:
    lines = (ast.get_docstring(node) or "").splitlines()
    assert "Hints" in lines, f"{path.name} {node.name}: no 'Hints' heading"
    contract = [line for line in lines[: lines.index("Hints")] if line.strip()]
    assert len(contract) <= CONTRACT_LINES, f"{path.name} {node.name}: {len(contract)} lines"
    said = " ".join(contract)
    assert "Graded" in said, f"{path.name} {node.name}: the contract does not say what is graded"
    assert "ommunication" in said, f"{path.name} {node.name}: no communication budget"


@pytest.mark.parametrize("path", sorted({p for p, _ in STUBS}), ids=lambda p: p.name)
def test_a_module_opens_with_its_rules_and_keeps_the_reading_under_hints(path: Path) -> None:
    text = ast.get_docstring(ast.parse(path.read_text())) or ""
    rules = text.split("\n\n")[1]
    assert len(rules.splitlines()) <= 12, f"{path.name}: the module's rules take {rules!r}"
    assert "Hints" in text.splitlines(), f"{path.name}: no 'Hints' heading"


def test_one_markup_style_in_every_stub() -> None:
    found = [
        f"assignments/{path.name} ({scope}): {match.group().strip()!r}"
        for path in sorted(ASSIGNMENTS.glob("*.py"))
        for scope, text in raw_docstrings(path).items()
        for match in OTHER_MARKUP.finditer(text)
    ]
    assert not found, "one markup style (single backticks, '-' bullets): " + ", ".join(found)


def raw_docstrings(path: Path) -> dict[str, str]:
    tree = ast.parse(path.read_text())
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))]
    return {getattr(node, "name", "module"): ast.get_docstring(node) or "" for node in nodes}


def test_every_stub_says_not_implemented_in_one_form() -> None:
    """``<module>.<qualified name>: not implemented yet``, the one message of every raise."""
    wrong = []
    for path in sorted(ASSIGNMENTS.glob("*.py")):
        tree = ast.parse(path.read_text())
        for scope, node in functions(tree):
            for raised in not_implemented(node):
                said = [a.value for a in raised.exc.args if isinstance(a, ast.Constant)]
                wanted = f"{path.stem}.{scope}: not implemented yet"
                if said != [wanted]:
                    wrong.append(f"{path.name}:{raised.lineno} says {said}, not {wanted!r}")
    assert not wrong, wrong


def functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef]]:
    """Every function of a module, by its qualified name (``Class.method``)."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found.append((node.name, node))
        if isinstance(node, ast.ClassDef):
            found += [
                (f"{node.name}.{f.name}", f) for f in node.body if isinstance(f, ast.FunctionDef)
            ]
    return found
