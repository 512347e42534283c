"""A run's workspace starts its first job before the grader imports torch, and ends it when
no session took it over (``grader.launch.workspace``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from runner import REPO, assert_all_ended

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
time.sleep(3)  # its ranks connect meanwhile, and wait in their sockets' backlog
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
