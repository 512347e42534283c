"""The channel between the nodes of a run, attacked without a job (fast): the mutual proof,
the sealed records, and a node's own sandbox level (issue 14, item 4)."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from stranger import Stranger, evil_run, forged_record

from grader import protocol, sandbox, wire
from grader.nodes import Nodes, NodesError, channel, node_key
from grader.nodes.channel import Sealed, TamperedError, connect
from grader.nodes.head import Head
from grader.nodes.lend import lend_ranks, node_level
from grader.wire import Frame

KEY = b"k" * 32
NODE = {"role": "node", "node": 1}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


@pytest.fixture
def head() -> Iterator[Head]:
    run = Frame({"type": protocol.RUN, "level": "namespaces"}, [b"the submission"])
    head = Head(Nodes(2, 0, "localhost", _free_port()), KEY, 4, run)
    yield head
    head.finish()


@pytest.fixture
def evil(tmp_path: Path) -> bytes:
    """The stranger's ``run``: level ``none``, and code of its own."""
    (tmp_path / "assignments").mkdir()
    (tmp_path / "assignments" / "collectives.py").write_text("open('/tmp/owned', 'w')\n")
    return evil_run(tmp_path / "assignments")


def _pair(on_tamper=lambda why: None) -> tuple[Sealed, Sealed]:
    """Two ends of a session, as the handshake leaves them (head, peer)."""
    listener = socket.create_server(("localhost", 0))
    accepted: list = []
    thread = threading.Thread(
        target=lambda: accepted.append(channel.accept(listener.accept()[0], KEY, on_tamper))
    )
    thread.start()
    peer = connect(f"localhost:{listener.getsockname()[1]}", KEY, NODE)
    thread.join()
    listener.close()
    claim, head = accepted[0]
    assert claim == NODE
    return head, peer


def test_a_session_carries_frames_both_ways_whole() -> None:
    head, peer = _pair()
    big = bytes(range(256)) * (3 * channel.RECORD_BYTES // 256 + 7)  # several records
    wire.send_frame(peer, Frame({"type": "x", "n": 1}, [big, b""]))
    wire.send_frame(head, Frame({"type": "y"}))
    got = wire.recv_frame(head)
    assert got is not None and got.header == {"type": "x", "n": 1} and got.buffers == [big, b""]
    assert wire.recv_frame(peer) == Frame({"type": "y"})
    peer.close()
    assert wire.recv_frame(head) is None  # a clean end between records
    head.close()


def _record(sender: Sealed, receiver: Sealed) -> bytes:
    """The record of one small frame, as it crossed the wire (read past ``receiver``)."""
    wire.send_frame(sender, Frame({"type": "hello"}))
    (size,) = struct.unpack("!I", receiver.sock.recv(4, socket.MSG_WAITALL))
    body = receiver.sock.recv(size + 32, socket.MSG_WAITALL)
    return struct.pack("!I", size) + body


@pytest.mark.parametrize("attack", ["forged", "altered", "replayed", "reflected"])
def test_a_record_not_made_in_the_session_ends_it(attack: str) -> None:
    said: list[str] = []
    head, peer = _pair(said.append)
    record = _record(peer, head)  # record 0 of the peer's, which the head has not read
    if attack == "forged":
        sent = forged_record(record[4:-32])
    elif attack == "altered":
        sent = record[:-33] + bytes([record[-33] ^ 1]) + record[-32:]
    elif attack == "replayed":  # record 0 again, as record 1
        sent = record + record
    else:  # what the head sent the peer, sent back to the head
        sent = _record(head, peer)
    peer.sock.sendall(sent)
    with pytest.raises(TamperedError, match="tampered with"):
        while True:
            assert wire.recv_frame(head) == Frame({"type": "hello"})  # the genuine one only
    assert said and "integrity check" in said[0]
    head.close()
    peer.close()


def test_a_record_over_the_limit_is_not_read() -> None:
    head, peer = _pair()
    peer.sock.sendall(struct.pack("!I", 1 << 31))  # 2 GiB, it says
    with pytest.raises(TamperedError, match="over the limit"):
        wire.recv_frame(head)
    head.close()
    peer.close()


def test_a_man_in_the_middle_cannot_give_a_node_orders(head: Head, evil: bytes) -> None:
    """Between the node and the real head: both proofs pass through it, and its run cannot."""
    stranger = Stranger(head.address, forged_record(evil))
    try:
        link = connect(f"localhost:{stranger.port}", KEY, NODE)  # the head's proof, relayed
        with pytest.raises(TamperedError, match="record 0 failed its integrity check"):
            wire.recv_frame(link)
        link.close()
    finally:
        stranger.close()


def test_a_fake_head_without_the_secret_is_not_obeyed(evil: bytes) -> None:
    stranger = Stranger("", forged_record(evil), relay=False)
    try:
        with pytest.raises(NodesError, match="did not prove that it holds the course's secret"):
            connect(f"localhost:{stranger.port}", KEY, NODE)
    finally:
        stranger.close()


def test_the_head_turns_away_a_wrong_key(head: Head) -> None:
    with pytest.raises(NodesError, match=r"is \$GRADER_SECRET the same on every node"):
        connect(head.address, b"not the key" * 3, NODE)


def test_the_issues_attack_fails_closed_in_one_line(
    monkeypatch, tmp_path: Path, evil: bytes, capsys
) -> None:
    """Issue 14: a local process without the secret rewrites the head's address in the
    rendezvous store, relays the head's handshake, and sends node 1 a ``run`` at level
    ``none`` with its own code. Node 1 now refuses it at once, runs nothing, and says so
    in one line (exit status 2); the head loses the node, and says so."""
    import torch.distributed as dist

    monkeypatch.setenv("GRADER_SECRET", "the course's secret")
    nodes = Nodes(2, 0, "localhost", _free_port())
    run = Frame({"type": protocol.RUN, "level": "namespaces", "device": "cpu"}, [b""])
    head = Head(nodes, node_key(), 4, run)
    stranger = Stranger(head.address, forged_record(evil))
    try:
        store = dist.TCPStore("localhost", nodes.port, is_master=False, timeout=timedelta(10))
        store.set("grader/port", str(stranger.port))  # anyone who reaches the store can
        del store
        status = lend_ranks(Nodes(2, 1, "localhost", nodes.port))
        complaint = capsys.readouterr().err
        assert stranger.handshake_relayed.is_set()  # it did get between them
        assert status == 2
        assert complaint.startswith("grader: error: ") and len(complaint.splitlines()) == 1
        assert "record 0 failed its integrity check" in complaint, complaint
        assert "tampered with" in complaint
        assert not Path("/tmp/owned").exists()
        stranger.close()
        with pytest.raises(NodesError, match="node 1"):
            head.wait_for_nodes(timeout=10)
    finally:
        stranger.close()
        head.finish()


@pytest.mark.parametrize(
    ("own", "asked", "applied"),
    [
        ("namespaces", "namespaces", "namespaces"),
        ("uid", "uid", "uid"),
        ("none", "none", "none"),
        ("namespaces", "none", "weaker than this node's 'namespaces'"),
        ("namespaces", "uid", "weaker than this node's 'namespaces'"),
        ("uid", "none", "weaker than this node's 'uid'"),
        ("namespaces", "root", "unknown sandbox level 'root'"),
        ("namespaces", ["x"], "unknown sandbox level"),
    ],
)
def test_a_node_never_grades_below_its_own_level(own: str, asked: object, applied: str) -> None:
    if applied in {level.value for level in sandbox.Level}:
        assert node_level(sandbox.Level(own), asked).value == applied
    else:
        with pytest.raises(sandbox.SandboxError, match=applied):
            node_level(sandbox.Level(own), asked)


def test_a_node_that_says_another_level_is_turned_away(head: Head) -> None:
    link = connect(head.address, KEY, NODE)
    assert wire.recv_frame(link).header["type"] == protocol.RUN
    wire.send_frame(link, Frame({"type": protocol.READY, "level": "none"}))
    with pytest.raises(NodesError, match="node 1 applies sandbox 'none', not 'namespaces'"):
        head.wait_for_nodes(timeout=10)
    link.close()


def test_a_ready_node_gets_the_job_and_its_level_is_kept(head: Head) -> None:
    head.start_job("job1", 2, lambda rank, sock, relayed: None)
    link = connect(head.address, KEY, NODE)
    assert wire.recv_frame(link).header["type"] == protocol.RUN  # no job before it is ready
    wire.send_frame(link, Frame({"type": protocol.READY, "level": "namespaces"}))
    assert wire.recv_frame(link).header == {"type": protocol.JOB, "id": "job1", "per_node": 2}
    head.wait_for_nodes(timeout=10)
    assert head.levels == {1: "namespaces"}
    link.close()


def test_a_node_refuses_a_head_that_asks_for_a_weaker_sandbox(monkeypatch, capsys) -> None:
    """The issue's `run` at level `none`, from the real head this time: a node that would
    use a sandbox refuses it, in one line, and the head hears why."""
    own = sandbox.detect()
    if own is sandbox.Level.NONE:
        pytest.skip("this machine has no sandbox level above none")
    monkeypatch.setenv("GRADER_SECRET", "the course's secret")
    nodes = Nodes(2, 0, "localhost", _free_port())
    run = Frame({"type": protocol.RUN, "level": "none", "device": "cpu"}, [b""])
    head = Head(nodes, node_key(), 4, run)
    try:
        assert lend_ranks(Nodes(2, 1, "localhost", nodes.port)) == 2
        complaint = capsys.readouterr().err
        assert complaint == (
            f"grader: error: the head asks for sandbox level 'none', weaker than this node's "
            f"'{own.value}': a node never grades below its own level (start node 0 with "
            f"--sandbox {own.value}, or this node with --sandbox none)\n"
        )
        with pytest.raises(NodesError, match="node 1: the head asks for sandbox level 'none'"):
            head.wait_for_nodes(timeout=10)
    finally:
        head.finish()


def test_a_node_refuses_a_head_that_names_an_unknown_device(monkeypatch, capsys) -> None:
    """The device of a head's ``run`` is read as a :class:`grader.device.Device` before any
    job: a value the grader does not know is refused in one line, and the head hears why."""
    own = sandbox.detect()
    monkeypatch.setenv("GRADER_SECRET", "the course's secret")
    nodes = Nodes(2, 0, "localhost", _free_port())
    run = Frame({"type": protocol.RUN, "level": own.value, "device": "tpu"}, [b""])
    head = Head(nodes, node_key(), 4, run)
    try:
        assert lend_ranks(Nodes(2, 1, "localhost", nodes.port)) == 2
        complaint = capsys.readouterr().err
        assert complaint == (
            "grader: error: the head's run: unknown device 'tpu' (choose cpu, cuda)\n"
        )
        with pytest.raises(NodesError, match="node 1: the head's run: unknown device 'tpu'"):
            head.wait_for_nodes(timeout=10)
    finally:
        head.finish()
