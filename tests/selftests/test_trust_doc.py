"""docs/trust.md names, for each guarantee, the file that enforces it and the self-test that
proves it: every file it names exists, every test it names is a test of that file, and every
hostile submission it names is in ``tests/selftests/submissions/``."""

from __future__ import annotations

import re

from runner import REPO, SUBMISSIONS

TRUST = (REPO / "docs" / "trust.md").read_text()
SELFTESTS = REPO / "tests" / "selftests"
# `test_x.py::test_y`, or `::test_z` after it in the same cell: a test of the same file.
TEST = re.compile(r"`(test_\w+\.py)?::(test_\w+)`")


def named_tests() -> list[tuple[str, str]]:
    found = []
    for line in TRUST.splitlines():
        for cell in line.split("|"):
            current = None
            for match in TEST.finditer(cell):
                current = match.group(1) or current
                assert current, f"{match.group()} names no file before it: {cell.strip()}"
                found.append((current, match.group(2)))
    return found


def test_every_test_trust_md_names_exists() -> None:
    tests = named_tests()
    assert len(tests) > 50  # the table was read
    missing = [
        f"{file}::{name}"
        for file, name in tests
        if not (SELFTESTS / file).is_file()
        or not re.search(rf"^def {name}\(", (SELFTESTS / file).read_text(), re.M)
    ]
    assert not missing, f"docs/trust.md names tests that do not exist: {missing}"


def test_every_file_and_submission_trust_md_names_exists() -> None:
    paths = set(re.findall(r"`((?:grader|tests|benchmarks)/[\w/.]+)`", TRUST))
    assert "grader/segment.py" in paths
    assert not [p for p in paths if not (REPO / p).exists()], "named in docs/trust.md: missing"
    submissions = set(re.findall(r"`((?:attack|coll|dp|zero|tp|pp|fsdp|ep|cp)_\w+)`", TRUST))
    assert not [s for s in submissions if not (SUBMISSIONS / s).is_dir()]
