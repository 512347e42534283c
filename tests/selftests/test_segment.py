"""The shared-memory segments payloads move through (``grader/segment.py``), against a rank
that writes what it likes into its own.

What the broker records and hands on is its own copy, made once as it reads the frame: a
rank that rewrites its ring afterwards changes neither. In a call whose record keeps no
payloads, a message's payload stays in its sender's ring until it is handed over, copied
once straight into its receiver's: the sender's later payloads never overwrite it, and what
a call left held is let go at the next. A frame naming bytes outside the ring breaks the
protocol; the segment's size is sealed; no segment outlives its job.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from runner import SUBMISSIONS

from grader import failures, sandbox, wire
from grader.course.submission import stage
from grader.device import Device
from grader.launch.job import job_settings
from grader.launch.world import CallLimits, RankPool
from grader.protocol import CallRequest
from grader.segment import (
    HELD_MAX,
    RING_BYTES,
    BrokerSegment,
    Held,
    RankSegment,
    Ring,
    settled,
    take_payloads,
)
from grader.wire import Frame


@pytest.fixture
def pair() -> Iterator[tuple[BrokerSegment, RankSegment]]:
    """A broker's segment and the rank's side of it, in this one process."""
    broker = BrokerSegment()
    rank = RankSegment(os.dup(broker.fd))
    broker.handed()
    broker.mapped = True  # as the rank's ``segment`` frame back says
    yield broker, rank
    broker.close()


def test_what_the_broker_took_is_its_own_copy(pair: tuple[BrokerSegment, RankSegment]) -> None:
    broker, rank = pair
    sent = torch.arange(1000, dtype=torch.float32)
    places = rank.put([sent, b"header bytes"])
    assert places is not None
    frame = Frame({"type": "send", "shm": places})
    broker.take(frame)
    rank.map[rank.out.start : rank.out.start + rank.out.size] = b"\x07" * rank.out.size
    assert bytes(frame.buffers[0]) == sent.numpy().tobytes()
    assert bytes(frame.buffers[1]) == b"header bytes"
    assert "shm" not in frame.header


@pytest.fixture
def receiver() -> Iterator[tuple[BrokerSegment, RankSegment]]:
    """A second rank's segment, as :func:`pair`."""
    broker = BrokerSegment()
    rank = RankSegment(os.dup(broker.fd))
    broker.handed()
    broker.mapped = True
    yield broker, rank
    broker.close()


QUARTER = RING_BYTES // 4
LIMITS = CallLimits(timeout=60)


def _hold_half_of_the_ring(broker: BrokerSegment, rank: RankSegment, sent: torch.Tensor) -> Held:
    """The rank's out ring after three sends: a quarter taken, ``sent`` (half the ring) held,
    a quarter taken; the rank's next payload starts the ring over."""
    broker.take(Frame({"type": "send", "shm": rank.put([b"a" * QUARTER])}))
    message = Frame({"type": "send", "shm": rank.put([sent])})
    broker.take(message, hold=True)
    broker.take(Frame({"type": "send", "shm": rank.put([b"c" * QUARTER])}))
    (held,) = message.buffers
    assert isinstance(held, Held) and len(held) == 2 * QUARTER
    return held


def test_a_held_payload_goes_straight_into_its_receivers_ring(
    pair: tuple[BrokerSegment, RankSegment], receiver: tuple[BrokerSegment, RankSegment]
) -> None:
    broker, rank = pair
    sent = torch.arange(2 * QUARTER // 4, dtype=torch.float32)
    held = _hold_half_of_the_ring(broker, rank, sent)
    # Held, it is never written over: only the ring's first quarter is free again.
    assert rank.put([b"d" * (QUARTER + 1)]) is None
    handed = receiver[0].place(Frame({"type": "done", "op": 1}, [held]))
    assert bytes(receiver[1].views(handed.header["shm"])[0]) == sent.numpy().tobytes()
    assert rank.put([b"d" * (QUARTER + 1)]) is not None  # handed over: its place is free


def test_a_held_payload_to_a_rank_without_its_ring_mapped_goes_in_the_frame(
    pair: tuple[BrokerSegment, RankSegment],
) -> None:
    broker, rank = pair
    frame = Frame({"type": "send", "shm": rank.put([b"payload"])})
    broker.take(frame, hold=True)
    unmapped = BrokerSegment()
    try:
        handed = unmapped.place(Frame({"type": "done"}, frame.buffers))
        assert "shm" not in handed.header and bytes(handed.buffers[0]) == b"payload"
    finally:
        unmapped.close()


def test_a_message_after_an_empty_one_is_held_apart_from_it(
    pair: tuple[BrokerSegment, RankSegment], receiver: tuple[BrokerSegment, RankSegment]
) -> None:
    """An empty payload takes no room, so the next one starts where it would: handing the
    empty one over must not let go of the next."""
    broker, rank = pair
    empty = Frame({"type": "send", "shm": rank.put([torch.empty(0)])})
    full = Frame({"type": "send", "shm": rank.put([torch.full((1024,), 3.0)])})
    broker.take(empty, hold=True)
    broker.take(full, hold=True)
    for frame in (empty, full):
        handed = receiver[0].place(Frame({"type": "done"}, frame.buffers))
        got = receiver[1].views(handed.header["shm"])[0]
        assert bytes(got) == (b"" if frame is empty else torch.full((1024,), 3.0).numpy().tobytes())
        receiver[1].release(handed.header["shm"])


def test_a_rank_cannot_make_the_broker_hold_without_end(
    pair: tuple[BrokerSegment, RankSegment],
) -> None:
    """A frame naming many places, or the held payloads past :data:`HELD_MAX`, are copied out
    as read, as in a recorded call: what a rank makes the broker keep stays bounded."""
    broker, rank = pair
    many = Frame({"type": "send", "shm": [[i, 1] for i in range(64)]})
    broker.take(many, hold=True)
    assert not any(isinstance(b, Held) for b in many.buffers)
    frames = [Frame({"type": "send", "shm": rank.put([b"x"])}) for _ in range(HELD_MAX + 1)]
    for frame in frames:
        broker.take(frame, hold=True)
    assert [isinstance(f.buffers[0], Held) for f in frames] == [True] * HELD_MAX + [False]
    assert bytes(frames[-1].buffers[0]) == b"x"


def test_what_a_call_left_held_is_let_go(pair: tuple[BrokerSegment, RankSegment]) -> None:
    broker, rank = pair
    held = _hold_half_of_the_ring(broker, rank, torch.ones(2 * QUARTER // 4))
    assert rank.put([b"d" * (QUARTER + 1)]) is None
    broker.unhold()  # the next call began: the message will never be received
    assert rank.put([b"d" * (QUARTER + 1)]) is not None
    (stale,) = settled(Frame({"type": "done"}, [held])).buffers
    assert bytes(stale) == bytes(2 * QUARTER)  # no stale bytes handed on


@pytest.mark.parametrize(
    "places",
    [
        [[RING_BYTES - 8, 16]],
        [[0, RING_BYTES + 1]],
        [[-1, 4]],
        [[1 << 62, 4]],
        [["0", 4]],
        [[0, True]],
        [[0, 4, 4]],
        [[0, RING_BYTES]] * 2,  # a few bytes of header, 32 MiB for the broker to copy
        "everything",
    ],
)
def test_a_payload_outside_the_ring_breaks_the_protocol(
    pair: tuple[BrokerSegment, RankSegment], places: object
) -> None:
    broker, _ = pair
    with pytest.raises(wire.WireError, match="shared-memory payload"):
        broker.take(Frame({"type": "send", "shm": places}))


def test_payloads_in_the_frame_and_the_ring_at_once_break_the_protocol(
    pair: tuple[BrokerSegment, RankSegment],
) -> None:
    broker, _ = pair
    with pytest.raises(wire.WireError, match="both"):
        broker.take(Frame({"type": "send", "shm": [[0, 4]]}, [b"abcd"]))
    with pytest.raises(wire.WireError, match="never given"):
        take_payloads(None, Frame({"type": "send", "shm": [[0, 4]]}))  # a relayed rank


def test_the_segment_cannot_change_size() -> None:
    broker = BrokerSegment()
    try:
        for size in (0, os.fstat(broker.fd).st_size * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(broker.fd, size)
    finally:
        broker.close()


def test_the_in_ring_never_overwrites_what_the_rank_has_not_consumed(
    pair: tuple[BrokerSegment, RankSegment],
) -> None:
    broker, rank = pair
    chunk = b"x" * (RING_BYTES // 3)
    held = [broker.place(Frame({"type": "done"}, [chunk])) for _ in range(4)]
    assert [("shm" in f.header) for f in held] == [True, True, True, False]  # the 4th waits
    assert held[3].buffers == [chunk]  # it travels in the frame instead
    assert bytes(rank.views(held[0].header["shm"])[0]) == chunk
    rank.release(held[0].header["shm"])
    assert "shm" in broker.place(Frame({"type": "done"}, [chunk])).header


def test_a_rank_that_lies_about_what_it_consumed_garbles_only_its_own_ring(
    pair: tuple[BrokerSegment, RankSegment],
) -> None:
    broker, rank = pair
    rank.release([[1 << 61, 0]])  # far ahead of anything the broker wrote
    for _ in range(5):
        frame = broker.place(Frame({"type": "done"}, [b"y" * (RING_BYTES // 2)]))
        (place,) = frame.header["shm"]
        assert broker.into.span(place).stop <= broker.into.start + RING_BYTES


def test_a_payload_never_straddles_the_end_of_the_ring() -> None:
    ring = Ring(0, 100)
    assert ring.reserve([60], 0) == [[0, 60]]
    assert ring.reserve([60], 0) is None  # 40 bytes left at the end, 0 at the start
    assert ring.reserve([60], 60) == [[100, 60]]  # starts over at offset 0
    assert ring.reserve([10, 50], 160) == [[160, 10], [200, 50]]


# -- a rank of a real job, sandboxed ------------------------------------------------------------


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankPool]:
    work = tmp_path_factory.mktemp("segment")
    stage(SUBMISSIONS / "segment_attacks", work / "import")
    level = sandbox.detect()
    pool = RankPool(2, job_settings(work, level, Device.CPU))
    yield pool
    pool.close()


def _segments_here() -> list[str]:
    """This process's descriptors and mappings of a grader segment."""
    found = [
        f"fd {name}"
        for name in os.listdir("/proc/self/fd")
        if "grader-segment" in _link(f"/proc/self/fd/{name}")
    ]
    maps = Path("/proc/self/maps").read_text().splitlines()
    return found + [line for line in maps if "grader-segment" in line]


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def test_a_rank_rewriting_its_ring_after_a_send_changes_nothing(pool: RankPool) -> None:
    n = 1 << 18  # 1 MiB: in the ring
    out = pool.call(CallRequest(2, "collectives.rewrite_after_send", [(n,)] * 2), LIMITS)
    rewrites, received = out.returned
    assert rewrites > 0  # the ring was there, and written over while the message waited
    assert torch.equal(received, torch.ones(n))
    send = next(e for e in out.traffic.per_rank[0] if e.op == "send" and e.tag == 1)
    assert send.nbytes == 4 * n and bytes(send.payload) == torch.ones(n).numpy().tobytes()
    assert out.traffic.delivered[1] >= 4 * n


def test_held_messages_arrive_whole_however_many_wait(pool: RankPool) -> None:
    """In calls whose record keeps no payloads: six 4 MiB messages wait at once, more than a
    16 MiB ring holds (the later ones travel in their frames), received last first."""
    n, count = 1 << 20, 6
    for _ in range(2):  # the first call's held payloads leave the ring as it was
        out = pool.call(
            CallRequest(2, "collectives.many_held", [(n, count)] * 2, keep_payloads=False), LIMITS
        )
        assert out.returned[1] == [True] * count
        sends = [e for e in out.traffic.per_rank[0] if e.op == "send"]
        assert [e.nbytes for e in sends] == [4 * n] * count
        assert all(e.payload == b"" for e in sends)
        assert out.traffic.delivered[1] >= count * 4 * n


def test_a_message_after_an_empty_one_arrives_whole(pool: RankPool) -> None:
    out = pool.call(
        CallRequest(2, "collectives.empty_then_full", [(1024,)] * 2, keep_payloads=False), LIMITS
    )
    assert out.returned[1] is True


def test_a_rank_rewriting_a_held_payload_changes_only_what_its_receiver_gets(
    pool: RankPool,
) -> None:
    """A payload held in its sender's ring is the sender's to garble, as a tensor written
    during an isend is in gloo: its size and the record stay the broker's."""
    n = 1 << 18
    out = pool.call(
        CallRequest(2, "collectives.rewrite_after_send", [(n,)] * 2, keep_payloads=False), LIMITS
    )
    rewrites, received = out.returned
    assert rewrites > 0 and received.shape == (n,)
    sevens = torch.frombuffer(bytearray(b"\x07" * 4 * n), dtype=torch.float32)
    assert torch.equal(received, torch.ones(n)) or torch.equal(received, sevens)
    send = next(e for e in out.traffic.per_rank[0] if e.op == "send" and e.tag == 1)
    assert send.nbytes == 4 * n and send.payload == b""
    test_held_messages_arrive_whole_however_many_wait(pool)  # and the job serves on


def test_a_frame_naming_bytes_outside_its_segment_breaks_the_protocol(pool: RankPool) -> None:
    with pytest.raises(failures.RankFailure, match="outside the segment"):
        pool.call(CallRequest(2, "collectives.place_outside", [()] * 2), LIMITS)


def test_a_rank_cannot_resize_its_segment(pool: RankPool) -> None:
    out = pool.call(CallRequest(2, "collectives.shrink_segment", [()] * 2), LIMITS)
    assert out.returned == [2, 2]  # shrinking and growing, both refused
    test_a_rank_rewriting_its_ring_after_a_send_changes_nothing(pool)


def test_no_segment_outlives_its_job(tmp_path: Path) -> None:
    stage(SUBMISSIONS / "segment_attacks", tmp_path / "import")
    shm_before, before = set(os.listdir("/dev/shm")), _segments_here()
    pool = RankPool(2, job_settings(tmp_path, sandbox.detect(), Device.CPU))
    try:
        pool.call(CallRequest(2, "collectives.rewrite_after_send", [(1024,)] * 2), LIMITS)
        made = [s for s in _segments_here() if s not in before]
        assert len(made) == 4  # per rank, a mapping and the descriptor it holds
    finally:
        pool.close()
    assert _segments_here() == before
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_a_rank_that_never_said_it_mapped_its_segment_gets_everything_in_frames() -> None:
    broker = BrokerSegment()
    try:
        frame = broker.place(Frame({"type": "done"}, [b"abcd"]))
        assert "shm" not in frame.header and frame.buffers == [b"abcd"]
    finally:
        broker.close()
