"""A grader's folder of temporary files: held while it lives, removed by the next grader once
it died, and nothing else ever removed (``grader.launch.tmpdir``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from grader.launch import tmpdir

CLAIM_AND_WAIT = """
import sys, time
from grader.launch import tmpdir
claim = tmpdir.Claim()
print(claim.path, flush=True)
time.sleep(600)
"""


@pytest.fixture
def outer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary directory of the test's own, as ``$TMPDIR``."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    return tmp_path


def test_a_live_graders_folder_is_kept_and_a_killed_ones_removed(outer: Path):
    owner = subprocess.Popen(
        [sys.executable, "-c", CLAIM_AND_WAIT], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        folder = Path(owner.stdout.readline().strip())
        assert folder.parent == outer and (folder / tmpdir.OWNER).exists()
        assert tmpdir.sweep(outer) == [] and folder.exists()
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert tmpdir.sweep(outer) == [folder] and not folder.exists()


def test_a_claim_is_the_temporary_directory_until_released(outer: Path):
    claim = tmpdir.Claim()
    try:
        assert tempfile.gettempdir() == os.environ["TMPDIR"] == str(claim.path)
        made = Path(tempfile.mkdtemp())
        assert made.parent == claim.path
    finally:
        claim.release()
    assert os.environ["TMPDIR"] == str(outer) and not claim.path.exists()
    assert list(outer.iterdir()) == []


def test_what_is_not_a_dead_graders_folder_is_never_removed(outer: Path, tmp_path_factory):
    hostname = socket.gethostname().encode()
    unowned = outer / f"{tmpdir.PREFIX}being-made"
    unowned.mkdir()
    elsewhere = outer / f"{tmpdir.PREFIX}another-node"
    elsewhere.mkdir()
    (elsewhere / tmpdir.OWNER).write_bytes(b"another-node")
    victim = tmp_path_factory.mktemp("victim")  # a folder some user's link points at
    (victim / tmpdir.OWNER).write_bytes(hostname)
    (outer / f"{tmpdir.PREFIX}link").symlink_to(victim)
    (outer / f"{tmpdir.PREFIX}a-file").write_bytes(hostname)
    assert tmpdir.sweep(outer) == []
    assert unowned.exists() and elsewhere.exists() and (victim / tmpdir.OWNER).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's folder needs root")
def test_another_users_folder_is_never_removed(outer: Path):
    """A rank at the uid level shares /tmp: what its uid makes there, named and shaped like a
    dead grader's folder, stays (the uid block's own cleanup removes it)."""
    planted = outer / f"{tmpdir.PREFIX}planted"
    planted.mkdir()
    (planted / tmpdir.OWNER).write_bytes(socket.gethostname().encode())
    os.chown(planted, 65000, 65000)
    assert tmpdir.sweep(outer) == [] and planted.exists()
