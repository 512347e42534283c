"""The trusted pieces alone, without a job: the wire format, the broker's fault detection,
the cleaning of untrusted text, the audit, and the communication figures (fast)."""

from __future__ import annotations

import socket
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from grader import protocol, wire
from grader.broker.ops import Limits
from grader.broker.server import Broker
from grader.broker.traffic import Message, Wait
from grader.judge.audit import audit
from grader.judge.communication import figures, min_rounds
from grader.judge.projection import machines, project
from grader.judge.replay import ReplayError
from grader.launch.job import listen
from grader.nodes import Nodes, NodesError
from grader.nodes.channel import connect
from grader.nodes.head import Head
from grader.protocol import OpName
from grader.testkit.costs import judge_performance
from grader.wire import Frame, WireError


def test_a_non_contiguous_view_travels_as_a_view() -> None:
    tensor = torch.arange(30, dtype=torch.float32).reshape(3, 10)[:, ::2]
    node, buffers = wire.pack([tensor, None, 3, {"k": [tensor.double()]}])
    back = wire.decode(node, buffers)
    assert torch.equal(back[0], tensor) and back[0].stride() == tensor.stride()
    assert back[1:3] == [None, 3] and torch.equal(back[3]["k"][0], tensor.double())


@pytest.mark.parametrize(
    "node",
    [
        {"k": "tensor", "dtype": "float32", "shape": [4], "stride": [1], "buf": 0},  # short
        {"k": "tensor", "dtype": "object", "shape": [1], "stride": [1], "buf": 0},
        {"k": "tensor", "dtype": "float32", "shape": [-1], "stride": [1], "buf": 0},
        {"k": "pickle", "v": "cos\nsystem\n"},
        {"k": "list", "v": "x"},
    ],
)
def test_malformed_values_are_refused(node: dict) -> None:
    with pytest.raises(WireError):
        wire.decode(node, [b"\0" * 8])


def test_untrusted_text_is_capped_and_stripped_of_control_characters() -> None:
    text = protocol.clean("\x1b[2J\x1b[31mok\x1b[0m\r\x07" + "A" * 10_000)
    assert text.startswith("okA") and len(text) == protocol.MAX_TEXT and text.endswith("...")


def test_the_audit_points_at_what_a_ta_should_read(tmp_path: Path) -> None:
    (tmp_path / "collectives.py").write_text(
        "import ctypes\nimport torch\nx = torch.ops.c10d\nexec('1')\n"
    )
    found = audit(tmp_path)
    assert "assignments/collectives.py:1: loads C code (ctypes)" in found
    assert "assignments/collectives.py:3: calls torch operators directly (torch.ops)" in found
    assert "assignments/collectives.py:4: runs a string as code (exec)" in found


class FakeRank:
    """A rank speaking the protocol by hand: what the broker sees from a real one."""

    def __init__(self, broker_dir: Path, rank: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(protocol.rank_socket(broker_dir, rank)))
        self.frames: list[Frame] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.post(protocol.HELLO, rank=rank)  # a rank is up once it has spoken

    def _read(self) -> None:
        try:
            while (frame := wire.recv_frame(self.sock)) is not None:
                self.frames.append(frame)
        except ConnectionResetError:  # the broker closed this fake rank: its end, as EOF is
            pass

    def post(self, kind: str, buffers: list[bytes] | None = None, **header: object) -> None:
        wire.send_frame(self.sock, Frame({"type": kind, **header}, buffers or []))

    def message(self, kind: str, op: int, peer: int, numel: int, at: str) -> None:
        payload = [b"\0" * 4 * numel] if kind == protocol.SEND else []
        meta = {"dtype": "float32", "numel": numel}
        self.post(kind, payload, op=op, peer=peer, group=[0, 1], tag=0, at=at, **meta)


@pytest.fixture
def broker(tmp_path: Path):
    broker = Broker(2)
    broker.accept_on(listen(tmp_path, 2))
    ranks = [FakeRank(tmp_path, r) for r in range(2)]
    assert broker.wait_connected(time.monotonic() + 5)
    call = Frame({"type": protocol.CALL, "call": 1, "function": "x.y", "args": {}})
    broker.start_call([call, call], forbid_collectives=True)
    yield broker, ranks
    broker.close()


def settle(broker: object, until) -> None:
    deadline = time.monotonic() + 5
    while not until() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_two_ranks_blocked_in_send_to_each_other_are_a_deadlock_at_once(broker) -> None:
    broker, (zero, one) = broker
    zero.message(protocol.SEND, 1, 1, 4, "c.py:3 in f")
    one.message(protocol.SEND, 1, 0, 4, "c.py:3 in f")
    zero.post(protocol.WAIT, op=1)
    one.post(protocol.WAIT, op=1)
    settle(broker, lambda: broker.problems)
    assert [p.kind for p in broker.problems] == ["deadlock"]
    assert broker.problems[0].message == (
        "deadlock: rank 0 waits in send to rank 1 at c.py:3 in f "
        "while rank 1 waits in send to rank 0 at c.py:3 in f"
    )


def test_a_size_mismatch_names_both_lines(broker) -> None:
    broker, (zero, one) = broker
    one.message(protocol.SEND, 1, 0, 4, "c.py:9 in g")
    zero.message(protocol.RECV, 1, 1, 2, "c.py:7 in g")
    settle(broker, lambda: broker.problems)
    assert broker.problems[0].message == (
        "rank 1 sent 16 bytes (float32[4]) to rank 0 (at c.py:9 in g), which posted a "
        "receive of 8 bytes (float32[2]) (at c.py:7 in g)"
    )


def test_a_message_to_a_rank_outside_the_group_is_named(broker) -> None:
    broker, (zero, _) = broker
    zero.message(protocol.SEND, 1, 3, 1, "c.py:5 in h")
    settle(broker, lambda: broker.problems)
    assert broker.problems[0].message == (
        "rank 0: send to rank 3, but the group has ranks 0..1 (at c.py:5 in h)"
    )


def test_a_collective_where_none_is_allowed_is_forbidden(broker) -> None:
    broker, (zero, _) = broker
    zero.post(protocol.COLLECTIVE, [b"\0" * 4], op=1, name="all_reduce", group=[0, 1],
              inputs=[{"dtype": "float32", "numel": 1}], outputs=[], at="c.py:2 in k")  # fmt: skip
    settle(broker, lambda: broker.problems)
    assert broker.problems[0].kind.failure.outcome == protocol.FORBIDDEN
    assert broker.problems[0].message.startswith(
        "rank 0: called a built-in collective (all_reduce) at c.py:2 in k"
    )


def test_garbage_on_the_socket_is_a_protocol_error_not_a_crash(broker) -> None:
    broker, (zero, _) = broker
    zero.post("launch_missiles", op=1)
    settle(broker, lambda: broker.problems)
    assert broker.problems[0].kind == "protocol"
    assert "unknown message 'launch_missiles'" in broker.problems[0].message


def test_a_send_that_lies_about_its_size_breaks_the_protocol(broker) -> None:
    broker, (zero, _) = broker
    meta = {"dtype": "float32", "numel": 0}
    zero.post(protocol.SEND, [b"\0" * 64], op=1, peer=1, group=[0, 1], tag=0, at="", **meta)
    settle(broker, lambda: broker.problems)
    assert broker.problems[0].kind == "protocol"
    assert "a send declares float32[0] but carries 64 bytes" in broker.problems[0].message
    assert broker.broken() == [0]


def test_a_message_is_handed_over_only_when_its_rank_waits_for_it(broker) -> None:
    broker, (zero, one) = broker
    zero.message(protocol.RECV, 1, 1, 4, "c.py:1 in f")
    one.message(protocol.SEND, 1, 0, 4, "c.py:2 in f")
    settle(broker, lambda: any(f.header["type"] == protocol.DONE for f in one.frames))
    assert not any(f.header["type"] == protocol.DONE for f in zero.frames)
    zero.post(protocol.WAIT, op=1, block=False)
    settle(broker, lambda: any(f.header["type"] == protocol.DONE for f in zero.frames))
    done = next(f for f in zero.frames if f.header["type"] == protocol.DONE)
    assert done.buffers == [b"\0" * 16]
    assert broker.traffic.waits[0] == [Wait(after=1, of=0)]


def test_a_rank_that_floods_the_grader_is_stopped_at_the_limit(tmp_path: Path) -> None:
    broker = Broker(2, Limits(buffered_bytes=1000, operations=50))
    broker.accept_on(listen(tmp_path, 2))
    zero, one = (FakeRank(tmp_path, r) for r in range(2))
    assert broker.wait_connected(time.monotonic() + 5)
    call = Frame({"type": protocol.CALL, "call": 1, "function": "x.y", "args": {}})
    broker.start_call([call, call], forbid_collectives=True)
    for op in range(1, 4):  # 3 x 400 bytes that nobody receives
        zero.message(protocol.SEND, op, 1, 100, "c.py:4 in flood")
    for op in range(1, 60):
        one.message(protocol.RECV, op, 0, 1, "c.py:5 in flood")
    settle(broker, lambda: sum(p.kind == "limit" for p in broker.problems) >= 2)
    messages = sorted(p.message for p in broker.problems if p.kind == "limit")
    assert messages[0].startswith("rank 0: the send to rank 1 at c.py:4 in flood would leave ")
    assert messages[1] == (
        "rank 1 posted more than 50 operations (sends, receives, collectives, waits and marks) "
        "in one call"
    )
    broker.close()


def ring_all_reduce(p: int, n: int) -> list[list[Message]]:
    """Each step: send to the right, receive from the left, wait for that receive."""
    events: list[list[Message]] = [[] for _ in range(p)]
    for _ in range(2 * (p - 1)):
        for r in range(p):
            events[r].append(Message(OpName.SEND, (r + 1) % p, n // p))
            events[r].append(Message(OpName.RECV, (r - 1) % p, n // p))
            events[r].append(Message.wait(len(events[r]) - 1))
    return events


def test_a_pattern_that_cannot_be_replayed_earns_nothing_and_says_why():
    """Every rank waits for a message first and sends its own only afterwards: no machine
    could run it, so no figure is made from it."""
    p = 3
    events = [
        [
            Message(OpName.RECV, (r - 1) % p, 4),
            Message.wait(0),
            Message(OpName.SEND, (r + 1) % p, 4),
        ]
        for r in range(p)
    ]
    with pytest.raises(ReplayError, match="rank 0 waits for a message from rank 2"):
        figures(events)
    judged = judge_performance("all_reduce", p, 12, events, ring_all_reduce(p, 12), 1.5, 3.0)
    assert judged.fraction == 0.0
    assert judged.message.startswith("the message pattern could not be replayed: rank 0 waits")


def test_ring_all_reduce_meets_the_bandwidth_bound_in_2p_minus_2_rounds():
    result = figures(ring_all_reduce(4, 4_000_000))
    assert result.busiest_bytes == 2 * 3 / 4 * 4_000_000
    assert result.rounds == 6
    assert min_rounds(4) == 2


def test_linear_sends_from_one_rank_take_one_round_each():
    """One-port model: a root sending to p-1 ranks in turn needs p-1 rounds."""
    p = 4
    events = [[Message(OpName.SEND, r, 8) for r in range(1, p)]]
    events += [[Message(OpName.RECV, 0, 8)] for _ in range(1, p)]
    assert figures(events).rounds == p - 1


def test_a_root_receiving_from_everyone_takes_one_round_per_message():
    """Receives are one per round too: a linear gather needs p-1 rounds, not one."""
    p = 4
    events = [[Message(OpName.RECV, r, 8) for r in range(1, p)]]
    events += [[Message(OpName.SEND, 0, 8)] for _ in range(1, p)]
    assert figures(events).rounds == p - 1


def test_projection_charges_the_slow_links_more():
    by_name = {m.name: m for m in machines()}
    events = ring_all_reduce(4, 64_000_000)
    nvlink = project(events, by_name["nvlink-node"])
    ethernet = project(events, by_name["ethernet-cluster"])
    assert 0 < nvlink < ethernet


def test_the_heads_port_serves_no_one_without_the_proof() -> None:
    """Across nodes, only who knows the course's key reaches the broker, and only for the
    job that runs; a stranger's first frame is never read beyond a small size."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    key = b"k" * 32
    head = Head(Nodes(2, 0, "localhost", port), key, 4, Frame({"type": protocol.RUN}))
    served: list[int] = []
    head.start_job("job2", 2, lambda rank, sock, relayed: served.append(rank))
    try:
        with pytest.raises(NodesError, match="turned this away"):
            connect(head.address, b"not the key" * 3, {"role": "rank", "job": "job2", "rank": 1})
        for claim in [
            {"role": "rank", "job": "job1", "rank": 1},  # a job that is over
            {"role": "rank", "job": "job2", "rank": 4},  # no such rank
        ]:
            sock = connect(head.address, key, claim)
            sock.settimeout(5)
            assert wire.recv_frame(sock) is None, claim  # closed unserved
            sock.close()
        stranger = socket.create_connection(("localhost", int(head.address.split(":")[1])))
        stranger.settimeout(5)
        assert wire.recv_frame(stranger).header["type"] == protocol.CHALLENGE
        stranger.sendall(struct.pack("!II", 2, 1) + struct.pack("!Q", 1 << 30))  # 1 GiB, it says
        assert stranger.recv(1) == b""
        connect(head.address, key, {"role": "rank", "job": "job2", "rank": 1})
        settle(head, lambda: served)
        assert served == [1] and head.problem() is None
    finally:
        head.finish()


def test_a_stranger_trickling_bytes_is_cut_at_the_handshakes_deadline(monkeypatch) -> None:
    from grader.nodes import channel

    monkeypatch.setattr(channel, "HANDSHAKE_SECONDS", 0.5)
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    head = Head(Nodes(2, 0, "localhost", port), b"k" * 32, 4, Frame({"type": protocol.RUN}))
    try:
        stranger = socket.create_connection(("localhost", int(head.address.split(":")[1])))
        assert wire.recv_frame(stranger).header["type"] == protocol.CHALLENGE
        started = time.monotonic()
        with pytest.raises(OSError):  # a byte every 0.1 s, until the head cuts the connection
            while time.monotonic() - started < 5:
                stranger.sendall(b"\0")
                time.sleep(0.1)
        assert time.monotonic() - started < 3
    finally:
        head.finish()
