"""`grader run --watch`: every save regrades, on fresh ranks; Ctrl-C leaves nothing behind."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from runner import assert_all_ended, materialize, start_grader

from grader import sandbox
from grader.launch.job import descendants

WATCHING = "for changes (Ctrl-C to stop)"  # not "watching": a test's tmp_path may hold it
BROKEN_BROADCAST = """

def broadcast(tensor, src):
    pass  # receives nothing
"""


class Terminal:
    """The watching grader's output, line by line, as it comes."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        assert process.stdout is not None
        stream = process.stdout
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put(None)

    def until(self, text: str, timeout: float) -> str:
        """What was printed up to and including the first line holding ``text``."""
        said: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert line is not None, f"the grader exited before printing {text!r}: {said}"
            said.append(line)
            if text in line:
                return "".join(said)


@pytest.mark.skipif(
    sandbox.detect(sandbox.requested()) is sandbox.Level.NONE,
    reason="unsandboxed ranks share the host's /tmp",
)
def test_watch_regrades_each_save_on_fresh_ranks_and_ctrl_c_leaves_nothing(tmp_path: Path):
    submission = materialize("watch_remembers", tmp_path)  # the reference, remembering
    source = submission / "collectives.py"
    remembering = source.read_text()
    source.write_text(remembering + BROKEN_BROADCAST)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    args = ["run", "collectives", "-k", "broadcast", "--world-size", "2", "--watch"]
    grader = start_grader([*args, "--submission", str(submission)], env={"TMPDIR": str(temporary)})
    terminal = Terminal(grader)
    started: set[int] = set()
    try:
        first = terminal.until(WATCHING, timeout=240)
        assert "broadcast (world size 2): rank 1" in first, first
        assert "Total: 0 / 2 points" in first, first
        started |= set(descendants(grader.pid))  # the next grading's ranks, started ahead

        source.write_text(remembering)  # the student fixes broadcast and saves
        second = terminal.until(WATCHING, timeout=240)
        assert "earlier grading" not in second, second
        assert "Total: 2 / 2 points" in second, second
        started |= set(descendants(grader.pid))

        grader.send_signal(signal.SIGINT)
        assert terminal.until("stopped watching", timeout=30)
        assert grader.wait(timeout=30) == 130
    finally:
        if grader.poll() is None:
            os.killpg(grader.pid, signal.SIGKILL)
    assert started
    assert_all_ended(started)
    marks = [m for shared in ("/tmp", "/dev/shm") for m in Path(shared).glob("watch-remembers-*")]
    assert not marks, f"the ranks' files outlived the grading: {marks}"
    assert not list(temporary.iterdir()), "the grader left files in its temporary folder"


def test_watching_ends_on_sigterm_with_every_job_ended(tmp_path: Path):
    """SIGTERM (a scheduler, CI, a terminal closed) while it waits for a save, its next
    grading's ranks started ahead and the reference's job up: every job ended, status 130.
    How fast is measured, not tested: docs/benchmarks.md."""
    submission = materialize("watch_remembers", tmp_path)
    args = ["run", "collectives", "-k", "broadcast", "--world-size", "2", "--watch"]
    grader = start_grader([*args, "--submission", str(submission)])
    terminal = Terminal(grader)
    try:
        terminal.until(WATCHING, timeout=240)
        started = set(descendants(grader.pid))
        grader.send_signal(signal.SIGTERM)
        assert terminal.until("stopped watching", timeout=60)
        assert grader.wait(timeout=60) == 130
    finally:
        if grader.poll() is None:
            os.killpg(grader.pid, signal.SIGKILL)
    assert started
    assert_all_ended(started)
