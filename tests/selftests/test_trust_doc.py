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


#: A sentence ends at ``.``, ``!`` or ``?`` before a capital, a backtick or a bracket.
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(\"\[])")


def prose() -> list[str]:
    """The doc's text outside code blocks, as paragraphs, list items, headings and table
    cells (a table's separator rows left out): what a reader reads."""
    chunks: list[str] = []
    paragraph: list[str] = []
    in_code = False
    for line in [*TRUST.splitlines(), ""]:
        in_code ^= line.startswith("```")
        starts = not line.strip() or line.startswith(("#", "- ", "|", "```"))
        if (starts or in_code) and paragraph:
            chunks.append(" ".join(paragraph))
            paragraph = []
        if in_code or line.startswith("```") or not line.strip():
            continue
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            chunks += [c for c in cells if c and not set(c) <= set("-: ")]
        else:
            paragraph.append(line.lstrip("#- ").strip())
    return chunks


def test_trust_md_is_read_in_minutes() -> None:
    """At most 2500 words, and no sentence over 50: a newcomer reads it in ten minutes."""
    chunks = prose()
    words = sum(len(chunk.split()) for chunk in chunks)
    sentences = [s for chunk in chunks for s in SENTENCE_END.split(chunk)]
    longest = max(sentences, key=lambda s: len(s.split()))
    assert words <= 2500, f"docs/trust.md has {words} words: at most 2500"
    assert len(longest.split()) <= 50, f"a sentence of {len(longest.split())} words: {longest}"
