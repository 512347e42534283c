"""The layout that shows the design: no import circles in ``grader/``, no function or class
too long to read at a sitting (and no module past a generous bound).

An import circle is counted whatever form its imports take (at the top, under
``TYPE_CHECKING``, inside a function): each one still means two modules that cannot be
read, or moved, one without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

from runner import REPO

MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250
MAX_MODULE_LINES = 600  # a file of many short pieces may be long; past this, split it
FOLDERS = ("grader", "reference", "assignments", "tests", "benchmarks")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports, in any form."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return (found & modules) - {name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_circles_in_the_grader() -> None:
    paths = sorted((REPO / "grader").rglob("*.py"))
    modules = {module_name(path) for path in paths}
    graph = {module_name(path): imported(path, modules) for path in paths}
    assert "grader.launch.world" in graph["grader.judge.plugin"]  # the graph is read
    assert circles(graph) == []


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_graded_tests_import_only_the_testkit_and_the_scenarios() -> None:
    """What the README promises a course author: the graded tests stand on the public
    testkit (and the rank-side model code their oracles run), not on the grader's rooms."""
    modules = {module_name(path) for path in (REPO / "grader").rglob("*.py")}
    allowed = ("grader.testkit", "grader.scenarios")
    reached = {
        path.name: sorted(m for m in imported(path, modules) if not m.startswith(allowed))
        for path in (REPO / "tests" / "graded").glob("*.py")
    }
    assert {name: found for name, found in reached.items() if found} == {}
    assert reached  # the graded tests were read


def our_sources() -> dict[str, str]:
    """Every Python file of ours, by path: the hostile submissions of the self-tests are not."""
    return {
        str(path.relative_to(REPO)): path.read_text()
        for folder in FOLDERS
        for path in (REPO / folder).rglob("*.py")
        if "submissions" not in path.relative_to(REPO).parts
    }


def too_long(source: str, kind: type | tuple[type, ...], most: int) -> dict[str, int]:
    """The definitions of ``kind`` in ``source`` longer than ``most`` lines, by name."""
    return {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(ast.parse(source))
        if isinstance(node, kind) and node.end_lineno - node.lineno + 1 > most
    }


def test_no_function_over_60_lines_and_no_class_over_250() -> None:
    sources = our_sources()
    assert "grader/broker/server.py" in sources  # the tree was read
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    found = {
        f"{path}: {name}": lines
        for path, source in sources.items()
        for kind, most in ((functions, MAX_FUNCTION_LINES), (ast.ClassDef, MAX_CLASS_LINES))
        for name, lines in too_long(source, kind, most).items()
    }
    assert found == {}, f"too long to read at a sitting (split them): {found}"


def test_no_module_over_600_lines() -> None:
    lengths = {path: len(source.splitlines()) for path, source in our_sources().items()}
    too_long = {path: lines for path, lines in lengths.items() if lines > MAX_MODULE_LINES}
    assert too_long == {}, f"over {MAX_MODULE_LINES} lines (split them): {too_long}"


def test_the_length_finder_finds_a_long_function() -> None:
    source = "class A:\n    def f(self):\n" + "        x = 1\n" * 70
    assert too_long(source, ast.FunctionDef, 60) == {"f": 71}
    assert too_long(source, ast.ClassDef, 250) == {}
