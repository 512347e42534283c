"""The sandbox a course deploys is a wall, proven from inside (issue 44).

``submissions/attack_wall`` walks everything a rank can reach (every listening socket,
every process's command line and environment and the paths they name, every file it can
list or guess, every folder it might write) during a real grading, beside a second grading
of another submission, at each level that grades for a course. It earns nothing, reaches
nothing but the interpreter, the system's libraries and its own, and no byte of the
reference, the secret, a hidden test or the other submission appears in what it reports.

The course lies as the Docker image lays it out, made unreadable to others as the README
asks. The ``uid`` level needs an interpreter every uid may run: ``$GRADER_UID_PYTHON``, or
``/opt/grader-venv/bin/python`` (``.ci/run`` makes it), with torch and the grader's
dependencies; root runs it without bubblewrap, the level forced.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from runner import REPO, materialize, start_grader, without_bwrap

from grader import sandbox
from grader.sandbox import Level, identity

UID_PYTHON = os.environ.get("GRADER_UID_PYTHON", "/opt/grader-venv/bin/python")


def _uid_python() -> str | None:
    """Why the ``uid`` level cannot be tried here, or None."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "the uid level needs root"
    if not Path(UID_PYTHON).exists():
        return f"no interpreter for the uid level at {UID_PYTHON} (.ci/run makes it)"
    if not identity.readable_by([Path(UID_PYTHON).resolve()], identity.FIRST_UID):
        return f"{UID_PYTHON} cannot be run by another uid"
    return sandbox.unavailable(Level.UID)


LEVELS = [
    pytest.param(
        Level.NAMESPACES,
        marks=pytest.mark.skipif(
            bool(sandbox.unavailable(Level.NAMESPACES)),
            reason=str(sandbox.unavailable(Level.NAMESPACES)),
        ),
    ),
    pytest.param(
        Level.UID, marks=pytest.mark.skipif(bool(_uid_python()), reason=str(_uid_python()))
    ),
]


def _course(where: Path) -> Path:
    """The course as the image lays it out, unreadable to others."""
    for name in ("reference", "assignments", "tests/graded"):
        shutil.copytree(REPO / name, where / name)
    subprocess.run(["chmod", "-R", "o-rwx", str(where)], check=True)
    return where


def _victim(where: Path, marker: str) -> Path:
    """Another student's submission, honest, with a line no one else has."""
    where.mkdir(parents=True)
    source = (REPO / "reference" / "collectives.py").read_text()
    (where / "collectives.py").write_text(f"# {marker}\n{source}")
    return where


def _forbidden_bytes(course: Path, secret: str, marker: str) -> list[str]:
    """Lines that must never reach a report: the reference's, the hidden tests', the secret,
    the other submission's."""
    lines = [secret, marker]
    for path in (
        course / "reference" / "context_parallel.py",
        course / "tests/graded/test_collectives.py",
    ):
        lines += [line.strip() for line in path.read_text().splitlines() if len(line.strip()) > 30][
            :5
        ]
    return lines


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_a_rank_reaches_nothing_beside_another_grading(tmp_path: Path, level: Level) -> None:
    course = _course(tmp_path / "autograder" / "source")
    marker, secret = f"VICTIM-{uuid.uuid4().hex}", f"wall-secret-{uuid.uuid4().hex}"
    victim = _victim(tmp_path / "victim", marker)
    attack = materialize("attack_wall", tmp_path / "subs")
    python = UID_PYTHON if level is Level.UID else sys.executable
    env = {"GRADER_CONFIG": str(course / "tests/graded/grading.yaml"), "GRADER_SECRET": secret}
    runs = {
        "victim": (victim, ["collectives", "--world-size", "2"]),
        "attack": (attack, ["collectives", "-k", "all_reduce", "--world-size", "2"]),
    }
    started = {
        name: start_grader(
            [
                "run",
                *select,
                "--submission",
                str(submission),
                "--sandbox",
                level.value,
                "--results",
                str(tmp_path / f"{name}.json"),
            ],
            env=env,
            python=python,
        )
        for name, (submission, select) in runs.items()
    }
    try:
        said = {name: process.communicate(timeout=600) for name, process in started.items()}
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
    results = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in runs}
    assert all(t["score"] == t["max_score"] for t in results["victim"]["tests"]), said["victim"]
    attacked = results["attack"]
    assert attacked["extra_data"]["sandbox"] == level.value and attacked["score"] == 0
    walk = next(t for t in attacked["tests"] if t["extra_data"]["test"] == "all_reduce")
    print(walk["output"])
    assert "RuntimeError: REACHED: none" in walk["output"], walk["output"]
    everything = json.dumps(results["attack"]) + said["attack"][0] + said["attack"][1]
    for line in _forbidden_bytes(course, secret, marker):
        assert line not in everything, line


@pytest.mark.slow
@pytest.mark.skipif(bool(_uid_python()), reason=str(_uid_python()))
def test_the_images_command_grades_at_uid_and_the_wall_holds(tmp_path: Path) -> None:
    """The Docker image's command (ENTRYPOINT + CMD) on the image's layout, as root without
    bubblewrap (Docker's default profile refuses namespaces): ``auto`` chooses ``uid``, the
    reference earns its points and the wall probe, graded beside it, reaches nothing."""
    text = (REPO / "Dockerfile").read_text()
    command = json.loads(re.search(r"^CMD (.+)$", text, re.M).group(1))
    assert json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1)) == ["grader"]
    assert "chmod -R o-rwx" in text
    course = _course(tmp_path / "opt" / "grader")
    env = {**without_bwrap(tmp_path), "GRADER_CONFIG": str(course / "tests/graded/grading.yaml")}
    attack = materialize("attack_wall", tmp_path)
    submissions = {"reference": course / "reference", "attack": attack}
    started = {}
    for name, submission in submissions.items():
        (tmp_path / name).mkdir()
        paths = {"/submission": str(submission), "/results": str(tmp_path / name)}
        args = [next((a.replace(k, v, 1) for k, v in paths.items() if a.startswith(k)), a)
                for a in command]  # fmt: skip
        select = ["collectives", "-k", "all_reduce", "--world-size", "2"]
        started[name] = start_grader([*args, *select], env=env, python=UID_PYTHON)
    said = {name: process.communicate(timeout=600) for name, process in started.items()}
    results = {n: json.loads((tmp_path / n / "results.json").read_text()) for n in started}
    assert {r["extra_data"]["sandbox"] for r in results.values()} == {"uid"}, said
    reference = results["reference"]
    assert reference["score"] == sum(t["max_score"] for t in reference["tests"]), said
    walk = next(t for t in results["attack"]["tests"] if t["extra_data"]["test"] == "all_reduce")
    assert "RuntimeError: REACHED: none" in walk["output"], walk["output"]


@pytest.mark.skipif(sys.platform != "linux", reason="the sandbox levels need Linux")
def test_a_socket_is_forbidden_and_its_line_named(grade) -> None:
    graded = grade("attack_network", "collectives", k="all_reduce", world_sizes=(2,))
    assert graded.results["extra_data"]["sandbox"] != "none"
    test = graded.test("all_reduce", 2)
    assert test["extra_data"]["outcome"] == "forbidden" and test["score"] == 0
    assert "the sandbox refuses this system call (sockets" in test["output"], test["output"]
    assert "socket.create_connection((" in test["output"]  # the student's line
