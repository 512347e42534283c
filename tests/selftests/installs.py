"""Helpers for the deployment tests: a private venv, scripts run as Gradescope runs them.

A venv made with ``--system-site-packages --without-pip`` finds this machine's
torch (no download) and uses the system's pip, which installs into the venv:
the developer's own environment is never touched. ``PIP_NO_INDEX`` keeps pip
off the network; ``PIP_NO_BUILD_ISOLATION=0`` (pip reads it inverted: no
isolation) builds with the setuptools already installed instead of fetching one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

VISIBILITIES = {"hidden", "after_due_date", "after_published", "visible"}


def make_venv(where: Path) -> dict[str, str]:
    """A venv at ``where`` and the environment that puts it first on PATH."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(where)],
        check=True,
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GRADER_CONFIG")}
    env.update(
        PATH=f"{where / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(where),
        PIP_NO_INDEX="1",
        PIP_NO_BUILD_ISOLATION="0",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        NO_COLOR="1",
        COLUMNS="200",
    )
    return env


def run(
    command: list[str], env: dict[str, str], cwd: Path, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run ``command`` in a session of its own; on timeout, stop it and all it started."""
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)  # the grader ends its own jobs on SIGTERM
        try:
            process.communicate(timeout=15)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def check_gradescope_results(document: dict[str, Any]) -> None:
    """Assert ``document`` follows Gradescope's results.json specification.

    https://gradescope-autograders.readthedocs.io/en/latest/specs/
    """
    assert isinstance(document["score"], (int, float)) and not isinstance(document["score"], bool)
    assert isinstance(document["execution_time"], (int, float))
    assert isinstance(document.get("output", ""), str)
    for key in ("visibility", "stdout_visibility"):
        assert document.get(key, "visible") in VISIBILITIES, key
    assert isinstance(document["tests"], list)
    for test in document["tests"]:
        assert isinstance(test["name"], str) and test["name"]
        assert isinstance(test["score"], (int, float))
        assert isinstance(test["max_score"], (int, float))
        assert 0 <= test["score"] <= test["max_score"]
        assert test["status"] in ("passed", "failed")
        assert isinstance(test["output"], str)
        assert test["visibility"] in VISIBILITIES
    total = sum(t["score"] for t in document["tests"])
    assert abs(document["score"] - total) < 1e-6
