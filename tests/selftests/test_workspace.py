"""A run's workspace starts its first job before the grader imports torch, and ends it when
no session took it over (``grader.launch.workspace``); ending a job signals no process that
is not its own (``grader.launch.job``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from runner import REPO, assert_all_ended

from grader.launch import job as jobs
from grader.launch.job import TorchrunJob

# In a process of its own: the test process has torch imported already.
START_AND_CLOSE = """
import json, os, sys, time
from grader.course.config import activate, find_config, load_config
from grader.launch import tmpdir
from grader.launch.job import descendants
from grader.launch.workspace import Workspace

claim = tmpdir.Claim()
activate(find_config(None))
workspace = Workspace(load_config())
workspace.start(2)
started = workspace.started
torch_imported = "torch" in sys.modules
deadline = time.monotonic() + 60  # torchrun imports torch, then starts the rank wrappers
while len(descendants(os.getpid())) < 3 and time.monotonic() < deadline:
    time.sleep(0.2)
running = started.job.running()
processes = descendants(os.getpid())  # torchrun, the rank wrappers, their sandboxes
workspace.close()  # as on an interrupt during the grader's import of torch
print(json.dumps({
    "torch_imported": torch_imported,
    "running": running,
    "processes": processes,
    "work": str(workspace.work),
    "socket_dir": str(started.socket_dir),
}))
claim.release()
"""


def test_the_first_job_starts_without_torch_and_ends_with_the_workspace(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-c", START_AND_CLOSE],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert not seen["torch_imported"], "starting the first job imported torch"
    assert seen["running"], "the first job did not run"
    assert len(seen["processes"]) >= 3, seen["processes"]
    assert_all_ended(seen["processes"])
    assert not Path(seen["work"]).exists()
    assert not Path(seen["socket_dir"]).exists()
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())


def test_a_job_whose_torchrun_was_reaped_never_signals_its_pid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Once torchrun exited and was reaped (the pool's watcher waits on it), its pid, and the
    process group it led, may be another process's: ending the job then signals neither, only
    the ranks it recorded that are still ranks. Before, it signalled both: under `grader
    batch`, the group might have been another grader's torchrun by then."""
    (tmp_path / "job").mkdir()
    job = TorchrunJob(tmp_path / "job", 1, "grader.no_such_module")  # its rank fails at once
    job.start()
    assert job.wait() != 0
    signalled: list[int] = []
    monkeypatch.setattr(jobs, "_signal", lambda pid, sig: signalled.append(pid))
    monkeypatch.setattr(jobs, "_signal_group", lambda pgid, sig: signalled.append(pgid))
    job.kill()
    job.kill()
    assert signalled == []
