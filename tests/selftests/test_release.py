"""`grader release OUT`: the repository students get, built, installed and graded as theirs.

The release has no reference: the reference's collectives.py is copied into its
assignments/ as a correct student's work, and must earn every visible point,
the cost tests included (they compare with the reference's message patterns,
shipped inside the package). Only the collectives part is graded here.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from installs import make_venv, run
from runner import REPO, run_grader

from grader.commands.release import build_release
from grader.course.config import load_config

# At world size 2, all_reduce's correctness, communication and performance tests.
SELECTION = ["collectives", "-k", "all_reduce", "--world-size", "2"]
PRIVATE = ("reference", "tests/selftests", "deploy", ".github", "gradescope", "benchmarks", ".git")
SHIPPED = (
    "pyproject.toml",
    "README.md",
    ".gitignore",
    "docs/commands.md",
    "assignments/collectives.py",
    "grader/commands/cli.py",
    "grader/judge/reference_traces.json",
    "grader/judge/machines.yaml",
    "tests/graded/grading.yaml",
    "tests/graded/conftest.py",
)


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path``, removed afterwards: course copies, releases and a venv need not stay."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


def _course_copy(where: Path) -> Path:
    """The course as the instructor has it (reference, self-tests, deploy, ...), to edit."""
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", ".*_cache")
    return Path(shutil.copytree(REPO, where, ignore=ignore))


def test_a_release_ships_the_course_but_nothing_private(scratch: Path):
    course = _course_copy(scratch / "course")
    (course / "tests" / "graded" / "__pycache__").mkdir(exist_ok=True)
    (course / "tests" / "graded" / "__pycache__" / "x.pyc").write_bytes(b"")
    (course / "results.json").write_text("{}")
    release = build_release(load_config(course / "tests/graded/grading.yaml"), scratch / "out")
    out = release.path
    for name in SHIPPED:
        assert (out / name).is_file(), name
    assert (out / "grader/judge/reference_traces.json").read_bytes() == (
        REPO / "grader/judge/reference_traces.json"
    ).read_bytes()
    for name in PRIVATE:
        assert not (out / name).exists(), name
    names = [p.relative_to(out).as_posix() for p in out.rglob("*")]
    assert not [n for n in names if "__pycache__" in n or n.endswith((".pyc", "results.json"))]
    assert release.left_out == () and release.partly_hidden == () and release.private == ()
    # Nothing hidden: grading.yaml is shipped as it is, comments and all.
    assert (out / "tests/graded/grading.yaml").read_text() == (
        REPO / "tests/graded/grading.yaml"
    ).read_text()
    # The students' README: their commands, not the instructors' part.
    readme = (out / "README.md").read_text()
    assert "## For students" in readme and "grader run" in readme
    assert "For instructors" not in readme and "grader batch" not in readme


def _hide(
    course: Path, part_hidden: bool, tests: tuple[str, ...], visibility: str = "hidden"
) -> Path:
    """Make the collectives part hidden, or only some of its tests; returns grading.yaml."""
    path = course / "tests" / "graded" / "grading.yaml"
    raw = yaml.safe_load(path.read_text())
    collectives = raw["parts"]["collectives"]
    if part_hidden:
        collectives["visibility"] = visibility
    for name in tests:
        collectives["tests"].setdefault(name, {})["visibility"] = visibility
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_a_test_file_whose_every_test_is_hidden_is_left_out_with_its_entries(scratch: Path):
    course = _course_copy(scratch / "course")
    # Every test of test_collectives_costs.py, and one of test_collectives.py.
    config_path = _hide(course, False, ("communication", "performance", "broadcast"))
    release = build_release(load_config(config_path), scratch / "out")
    graded = release.path / "tests" / "graded"
    assert release.left_out == ("test_collectives_costs.py",)
    assert release.partly_hidden == ("test_collectives.py",)
    assert not (graded / "test_collectives_costs.py").exists()
    assert (graded / "test_collectives.py").is_file()
    config = load_config(graded / "grading.yaml")  # the release's configuration loads
    collectives = config.part("collectives")
    assert [f.name for f in collectives.files] == ["test_collectives.py"]
    assert list(collectives.overrides) == ["broadcast"]  # the entries of the file left out go
    assert list(config.parts) == list(load_config(config_path).parts)


def test_of_tests_graded_only_what_the_visible_tests_use_ships(scratch: Path):
    """An allow-list: a hidden test's data file and helper, or an instructor's notes, stay
    private; a visible test's data file and helper (named, imported) ship."""
    course = _course_copy(scratch / "course")
    graded = course / "tests" / "graded"
    files = {
        "hidden_cases.json": "[1]",
        "hidden_helpers.py": "EXPECTED = 42\n",
        "notes.md": "the answers",
        "visible_cases.json": "[2]",
        "data/shapes.json": "[3]",
        "visible_helpers.py": 'CASES, SHAPES = "visible_cases.json", "data/shapes.json"\n',
    }
    for name, text in files.items():
        (graded / name).parent.mkdir(exist_ok=True)
        (graded / name).write_text(text)
    with (graded / "test_collectives.py").open("a") as visible:
        visible.write("\nimport visible_helpers  # noqa: E402\n")
    with (graded / "test_collectives_costs.py").open("a") as hidden:
        hidden.write('\nimport hidden_helpers  # noqa: E402\n\nCASES = "hidden_cases.json"\n')
    config_path = _hide(course, False, ("communication", "performance"))  # the costs file
    release = build_release(load_config(config_path), scratch / "out")
    shipped = {p.relative_to(release.path / "tests/graded").as_posix()
               for p in (release.path / "tests/graded").rglob("*") if p.is_file()}  # fmt: skip
    assert {"visible_helpers.py", "visible_cases.json", "data/shapes.json"} <= shipped
    assert {"conftest.py", "pytest.ini", "grading.yaml", "test_collectives.py"} <= shipped
    assert not shipped & {"hidden_cases.json", "hidden_helpers.py", "notes.md"}
    assert "test_collectives_costs.py" not in shipped
    assert release.private == ("hidden_cases.json", "hidden_helpers.py", "notes.md")


@pytest.mark.parametrize("visibility", ["hidden", "after_due_date", "after_published"])
def test_a_part_whose_every_test_is_hidden_is_left_out_of_the_release(
    scratch: Path, visibility: str
):
    """Tests students see only once graded (after the due date, once published) are as
    secret as hidden ones until then."""
    config_path = _hide(_course_copy(scratch / "course"), True, (), visibility)
    release = build_release(load_config(config_path), scratch / "out")
    graded = release.path / "tests" / "graded"
    assert release.left_out == ("test_collectives.py", "test_collectives_costs.py")
    assert not list(graded.glob("test_collectives*.py"))
    config = load_config(graded / "grading.yaml")
    assert "collectives" not in config.parts and config.parts


def test_a_release_is_refused_into_a_folder_that_holds_anything(scratch: Path):
    (scratch / "notes.txt").write_text("mine")
    done = run_grader(["release", str(scratch)], timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"grader: error: cannot release into {scratch.resolve()}: "
        "it exists and is not an empty folder"
    )
    assert [p.name for p in scratch.iterdir()] == ["notes.txt"]


def _grade(env: dict[str, str], release: Path, results: Path) -> tuple[int, dict, str]:
    done = run(["grader", "run", *SELECTION, "--results", str(results)], env, release, 300)
    assert results.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    return done.returncode, json.loads(results.read_text()), done.stdout + done.stderr


@pytest.mark.slow
def test_a_release_installed_in_a_venv_grades_a_correct_submission_fully(scratch: Path):
    """`pip install .` of the release (not editable), graded from inside it, as a student does."""
    release = scratch / "release"
    done = run_grader(["release", str(release)], timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"student release written to {release}" in done.stdout
    assert not (release / "reference").exists() and not (release / "tests/selftests").exists()
    env = make_venv(scratch / "venv")
    installed = run(["python3", "-m", "pip", "install", "--no-deps", "."], env, cwd=release)
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    where = run(["python3", "-c", "import grader; print(grader.__file__)"], env, cwd=scratch)
    assert Path(where.stdout.strip()).is_relative_to(scratch / "venv"), where.stdout

    no_reference = run(["grader", "run", "--submission", "reference"], env, cwd=release)
    assert no_reference.returncode == 2
    assert no_reference.stderr.startswith(
        "grader: error: there is no reference in a student release"
    )
    assert len(no_reference.stderr.strip().splitlines()) == 1

    status, stubs, output = _grade(env, release, scratch / "stubs.json")
    assert status == 1, output[-3000:]
    assert stubs["score"] == 0 and stubs["tests"]
    for test in stubs["tests"]:
        assert "not implemented yet" in test["output"], test

    shutil.copy(REPO / "reference" / "collectives.py", release / "assignments" / "collectives.py")
    status, graded, output = _grade(env, release, scratch / "correct.json")
    assert status == 0, output[-3000:]
    kinds = {test["extra_data"]["kind"] for test in graded["tests"]}
    assert {"correctness", "communication", "performance"} <= kinds
    visible = [t for t in graded["tests"] if t.get("visibility", "visible") == "visible"]
    assert visible and graded["score"] == sum(t["max_score"] for t in visible)
