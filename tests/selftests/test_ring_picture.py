"""The ring's steps, read from a broker record and drawn: typed cells, the terminal and a PNG.

No grader run: the record is built by hand as the broker would have kept it, with the bytes
each send carried, so that the reading of whose block a rank held is checked on its own.
"""

from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console

from grader.broker.traffic import GatePass
from grader.report.ring import draw_failed_rings, terminal_table, worth_drawing, write_png
from grader.testkit import Event, Traffic, Work
from grader.testkit.ring import ring_messages, ring_steps

N = 2  # positions per rank


def blocks(p: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(1, 2, p * N, 4, generator=generator) for name in ("q", "k", "v", "grad")
    }


def kv(full: dict[str, torch.Tensor], owner: int) -> bytes:
    part = slice(owner * N, (owner + 1) * N)
    stacked = torch.stack([full["k"][:, :, part], full["v"][:, :, part]]).contiguous()
    return stacked.view(-1).view(torch.uint8).numpy().tobytes()


def record(
    p: int, full: dict[str, torch.Tensor], owners: list[list[int]], way: int = 1, home: int = 0
) -> Traffic:
    """Rank r sends the blocks of ``owners[r]`` to r+way in forward, receives as many from
    r-way; in backward the same blocks again, and ``home`` dK/dV blocks."""
    traffic = Traffic.empty(p)
    for r in range(p):
        events = traffic.per_rank[r]
        for owner in owners[r]:
            payload = kv(full, owner)
            events.append(Event("send", (r + way) % p, len(payload), payload=payload))
            events.append(Event("recv", (r - way) % p, len(payload)))
        # The gate that hands over the output's gradient ends the forward.
        traffic.gates[r].append(GatePass("backward", True, len(events)))
        if home:
            for owner in owners[r]:
                payload = kv(full, owner)
                events.append(Event("send", (r + way) % p, len(payload), payload=payload))
            dkv = bytes(len(kv(full, 0)))
            events += [Event("send", (r + way) % p, len(dkv), payload=dkv)] * home
    return traffic


def test_a_true_rotation_reads_as_the_ring_and_passes() -> None:
    p, full = 3, blocks(3)
    traffic = record(p, full, [[0, 2], [1, 0], [2, 1]])
    ring = ring_steps(traffic, full, N, causal=True)
    assert [[c.held for c in row] for row in ring.cells] == [[0, 2, 1], [1, 0, 2], [2, 1, 0]]
    assert all(c.right for row in ring.cells for c in row)
    assert [c.work for c in ring.cells[0]] == [Work.DIAGONAL, Work.SKIPPED, Work.SKIPPED]
    assert [c.work for c in ring.cells[2]] == [Work.DIAGONAL, Work.WHOLE, Work.WHOLE]
    problems, figures = ring_messages(traffic, full, N, 1.5)
    assert problems == [None, None, None]
    assert figures["forward_blocks"] == [[0, 2], [1, 0], [2, 1]]


def test_resending_the_own_block_is_a_wrong_cell_and_a_named_problem(tmp_path: Path) -> None:
    p, full = 3, blocks(3)
    traffic = record(p, full, [[0, 0], [1, 0], [2, 1]])  # rank 0 sends its own block twice
    ring = ring_steps(traffic, full, N, causal=False)
    wrong = [(r, s) for r, row in enumerate(ring.cells) for s, c in enumerate(row) if not c.right]
    assert wrong == [(1, 2)]  # rank 1's step 2 holds rank 0's block, not rank 2's
    assert ring.cells[1][2].held == 0 and ring.cells[1][2].expected == 2
    problems, _ = ring_messages(traffic, full, N, 1.5)
    assert problems[0] == (
        "at step 1 it sent rank 0's K/V block; a ring forwards at step 1 the block it "
        "received at step 0, rank 2's"
    )
    console = Console(record=True, width=200)
    console.print(terminal_table(ring, title="the ring's steps"))
    shown = console.export_text()
    assert "KV0 (want KV2)" in shown and "rank 2" in shown and "step 2" in shown
    path = write_png(ring, tmp_path / "ring.png", title="ring_attention_communication")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_message_to_a_rank_other_than_the_next_is_named() -> None:
    p, full = 4, blocks(4)
    traffic = record(p, full, [[0, 3, 2], [1, 0, 3], [2, 1, 0], [3, 2, 1]])
    payload = kv(full, 0)
    traffic.per_rank[0].insert(1, Event("send", 2, len(payload), payload=payload))
    problems, _ = ring_messages(traffic, full, N, 1.5)
    assert problems[0] == (
        "rank 0 sent a message to rank 2: a ring sends only to rank 1 and receives only from rank 3"
    )


def test_a_ring_turning_the_wrong_way_is_red_where_it_went_wrong_only() -> None:
    """Every rank sends to r-1: rank r holds rank r+1's block at step 1, not r-1's. The
    cells show what the broker carried to each rank, from whoever sent it."""
    p, full = 3, blocks(3)
    traffic = record(p, full, [[0, 1], [1, 2], [2, 0]], way=-1, home=3)
    ring = ring_steps(traffic, full, N, causal=True)
    assert [[c.held for c in row] for row in ring.cells] == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert [[c.right for c in row] for row in ring.cells] == [[True, False, False]] * 3
    assert ring.backward == ring.cells and ring.homeward == [3, 3, 3] and ring.wrong


def test_the_backward_ring_shows_a_missing_hop_home(tmp_path: Path) -> None:
    p, full = 2, blocks(2)
    owners = [[0], [1]]
    right = ring_steps(record(p, full, owners, home=2), full, N, causal=False)
    assert right.homeward == [2, 2] and not right.wrong
    short = ring_steps(record(p, full, owners, home=1), full, N, causal=False)
    assert short.homeward == [1, 1] and short.wrong
    console = Console(record=True, width=200)
    console.print(terminal_table(short, title="the ring's steps"))
    shown = console.export_text()
    assert "rank 1 backward" in shown and "1 of 2" in shown and "dK/dV sent on" in shown
    assert write_png(short, tmp_path / "ring.png", title="t").read_bytes()[:4] == b"\x89PNG"


def test_a_ring_is_drawn_once_and_only_where_it_is_wrong() -> None:
    p, full = 2, blocks(2)
    right = ring_steps(record(p, full, [[0], [1]], home=2), full, N, causal=True)
    short = ring_steps(record(p, full, [[0], [1]], home=1), full, N, causal=True)
    again = ring_steps(record(p, full, [[0], [1]], home=1), full, N, causal=False)
    drawn: list = []
    assert not worth_drawing(right, drawn) and not worth_drawing(None, drawn)
    assert worth_drawing(short, drawn) and not worth_drawing(again, drawn)
    assert draw_failed_rings([], Path("unused")) == []
