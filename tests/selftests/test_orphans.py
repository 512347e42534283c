"""A grader ends what its jobs left orphaned (``grader/launch/orphans.py``).

A rank's bwrap killed while it starts can leave its child blocked for good: nothing kills it
through its parent any more. The grader is the subreaper of what it starts, so such an
orphan becomes its child, and it kills and reaps every orphan after each job it kills and
before it exits. Here a process the grader started starts another in a session of its own
and dies, as the bwrap does; what the grader started itself, and what a library starts in
the grader's own session, are left alone.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from runner import REPO, ends_with_the_tests

SCRIPT = """
import json, os, subprocess, sys
from grader.launch import orphans

orphans.adopt()
own = orphans.start(["sleep", "600"], start_new_session=True)  # a job's torchrun, say
library = subprocess.Popen(["sleep", "600"])  # a library's helper, in the grader's session
try:
    wrapper = orphans.start(  # a rank's wrapper: its bwrap outlives it
        [sys.executable, "-c", "import subprocess; "
         "print(subprocess.Popen(['sleep', '600'], start_new_session=True).pid)"],
        stdout=subprocess.PIPE, start_new_session=True, text=True,
    )
    left = int(wrapper.stdout.readline())
    wrapper.wait()
    ended = orphans.end()
    print(json.dumps({
        "left": left,
        "ended": ended,
        "left_remains": os.path.exists(f"/proc/{left}"),  # a zombie would: not reaped
        "own_runs": own.poll() is None,
        "library_runs": library.poll() is None,
    }), flush=True)
finally:
    for process in (own, library):
        process.kill()
        process.wait()
"""


def _said(script: str) -> dict:
    """What ``script``, run as a grader of its own, printed (one JSON line)."""
    done = subprocess.run(
        ends_with_the_tests([sys.executable, "-c", script]),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(sys.platform != "linux", reason="a subreaper is Linux's")
def test_an_orphan_of_a_job_is_ended_and_reaped() -> None:
    said = _said(SCRIPT)
    assert said["ended"] == [said["left"]]
    assert not said["left_remains"]
    assert said["own_runs"] and said["library_runs"]


PROBING = """
import json, shutil, tempfile, threading
from pathlib import Path
from grader import sandbox
from grader.launch import orphans
from grader.launch.job import job_settings
from grader.launch.workspace import probe
from grader.device import Device

orphans.adopt()
work = Path(tempfile.mkdtemp(prefix="grader-"))
stop, ended = threading.Event(), []

def reap():  # another job's end, over and over, while the probe runs
    while not stop.is_set():
        ended.extend(orphans.end())

reaper = threading.Thread(target=reap)
reaper.start()
try:
    why = probe(job_settings(work, sandbox.Level.NONE, Device.CPU))
finally:
    stop.set()
    reaper.join()
    shutil.rmtree(work, ignore_errors=True)
print(json.dumps({"why": why, "ended": ended}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="a subreaper is Linux's")
def test_the_sandbox_probe_is_the_graders_own_never_an_orphan() -> None:
    assert _said(PROBING) == {"why": None, "ended": []}  # it was killed as an orphan: status -9
