"""Gradescope end to end: the zip `grader gradescope` builds, installed and run as Gradescope does.

Gradescope unpacks the zip in /autograder/source, runs setup.sh once, then
run_autograder per submission with the upload in /autograder/submission. Here
that layout lives under a temporary AUTOGRADER_ROOT, setup.sh installs into a
private venv, and a tiny selection (GRADER_ARGS) keeps each grading short.
"""

from __future__ import annotations

import json
import shutil
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from installs import check_gradescope_results, make_venv, run
from runner import REPO, run_grader

pytestmark = pytest.mark.slow

SELECTION = "collectives -k broadcast --world-size 2"
# Where a student's module files sit in each upload layout (docs/submission.md).
LAYOUTS = {
    "top_level": "",
    "assignments": "assignments/",
    "github": "distributed-course-main/assignments/",
}


@dataclass
class Autograder:
    zip_path: Path
    root: Path  # AUTOGRADER_ROOT: source/, submission/, results/
    env: dict[str, str]

    def grade(self, upload: dict[str, str]) -> tuple[int, dict]:
        """Put ``upload`` (path: text) in submission/, run run_autograder, read results.json."""
        for folder in ("submission", "results"):
            shutil.rmtree(self.root / folder, ignore_errors=True)
            (self.root / folder).mkdir()
        for name, text in upload.items():
            path = self.root / "submission" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        done = run(
            [str(self.root / "source" / "run_autograder")],
            {**self.env, "GRADER_ARGS": SELECTION},
            cwd=self.root,
        )
        results = self.root / "results" / "results.json"
        assert results.is_file(), done.stdout[-2000:] + done.stderr[-2000:]
        assert stat.S_IMODE(results.stat().st_mode) == 0o644
        return done.returncode, json.loads(results.read_text())


@pytest.fixture(scope="module")
def autograder(tmp_path_factory: pytest.TempPathFactory) -> Autograder:
    base = tmp_path_factory.mktemp("gradescope")
    zip_path = base / "autograder.zip"
    done = run_grader(["gradescope", str(zip_path)], timeout=120)
    assert done.returncode == 0, done.stderr
    root = base / "autograder"
    with zipfile.ZipFile(zip_path) as archive:
        for info in archive.infolist():
            target = root / "source" / info.filename
            archive.extract(info, root / "source")
            target.chmod((info.external_attr >> 16) & 0o777)  # as unzip keeps them
    env = {**make_venv(base / "venv"), "AUTOGRADER_ROOT": str(root)}
    setup = run(["bash", str(root / "source" / "setup.sh")], env, cwd=base, timeout=300)
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    return Autograder(zip_path, root, env)


def test_the_zip_has_the_scripts_at_its_root_and_nothing_private(autograder: Autograder):
    with zipfile.ZipFile(autograder.zip_path) as archive:
        infos = {info.filename: info for info in archive.infolist()}
    for script in ("setup.sh", "run_autograder"):
        assert (infos[script].external_attr >> 16) & 0o111, f"{script} is not executable"
    for needed in ("pyproject.toml", "grader/commands/cli.py", "reference/collectives.py"):
        assert needed in infos
    assert "tests/graded/grading.yaml" in infos
    for name in infos:
        assert not name.startswith(("tests/selftests", ".git", ".github", "gradescope/")), name
        assert "__pycache__" not in name and not name.endswith((".pyc", "results.json")), name
        assert ".egg-info" not in name and not name.startswith(("build/", "dist/")), name


def test_setup_installs_the_grader_into_site_packages_not_editable(autograder: Autograder):
    done = run(
        ["python3", "-c", "import grader, shutil; print(grader.__file__, shutil.which('grader'))"],
        autograder.env,
        cwd=Path("/"),
    )
    where, command = done.stdout.split()
    venv = Path(autograder.env["VIRTUAL_ENV"])
    assert Path(where).is_relative_to(venv / "lib"), where
    assert Path(command).is_relative_to(venv / "bin"), command


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_run_autograder_grades_every_upload_layout(autograder: Autograder, layout: str):
    """The reference's collectives.py, uploaded three ways, earns every selected point."""
    prefix = LAYOUTS[layout]
    upload = {f"{prefix}collectives.py": (REPO / "reference" / "collectives.py").read_text()}
    if layout == "github":
        upload |= {"distributed-course-main/README.md": "# my course work\n"}
    status, results = autograder.grade(upload)
    assert status == 0
    check_gradescope_results(results)
    assert results["visibility"] == "visible" and results["stdout_visibility"] == "hidden"
    assert len(results["tests"]) == 3  # broadcast: correctness, communication, performance
    assert results["score"] == sum(t["max_score"] for t in results["tests"])
    for test in results["tests"]:
        extra = test["extra_data"]
        assert extra["part"] == "collectives" and extra["world_size"] == 2
        assert extra["outcome"] == "passed" and extra["target"] == "collectives.broadcast"


def test_an_upload_without_module_files_gets_its_reason(autograder: Autograder):
    status, results = autograder.grade({"solution.pdf": "%PDF"})
    assert status == 0  # Gradescope shows the results, not a bare failure
    check_gradescope_results(results)
    assert results["score"] == 0 and results["tests"] == []
    assert "no module files in" in results["output"] and "assignments/" in results["output"]
