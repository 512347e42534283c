"""What the stubs' docstrings say of the grading is what tests/graded/grading.yaml says.

The stubs in ``assignments/`` tell students how they are graded: world sizes,
points, element counts, the ratios that earn the points. Those figures are
grading.yaml's, restated in prose; each restatement is a claim below, read
from the docstring it is in and checked against the loaded configuration, so
that a change to grading.yaml that the docstrings do not follow fails here.
A ratio ("1.5x") or a number of points in a stub's docstring that no claim
reads fails too: a new restatement gets its claim. Their shape is
test_stub_shape.py's.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from runner import REPO

from grader.course.config import GradingConfig, load_config
from grader.testkit.calls import COLLECTIVES

if TYPE_CHECKING:
    from grader.course.config import TestSettings

ASSIGNMENTS = REPO / "assignments"
CONFIG = load_config(REPO / "tests" / "graded" / "grading.yaml")
# What grading.yaml's figures look like in prose: a ratio, or a number of points.
RESTATED = re.compile(r"\b\d+(?:\.\d+)?x\b|\b\d+(?:\.\d+)? points?\b")
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20}


@dataclass(frozen=True)
class Claim:
    """``pattern``, found in the docstring of ``scope`` (``module``, ``function`` or
    ``Class``) of ``assignments/<file>``, captures a figure that must equal ``expected``."""

    file: str
    scope: str
    pattern: str
    expected: Callable[[GradingConfig], object]
    read: Callable[[str], object] = float

    def __str__(self) -> str:
        return f"assignments/{self.file} ({self.scope}): {self.pattern!r}"


def settings(part: str, test: str) -> Callable[[GradingConfig], TestSettings]:
    return lambda config: config.part(part).settings_for(test)


def world_sizes(part: str, *tests: str) -> Callable[[GradingConfig], object]:
    """The world sizes of ``tests``, which must all have the same."""
    return lambda config: one(settings(part, t)(config).world_sizes for t in tests)


def points(part: str, *tests: str) -> Callable[[GradingConfig], object]:
    return lambda config: one(settings(part, t)(config).points for t in tests)


def option(part: str, test: str, name: str, scale: float = 1) -> Callable[[GradingConfig], object]:
    """Option ``name`` of ``test`` (an entry of a mapping: ``name/key``), times ``scale``."""

    def expected(config: GradingConfig) -> object:
        first, *keys = name.split("/")
        value = getattr(settings(part, test)(config).options, first)
        for key in keys:
            value = value[key]
        return float(value) * scale

    return expected


def one(values) -> object:
    found = set(values)
    assert len(found) == 1, f"the docstring states one figure where grading.yaml has {found}"
    return found.pop()


def ranks(text: str) -> tuple[int, ...]:
    """'p = 2, 3, 4' or 'p = 2 and 4' -> (2, 3, 4), (2, 4)."""
    return tuple(int(n) for n in re.findall(r"\d+", text))


def size(text: str) -> float:
    """'49152', '1M', '192 K' -> elements or bytes (K and M are 2**10 and 2**20)."""
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?) ?([KM]?)", text).groups()
    return float(number) * UNITS[unit]


COLLECTIVES_CLAIMS = [
    Claim(
        "collectives.py",
        "module",
        r"Correctness, (\S+) point per function",
        points("collectives", *COLLECTIVES),
    ),
    Claim(
        "collectives.py",
        "module",
        r"Correctness, \S+ point per function per world size (p = [\d, ]+\d)\.",
        world_sizes("collectives", *COLLECTIVES),
        ranks,
    ),
    Claim(
        "collectives.py",
        "module",
        r"`communication\[<function>\]`, (\S+) point",
        points("collectives", "communication"),
    ),
    Claim(
        "collectives.py",
        "module",
        r"`communication\[<function>\]`, \S+ point at (p = [\d, and]+\d),",
        world_sizes("collectives", "communication"),
        ranks,
    ),
    Claim(
        "collectives.py",
        "module",
        r"`communication\[<function>\]`, [^:]*? on (\d+) float32 elements",
        option("collectives", "communication", "communication_elements"),
        size,
    ),
    Claim(
        "collectives.py",
        "module",
        r"on \d+ float32 elements \((\d+ K)B\)",
        option("collectives", "communication", "communication_elements", scale=4),
        size,
    ),
    Claim(
        "collectives.py",
        "module",
        r"`performance\[<function>\]`, (\S+) point",
        points("collectives", "performance"),
    ),
    Claim(
        "collectives.py",
        "module",
        r"`performance\[<function>\]`, \S+ point at (p = [\d, and]+\d),",
        world_sizes("collectives", "performance"),
        ranks,
    ),
    Claim(
        "collectives.py",
        "module",
        r"`performance\[<function>\]`, [^:]*? on (\d+M) float32 elements",
        option("collectives", "performance", "performance_elements"),
        size,
    ),
    Claim(
        "collectives.py",
        "module",
        r"on \d+M float32 elements \((\d+ M)B\)",
        option("collectives", "performance", "performance_elements", scale=4),
        size,
    ),
    Claim(
        "collectives.py",
        "module",
        r"full points within (\S+)x the reference's time",
        option("collectives", "performance", "full_points_within"),
    ),
    Claim(
        "collectives.py",
        "module",
        r"none beyond (\S+)x, linear between",
        option("collectives", "performance", "zero_points_beyond"),
    ),
    *(
        Claim(
            "collectives.py",
            function,
            r"the busiest rank may move at most (\S+)x the bound",
            option("collectives", "communication", f"max_bytes_ratio/{function}"),
        )
        for function in COLLECTIVES
    ),
]

TENSOR_PARALLEL_TESTS = (
    "column_parallel_linear",
    "row_parallel_linear",
    "region_function",
    "parallel_mlp",
    "indivisible_dimension",
)
PIPELINE_TESTS = (
    "gpipe_gradients",
    "one_f_one_b_gradients",
    "gpipe_schedule",
    "one_f_one_b_schedule",
)
STRATEGY_CLAIMS = [
    Claim(
        "tensor_parallel.py",
        "module",
        r"grading\.yaml\), at (p = [\d, ]+\d):",
        world_sizes("tensor_parallel", *TENSOR_PARALLEL_TESTS),
        ranks,
    ),
    Claim(
        "tensor_parallel.py",
        "module",
        r"`parallel_mlp_communication` \((p = [\d, ]+\d)\)",
        world_sizes("tensor_parallel", "parallel_mlp_communication"),
        ranks,
    ),
    Claim(
        "pipeline_parallel.py",
        "module",
        r"grading\.yaml\), at (p = [\d, ]+\d) stages",
        world_sizes("pipeline_parallel", *PIPELINE_TESTS),
        ranks,
    ),
    Claim(
        "data_parallel.py",
        "DataParallel",
        r"Graded \(`grader list data_parallel`\): at (p = [\d, ]+\d),",
        world_sizes("data_parallel", "data_parallel_training", "unused_parameter"),
        ranks,
    ),
    Claim(
        "data_parallel.py",
        "DataParallel",
        r"`overlap` \((p = [\d, ]+\d)\)",
        world_sizes("data_parallel", "overlap"),
        ranks,
    ),
    Claim(
        "data_parallel.py",
        "ShardedOptimizer",
        r"Graded: at (p = [\d, ]+\d), SGD",
        world_sizes("data_parallel", "sharded_optimizer", "sharded_optimizer_first_group"),
        ranks,
    ),
    Claim(
        "data_parallel.py",
        "ShardedOptimizer",
        r"`sharded_optimizer_state` \((p = [\d, ]+\d)\)",
        world_sizes("data_parallel", "sharded_optimizer_state"),
        ranks,
    ),
]

NEW_PART_CLAIMS = [
    Claim(
        "context_parallel.py",
        "module",
        r"its backward moves at most (\S+)x the bytes",
        option("context_parallel", "ring_attention_communication", "backward_bytes_ratio"),
    ),
]

CLAIMS = COLLECTIVES_CLAIMS + STRATEGY_CLAIMS + NEW_PART_CLAIMS


def docstrings(path: Path) -> dict[str, str]:
    """Every docstring of a stub file, by scope, with its line breaks and indents as spaces."""
    tree = ast.parse(path.read_text())
    nodes: list[tuple[str, ast.AST]] = [("module", tree)]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            nodes.append((node.name, node))
        if isinstance(node, ast.ClassDef):
            nodes += [
                (f"{node.name}.{child.name}", child)
                for child in node.body
                if isinstance(child, ast.FunctionDef)
            ]
    found = {}
    for scope, node in nodes:
        text = ast.get_docstring(node)
        if text:
            found[scope] = " ".join(text.split())
    return found


def matches(claim: Claim) -> list[re.Match[str]]:
    text = docstrings(ASSIGNMENTS / claim.file).get(claim.scope, "")
    return list(re.finditer(claim.pattern, text))


@pytest.mark.parametrize("claim", CLAIMS, ids=str)
def test_a_figure_the_stub_restates_is_grading_yaml_s(claim: Claim) -> None:
    found = matches(claim)
    assert found, f"{claim}: not found; reworded? change the claim with the docstring"
    wanted = claim.expected(CONFIG)
    for match in found:
        said = claim.read(match.group(1))
        assert said == wanted, f"{claim} says {match.group(1)!r}; grading.yaml says {wanted}"


def test_every_ratio_and_number_of_points_in_a_stub_is_a_claim() -> None:
    claimed: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for claim in CLAIMS:
        spans = claimed.setdefault((claim.file, claim.scope), [])
        spans += [match.span() for match in matches(claim)]
    unclaimed = []
    for path in sorted(ASSIGNMENTS.glob("*.py")):
        for scope, text in docstrings(path).items():
            spans = claimed.get((path.name, scope), [])
            for found in RESTATED.finditer(text):
                if not any(start <= found.start() and found.end() <= end for start, end in spans):
                    unclaimed.append(f"assignments/{path.name} ({scope}): {found.group()!r}")
    assert not unclaimed, "restated from grading.yaml but not checked: add a Claim for " + (
        ", ".join(unclaimed)
    )


def test_a_claim_fails_when_grading_yaml_changes() -> None:
    """The check is live: the same docstrings against a configuration with other figures."""
    changed = load_config(REPO / "tests" / "graded" / "grading.yaml")
    communication = changed.part("collectives").overrides["communication"]
    communication["options"] = {**communication["options"], "communication_elements": 65536}
    claim = next(c for c in CLAIMS if "(\\d+) float32 elements" in c.pattern)
    (match,) = matches(claim)
    assert claim.read(match.group(1)) != claim.expected(changed)
