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
from pathlib import Path

import pytest
from runner import REPO, ends_with_the_tests

SCRIPT = """
import json, os, subprocess, sys
from grader.launch import orphans

orphans.adopt()
own = subprocess.Popen(["sleep", "600"], start_new_session=True)  # a job's torchrun, say
orphans.started(own)
library = subprocess.Popen(["sleep", "600"])  # a library's helper, in the grader's session
try:
    wrapper = subprocess.Popen(  # a rank's wrapper: its bwrap outlives it
        [sys.executable, "-c", "import subprocess; "
         "print(subprocess.Popen(['sleep', '600'], start_new_session=True).pid)"],
        stdout=subprocess.PIPE, start_new_session=True, text=True,
    )
    orphans.started(wrapper)
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


@pytest.mark.skipif(sys.platform != "linux", reason="a subreaper is Linux's")
def test_an_orphan_of_a_job_is_ended_and_reaped(tmp_path: Path) -> None:
    done = subprocess.run(
        ends_with_the_tests([sys.executable, "-c", SCRIPT]),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said["ended"] == [said["left"]]
    assert not said["left_remains"]
    assert said["own_runs"] and said["library_runs"]
