"""At ``uid`` a job's ranks are forked from its zygote, which imported torch once (issue 49):
each walled as an exec'd rank is, holding nothing of the zygote's, and ended with it.

The probe of everything a rank inherited (its descriptors, its memory searched for secrets)
is ``submissions/attack_wall``'s, graded at ``uid`` in test_wall.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from runner import REPO, materialize, start_grader, without_bwrap
from test_wall import UID_PYTHON, _course, _uid_python

from grader.launch import orphans

needs_uid = pytest.mark.skipif(bool(_uid_python()), reason=str(_uid_python()))


@needs_uid
def test_a_forked_rank_is_walled_holds_only_its_own_and_dies_with_its_wrapper() -> None:
    harness = str(REPO / "tests" / "selftests" / "zygote_harness.py")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    where = Path(tempfile.mkdtemp(prefix="zygote-"))  # pytest's folders are root's alone
    try:
        where.chmod(0o711)  # the rank's uid passes through to its scratch
        command = [UID_PYTHON, harness, str(where / "work")]
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


def _zygote_below(grader: int) -> int | None:
    """The pid of a zygote that the grader ``grader`` started, once it has forked a rank."""
    children: dict[int, list[int]] = {}
    for pid, parent, _ in orphans.processes():
        children.setdefault(parent, []).append(pid)
    for pid in children.get(grader, []):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"grader.launch.zygote" in command and children.get(pid):
            return pid
    return None


@pytest.mark.slow
@needs_uid
def test_a_killed_grader_leaves_no_zygote_and_no_rank(tmp_path: Path) -> None:
    course = _course(tmp_path / "course")
    env = {**without_bwrap(tmp_path), "GRADER_CONFIG": str(course / "tests/graded/grading.yaml")}
    deadlock = materialize("coll_deadlock_all", tmp_path / "subs")
    args = ["run", "collectives", "-k", "all_reduce", "--submission", str(deadlock)]
    grader = start_grader([*args, "--sandbox", "uid"], env=env, python=UID_PYTHON)
    try:
        deadline, zygote = time.monotonic() + 120, None
        while zygote is None and time.monotonic() < deadline and grader.poll() is None:
            zygote = _zygote_below(grader.pid)
            time.sleep(0.1)
        assert zygote is not None, grader.communicate()
        ranks = [pid for pid, parent, _ in orphans.processes() if parent == zygote]
        os.kill(grader.pid, signal.SIGKILL)
        grader.wait()
        deadline = time.monotonic() + 10
        alive = [zygote, *ranks]
        while alive and time.monotonic() < deadline:
            alive = [pid for pid in alive if Path(f"/proc/{pid}").exists()]
            time.sleep(0.05)
        assert not alive, alive
    finally:
        if grader.poll() is None:
            grader.kill()
            grader.wait()
