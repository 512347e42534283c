"""Every grading its own identity, kernel objects refused, and a level that grades or refuses
at once (issue 14), checked with the real grader.

Two gradings run side by side with an unrelated process of another uid on the machine: the
honest one scores what it scores alone, the attack through kernel objects no namespace
separates (``submissions/attack_kernel_objects``: byte-range locks and keyrings) earns nothing
and names the refusal, and the bystander survives both cleanups. Where namespaces are
refused (bubblewrap hidden from PATH), a run for a course refuses in one line within seconds
unless the ``uid`` level really runs a rank here, and a student's own run falls back.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from runner import REPO, materialize, run_grader, start_grader, without_bwrap

from grader import sandbox
from grader.launch.workspace import UNSANDBOXED
from grader.sandbox import identity

root_only = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0, reason="uids are reserved by root only"
)
CONFIG = ["--config", str(REPO / "tests/graded/grading.yaml")]


def _sleeper(uid: int) -> subprocess.Popen[bytes]:
    """A process of ``uid``: another program's, which no grading may kill, or a rank's."""
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return subprocess.Popen([*drop, "sleep", "300"], start_new_session=True)


def _left_behind(uid: int) -> bool:
    """A grader's uid whose block no run holds now: what it still owns, a grading left.

    The blocks of gradings running beside this test (other workers of ``pytest -n``) are
    locked by their graders and do not count.
    """
    if uid < identity.FIRST_UID:
        return False
    first = identity.FIRST_UID + (uid - identity.FIRST_UID) // identity.BLOCK * identity.BLOCK
    try:
        lock = os.open(identity.lock_path(first), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return True  # never reserved, yet in use
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # a live run's
    finally:
        os.close(lock)  # closing gives back a lock just taken
    return True


def _grader_uids_alive() -> list[int]:
    return sorted(uid for uid in identity._busy_uids() if _left_behind(uid))


def _keys_of_grader_uids() -> list[str]:
    """Lines of /proc/key-users (every uid that owns a key) for uids gradings left."""
    lines = Path("/proc/key-users").read_text().splitlines()
    return [line for line in lines if _left_behind(int(line.split(":")[0]))]


@root_only
def test_each_run_reserves_its_own_uids_and_ends_only_their_processes(tmp_path: Path) -> None:
    first, second = identity.reserve(), identity.reserve()
    token = f"isolation-{uuid.uuid4().hex}"
    bystander = _sleeper(sandbox.NOBODY)
    ours = _sleeper(first.uid(0))  # as a rank's daemon would run
    theirs = Path("/tmp") / f"{token}-nobody"
    left = Path("/tmp") / f"{token}-rank1"
    try:
        assert set(first.uids).isdisjoint(second.uids)
        assert sandbox.NOBODY not in first.uids and 0 not in first.uids
        for path, uid in ((theirs, sandbox.NOBODY), (left, first.uid(1))):
            path.write_text("x")
            os.chown(path, uid, uid)
        deadline = time.monotonic() + 20
        while not identity.pids_of(first.uid(0)) and time.monotonic() < deadline:
            time.sleep(0.05)  # until setpriv has dropped to the uid
        assert first.end_jobs() == 1
        assert ours.wait(5) == -9 and bystander.poll() is None
        first.release()
        assert not left.exists() and theirs.exists()  # what its uids left in /tmp: gone
    finally:
        second.release()
        bystander.kill()
        bystander.wait()
        theirs.unlink(missing_ok=True)


@root_only
@pytest.mark.skipif(
    bool(sandbox.unavailable(sandbox.Level.NAMESPACES)),
    reason=str(sandbox.unavailable(sandbox.Level.NAMESPACES)),
)
def test_side_by_side_the_kernel_object_attack_earns_nothing(tmp_path: Path) -> None:
    bystander = _sleeper(sandbox.NOBODY)
    attack = materialize("attack_kernel_objects", tmp_path)
    runs = {
        "honest": ["--submission", str(REPO / "reference"), "-k", "all_reduce"],
        # locks carry all_reduce, keys all_gather and all_to_all
        "attack": ["--submission", str(attack), "-k", "all_"],
    }
    started = {
        name: start_grader(
            [
                *CONFIG,
                "run",
                "collectives",
                "--world-size",
                "2",
                *args,
                "--results",
                str(tmp_path / f"{name}.json"),
            ]
        )
        for name, args in runs.items()
    }
    try:
        for name, process in started.items():
            _, err = process.communicate(timeout=900)
            assert process.returncode in (0, 1), f"{name}: {err}"
        honest, attacked = (json.loads((tmp_path / f"{n}.json").read_text()) for n in runs)
        assert all(t["status"] == "passed" for t in honest["tests"]), honest["tests"]
        assert len(honest["tests"]) == 3 and honest["extra_data"]["sandbox"] == "namespaces"
        assert attacked["score"] == 0 and attacked["extra_data"]["sandbox"] == "namespaces"
        correctness = [t for t in attacked["tests"] if t["extra_data"]["kind"] == "correctness"]
        assert {t["extra_data"]["target"] for t in correctness} == {
            f"collectives.{name}" for name in ("all_reduce", "all_gather", "all_to_all")
        }
        for test in correctness:
            assert "PermissionError" in test["output"], test["output"]  # refused, not slow
        assert bystander.poll() is None  # a process of another uid survives both cleanups
        assert _grader_uids_alive() == [] and _keys_of_grader_uids() == []
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
        bystander.kill()
        bystander.wait()


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@root_only
def test_without_namespaces_a_course_run_grades_at_uid_or_refuses_at_once(
    tmp_path: Path,
) -> None:
    """The Docker image's command (ENTRYPOINT + CMD), run where namespaces are refused: the
    course copied as the image lays it out and made unreadable to others, bubblewrap
    hidden. It grades at ``uid`` where the ranks' uid can run this interpreter, and
    otherwise ends in one line, within a minute, naming each level's cause and fix."""
    text = (REPO / "Dockerfile").read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))
    command = json.loads(re.search(r"^CMD (.+)$", text, re.M).group(1))
    assert entry == ["grader"] and "--results" in command and "USER" not in text
    course = tmp_path / "opt" / "grader"
    for name in ("reference", "assignments", "tests/graded"):
        shutil.copytree(REPO / name, course / name)
    subprocess.run(["chmod", "-R", "o-rwx", str(course)], check=True)
    (tmp_path / "results").mkdir()
    paths = {"/submission": str(REPO / "reference"), "/results": str(tmp_path / "results")}
    args = [re.sub("^/(submission|results)", lambda m: paths[m.group(0)], a) for a in command]
    env = {**without_bwrap(tmp_path), "GRADER_CONFIG": str(course / "tests/graded/grading.yaml")}
    sandbox.unavailable.cache_clear()
    started = time.monotonic()
    done = run_grader([*args, "collectives", "-k", "all_reduce", "--world-size", "2"], env=env)
    seconds = time.monotonic() - started
    results = tmp_path / "results" / "results.json"
    uid_runs = identity.readable_by([Path(sys.executable)], identity.FIRST_UID, identity.FIRST_UID)
    print(f"exit {done.returncode} after {seconds:.1f} s: {done.stderr.strip()[-300:]}")
    if uid_runs:
        assert done.returncode == 0, done.stderr
        assert json.loads(results.read_text())["extra_data"]["sandbox"] == "uid"
        return
    line = _one_line(done.stderr)
    assert done.returncode == 2 and not results.exists()  # the seconds: printed, for the record
    assert "namespaces: bwrap is not installed (apt-get install bubblewrap)" in line
    assert "uid: a rank cannot start: PermissionError: [Errno 13] Permission denied: " in line
    assert "under a 0700 home" in line and "unless --sandbox none is given" in line


@root_only
def test_without_namespaces_a_students_run_falls_back_and_none_asked_for_is_marked(
    tmp_path: Path,
) -> None:
    env = without_bwrap(tmp_path)
    select = ["collectives", "-k", "all_reduce", "--world-size", "1"]
    own = run_grader([*CONFIG, "run", *select, "--submission", str(REPO / "reference")], env=env)
    assert own.returncode == 0, own.stderr
    uid_runs = identity.readable_by([Path(sys.executable)], identity.FIRST_UID, identity.FIRST_UID)
    assert f"isolated by: {'uid' if uid_runs else 'none'}" in own.stdout
    results = tmp_path / "results.json"
    asked = run_grader(
        [
            *CONFIG,
            "run",
            *select,
            "--submission",
            str(REPO / "reference"),
            "--sandbox",
            "none",
            "--results",
            str(results),
        ],
        env=env,
    )
    assert asked.returncode == 0, asked.stderr
    document = json.loads(results.read_text())
    assert document["extra_data"]["sandbox"] == "none"
    assert document["extra_data"]["review"][0] == UNSANDBOXED


def test_doctor_names_each_level_and_its_fix(tmp_path: Path) -> None:
    """`grader doctor` tries every level as a grading would, in seconds, and says what fixes
    the ones refused; `grader run` says its level, and why no stronger one, on its first line."""
    env = without_bwrap(tmp_path)
    done = run_grader([*CONFIG, "doctor"], env=env)
    lines = done.stdout.splitlines()
    assert "namespaces  refused: bwrap is not installed (apt-get install bubblewrap)" in lines[0]
    assert lines[2].strip() == "none  ok"
    if done.returncode == 0:
        assert lines[1].strip() == "uid  ok" and lines[3] == "a course's grading runs at uid"
    else:
        assert done.returncode == 2 and "cannot run here" in lines[3]
    graded = run_grader([*CONFIG, "run", "collectives", "-k", "all_reduce", "--world-size", "1"])
    first = graded.stdout.splitlines()[0]
    level = sandbox.detect(sandbox.requested())
    assert f", sandbox {level.value}" in first, first
