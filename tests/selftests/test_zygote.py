"""At ``uid`` a job's ranks are forked from its zygote, which imported torch once (issue 49):
each walled as an exec'd rank is, holding nothing of the zygote's, and ended with it. At
``namespaces`` each rank keeps a bubblewrap of its own.

The probe of everything a rank inherited (its descriptors, its memory searched for secrets)
is ``submissions/attack_wall``'s, graded at ``uid`` in test_wall.py; what a forked rank could
reach of its zygote and of its job's other ranks, and every channel between them beside the
broker, is ``submissions/attack_zygote``'s, graded here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from runner import REPO, materialize, process_owner, start_grader, without_bwrap
from test_wall import UID_PYTHON, _course, _uid_python

from grader.launch import zygote
from grader.launch.job import descendants, process_alive
from grader.launch.plan import SandboxPlan
from grader.sandbox import Level

needs_uid = pytest.mark.skipif(bool(_uid_python()), reason=str(_uid_python()))


LEVELS = [pytest.param(Level.UID, marks=needs_uid)]


def test_at_namespaces_each_rank_keeps_a_bubblewrap_of_its_own() -> None:
    """Ranks sharing one would see each other's scratch and pid counter (``attack_zygote``
    found both): at ``namespaces`` the ranks are exec'd, each in its own namespaces."""
    plan = SandboxPlan(Level.NAMESPACES, "", "", [], [], "", 1 << 30, ["r /usr"], first_uid=1)
    assert not zygote.wanted(plan)
    assert not zygote.wanted(replace(plan, level=Level.UID, broker="head:1"))  # across nodes


@pytest.mark.parametrize("level", LEVELS)
def test_a_forked_rank_is_walled_holds_only_its_own_and_dies_with_its_wrapper(
    level: Level,
) -> None:
    harness = str(REPO / "tests" / "selftests" / "zygote_harness.py")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    where = Path(tempfile.mkdtemp(prefix="zygote-"))  # pytest's folders are root's alone
    python = UID_PYTHON if level is Level.UID else sys.executable
    try:
        where.chmod(0o711)  # the rank's uid passes through to its scratch
        command = [python, harness, str(where / "work"), level.value]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["hello"], seen["log"]  # it served: the broker's first frame came
    assert "grader.launch.zygote" in seen["parent"]
    status = seen["status"]
    assert status["Uid"].split() == [str(seen["uid"])] * 4
    assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"
    assert status["CapEff"] == status["CapPrm"] == "0000000000000000"
    log = f"{seen['job']}/rank0.log"
    fds = seen["fds"]
    assert {k: v for k, v in fds.items() if k != "3"} == {"0": "/dev/null", "1": log, "2": log}
    assert fds["3"].startswith("socket:")  # its connection, and nothing else of the zygote's
    assert seen["exit"] == -signal.SIGKILL and seen["rank_gone"]
    assert seen["zygote_exit"] == 0


def _zygote_tree(grader: int) -> list[int]:
    """The zygote that ``grader`` started and every process below it, once one of them is a
    rank (not root's); else nothing."""
    for pid in descendants(grader):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"grader.launch.zygote" in command:
            tree = [pid, *descendants(pid)]
            if any(process_owner(below) not in (0, None) for below in tree):
                return tree
    return []


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_a_killed_grader_leaves_no_zygote_and_no_rank(tmp_path: Path, level: Level) -> None:
    course = _course(tmp_path / "course")
    env = {"GRADER_CONFIG": str(course / "tests/graded/grading.yaml")}
    if level is Level.UID:
        env |= without_bwrap(tmp_path)
    python = UID_PYTHON if level is Level.UID else sys.executable
    deadlock = materialize("coll_deadlock_all", tmp_path / "subs")
    args = ["run", "collectives", "-k", "all_reduce", "--submission", str(deadlock)]
    grader = start_grader([*args, "--sandbox", level.value], env=env, python=python)
    try:
        deadline, tree = time.monotonic() + 120, []
        while not tree and time.monotonic() < deadline and grader.poll() is None:
            tree = _zygote_tree(grader.pid)
            time.sleep(0.1)
        assert tree, grader.communicate()
        os.kill(grader.pid, signal.SIGKILL)
        grader.wait()
        deadline = time.monotonic() + 10
        while tree and time.monotonic() < deadline:
            tree = [pid for pid in tree if process_alive(pid)]
            time.sleep(0.05)
        assert not tree, tree
    finally:
        if grader.poll() is None:
            grader.kill()
            grader.wait()


def _watch(grader: subprocess.Popen[str], seen: dict[int, bytes], zygotes: set[int]) -> None:
    """Every process below ``grader`` while it runs: its pid and its start (a pid reused
    later is another process) into ``seen``; the zygotes' pids into ``zygotes``."""
    while grader.poll() is None:
        for pid in descendants(grader.pid):
            with contextlib.suppress(OSError):
                seen.setdefault(pid, _started(pid))
                if b"grader.launch.zygote" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    zygotes.add(pid)
        time.sleep(0.05)


def _started(pid: int) -> bytes:
    """The start time of ``pid`` (/proc/PID/stat's 22nd field), or b"" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[19]
    except (OSError, IndexError):
        return b""


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_a_forked_rank_reaches_nothing_of_its_zygote_or_its_job(
    tmp_path: Path, level: Level
) -> None:
    course = _course(tmp_path / "course")
    attack = materialize("attack_zygote", tmp_path / "subs")
    python = UID_PYTHON if level is Level.UID else sys.executable
    env = {"GRADER_CONFIG": str(course / "tests/graded/grading.yaml")}
    select = ["collectives", "-k", "all_reduce", "--world-size", "2"]
    results = tmp_path / "results.json"
    args = ["run", *select, "--submission", str(attack), "--sandbox", level.value]
    grader = start_grader([*args, "--results", str(results)], env=env, python=python)
    seen: dict[int, bytes] = {}
    zygotes: set[int] = set()
    watcher = threading.Thread(target=_watch, args=(grader, seen, zygotes), daemon=True)
    watcher.start()
    try:
        said = grader.communicate(timeout=600)
    finally:
        if grader.poll() is None:
            grader.kill()
            grader.wait()
    watcher.join()
    assert zygotes, said  # its ranks were forked
    attacked = json.loads(results.read_text())
    assert attacked["extra_data"]["sandbox"] == level.value and attacked["score"] == 0, said
    walk = next(t for t in attacked["tests"] if t["extra_data"]["test"] == "all_reduce")
    assert "RuntimeError: REACHED: none" in walk["output"], walk["output"]
    deadline = time.monotonic() + 10
    while (left := [p for p, t in seen.items() if t and _started(p) == t]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert not [p for p in left if process_alive(p)], left
