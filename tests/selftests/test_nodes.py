"""Graded jobs across nodes: two `grader run` processes on this machine, as node 0 and node 1.

Each node's torchrun agent joins one c10d rendezvous, hosted by node 0's grader. Which
global ranks land on which node is torchrun's choice, but each node holds two of the four
ranks, so of rank 1 and rank 3 one always lives on node 1: a fault on each of them
(``submissions/nodes_faults``) is supervised across nodes whatever the placement.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
from runner import Graded, assert_all_ended, command_line, materialize, run_grader, start_grader
from stranger import Stranger, evil_run, forged_record

from grader.launch.job import descendants

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _nodes(port: int, rank: int) -> list[str]:
    return ["--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"localhost:{port}"]


def _end(*processes: subprocess.Popen[str]) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _when_running(graders: list[subprocess.Popen[str]], ranks: int = 4) -> list[int]:
    """Once every rank's process is up: every process the graders started."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        started = [pid for grader in graders for pid in descendants(grader.pid)]
        workers = [pid for pid in started if " -m grader.rank " in command_line(pid)]
        if len(workers) >= ranks:
            return started
        time.sleep(0.3)
    raise AssertionError("the job never started on both nodes")


def test_a_job_across_two_nodes_is_judged_as_on_one(tmp_path: Path) -> None:
    port = _free_port()
    node = start_grader(["run", *_nodes(port, 1)])  # before the head: it waits for it
    results = tmp_path / "results.json"
    submission = materialize("nodes_faults", tmp_path)
    try:
        selection = ["collectives", "-k", "reduce", "--world-size", "4", *_nodes(port, 0)]
        head = run_grader(
            ["run", *selection, "--submission", str(submission), "--results", str(results)],
            timeout=400,
        )
        said, complaint = node.communicate(timeout=60)
    finally:
        _end(node)
    assert node.returncode == 0, complaint
    assert "node 1: grading is over" in said
    graded = Graded(head.returncode, head.stdout, head.stderr, json.loads(results.read_text()))
    assert graded.returncode == 1, head.stderr
    level = graded.results["extra_data"]["sandbox"]
    assert graded.results["extra_data"]["sandbox_per_node"] == [level, level]
    assert f"node 1: joined the head at localhost:{port} (sandbox: {level})" in said

    # A rank's death, its last words and its stack reach the head, wherever the rank ran.
    assert graded.outcome("reduce", 4) == "crashed"
    assert graded.message("reduce", 4) == (
        "rank 1: the process died during the call (exit status 3) "
        "(case: reduce of float32[1] to rank 0); its last output: rank 1 leaves now"
    )
    assert graded.outcome("all_reduce", 4) == "timeout"
    stuck = graded.message("all_reduce", 4)
    assert stuck.startswith("rank 0 waits in recv from rank 3 at assignments/collectives.py:")
    assert "; rank 3 is stuck at assignments/collectives.py:" in stuck
    assert stuck.endswith(" in all_reduce (stopped after 10 s) (case: all_reduce of float32[1])")
    # What only a rank's relay may say, a rank cannot: its forgery is a broken protocol.
    forged = [t for t in graded.tests if t["extra_data"]["target"] == "collectives.reduce_scatter"]
    assert len(forged) == 3
    assert all(t["output"].startswith(_FORGED) and t["score"] == 0 for t in forged), forged
    # The cost tests of reduce and all_reduce earn every point, each after a fresh job.
    rest = [t for t in graded.tests if t not in forged and t["extra_data"]["kind"] != "correctness"]
    assert len(rest) == 4 and all(t["score"] == t["max_score"] for t in rest), [
        t["output"] for t in rest if t["score"] != t["max_score"]
    ]


_FORGED = "rank 1 broke the protocol: unknown message 'forged exited' (case: reduce_scatter of "


@pytest.mark.parametrize("killed", ["node 0", "node 1"])
def test_a_node_that_dies_ends_the_run_and_leaves_nothing(killed: str, tmp_path: Path) -> None:
    """SIGKILL to one node's grader mid-job (a rank spinning in scatter): the other ends
    too, every rank with it, and the student is not blamed: exit status 2."""
    port = _free_port()
    spinning = materialize("coll_faults", tmp_path)
    scratch = tmp_path / "tmp"  # where the killed grader's files stay: this test's own
    scratch.mkdir()
    env = {"TMPDIR": str(scratch)}
    node = start_grader(["run", *_nodes(port, 1)], env=env)
    selection = ["collectives", "-k", "scatter", "--world-size", "4", "--submission", str(spinning)]
    head = start_grader(["run", *selection, *_nodes(port, 0)], env=env)
    try:
        started = _when_running([head, node])
        victim, survivor = (head, node) if killed == "node 0" else (node, head)
        os.killpg(victim.pid, signal.SIGKILL)
        _, complaint = survivor.communicate(timeout=60)
        assert survivor.returncode == 2, complaint
        if killed == "node 0":
            assert "went away" in complaint or "lost the head" in complaint, complaint
        else:
            assert "node 1's grader stopped" in complaint, complaint
        assert len(complaint.strip().splitlines()) == 1, complaint
        assert_all_ended(started)
    finally:
        _end(node, head)


def test_a_node_with_another_secret_is_turned_away() -> None:
    port = _free_port()
    head = start_grader(
        ["run", "collectives", "-k", "scatter", "--world-size", "4", *_nodes(port, 0)]
    )
    try:
        node = run_grader(
            ["run", *_nodes(port, 1)], timeout=120, env={"GRADER_SECRET": "not the course's"}
        )
        assert node.returncode == 2
        assert "is $GRADER_SECRET the same on every node" in node.stderr
        assert len(node.stderr.strip().splitlines()) == 1, node.stderr
        assert head.poll() is None  # still waiting for a node that proves itself
        head.send_signal(signal.SIGTERM)
        assert head.wait(timeout=30) == 130
    finally:
        _end(head)


def test_a_stranger_between_the_head_and_a_node_is_refused_in_one_line(tmp_path: Path) -> None:
    """Issue 14's attack, on real graders: a process without the secret rewrites the head's
    address in the rendezvous store, relays the head's handshake to node 1 and sends it a
    ``run`` at level ``none`` with code of its own. Node 1 runs nothing and says why in one
    line; the head, which lost node 1, ends too: both exit 2."""
    import torch.distributed as dist

    port = _free_port()
    code = tmp_path / "assignments"
    code.mkdir()
    marker = tmp_path / "owned"
    (code / "collectives.py").write_text(f"open({str(marker)!r}, 'w')\n")
    selection = ["collectives", "-k", "scatter", "--world-size", "4"]
    head = start_grader(["run", *selection, *_nodes(port, 0)])
    stranger = None
    try:
        store = dist.TCPStore("localhost", port, is_master=False, timeout=timedelta(seconds=120))
        stranger = Stranger(f"localhost:{store.get('grader/port').decode()}", b"")
        stranger.payload = forged_record(evil_run(code))
        store.set("grader/port", str(stranger.port))
        del store
        node = run_grader(["run", *_nodes(port, 1)], timeout=120)
        assert stranger.handshake_relayed.is_set()
        assert node.returncode == 2
        assert node.stderr.startswith("grader: error: ") and len(node.stderr.splitlines()) == 1
        assert "record 0 failed its integrity check" in node.stderr, node.stderr
        assert "joined the head" not in node.stdout and not marker.exists()
        stranger.close()
        _, complaint = head.communicate(timeout=60)
        assert head.returncode == 2, complaint
        assert "node 1" in complaint and len(complaint.strip().splitlines()) == 1, complaint
    finally:
        if stranger is not None:
            stranger.close()
        _end(head)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nnodes", "2"], "--node-rank R must be in 0..1"),
        (["--nnodes", "2", "--node-rank", "0"], "--rdzv-endpoint HOST:PORT"),
        (
            ["--nnodes", "3", "--node-rank", "0", "--rdzv-endpoint", "localhost:29400"],
            "--nnodes 3 does not divide the job's 4 ranks",
        ),
    ],
)
def test_bad_node_options_are_one_line_and_exit_status_2(args: list[str], message: str) -> None:
    done = run_grader(["run", "collectives", "--world-size", "4", *args], timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("grader: error: ") and len(done.stderr.splitlines()) == 1
    assert message in done.stderr
