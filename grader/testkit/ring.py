"""The messages of ring attention and Ulysses, judged from what the broker carried.

Every rule here reads the broker's record (:class:`grader.broker.traffic.Traffic`) and the
bytes each message carried, against the blocks the trusted side drew: a message of the right
size holding something else is a wrong message. The forward ends where the rank passed the
gate "backward", which hands over the output's gradient: no message that needs it can come
before (a causal fact of the broker's record, not a mark the rank posts).

Ring attention (Liu et al. 2023): rank r sends only to r+1 and receives only from r-1; its
forward sends exactly p-1 K/V blocks (K and V stacked in one message, or as two), the one
sent at step s being the one received at step s-1, that is rank (r-s)'s; its backward sends
at most ``ratio`` times the bytes of (p-1) K/V blocks and p dK/dV blocks (grading.yaml's
``backward_bytes_ratio``).
Ulysses (Jacobs et al. 2023): all-to-alls only, four in forward and four in backward, each
sending every peer B (S/p)(H/p) D elements; the forward's carry the rank's q, k and v, the
backward's the output's gradient, split by heads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grader.broker.traffic import Event, Traffic
from grader.judge.verdict import Ring, RingCell, Work
from grader.protocol import OpName

KV = tuple[int, str]  # (owner rank, "KV", "VK", "K" or "V"): what a message holds


def _bytes(t: Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def kv_labels(full: dict[str, Tensor], n: int) -> dict[bytes, KV]:
    """Every K/V block as it may be sent: K, V, both stacked (either way round)."""
    labels: dict[bytes, KV] = {}
    for owner in range(full["k"].size(2) // n):
        k, v = (full[name][:, :, owner * n : (owner + 1) * n] for name in ("k", "v"))
        labels[_bytes(k)], labels[_bytes(v)] = (owner, "K"), (owner, "V")
        labels[_bytes(torch.stack([k, v]))] = (owner, "KV")
        labels[_bytes(torch.stack([v, k]))] = (owner, "VK")
    return labels


def sections(traffic: Traffic, rank: int) -> tuple[list[Event], list[Event]] | None:
    """The rank's operations before it passed the gate "backward", and from it on."""
    return traffic.split_at_gate(rank, "backward")


def forward_blocks(events: list[Event], labels: dict[bytes, KV]) -> tuple[list[int], str | None]:
    """The owners of the K/V blocks the rank sent, in order, or what it sent that is none."""
    owners: list[int] = []
    half: KV | None = None  # a K (or V) sent alone, waiting for its V (or K)
    for e in (e for e in events if e.op == OpName.SEND):
        label = labels.get(bytes(e.payload))
        if label is None:
            return owners, (
                f"its forward sent a message of {e.nbytes} bytes to rank {e.peer} that holds "
                "no K/V block: the ring's forward passes the K/V blocks on, and nothing else"
            )
        owner, part = label
        if part in ("KV", "VK"):
            owners.append(owner)
        elif half is None:
            half = label
        elif half[0] == owner and half[1] != part:
            owners.append(owner)
            half = None
        else:
            return owners, f"its forward sent rank {half[0]}'s {half[1]} without its other half"
    return owners, None


def work_of(owner: int, rank: int, causal: bool) -> Work:
    if not causal or owner < rank:
        return Work.WHOLE
    return Work.DIAGONAL if owner == rank else Work.SKIPPED


def ring_steps(traffic: Traffic, full: dict[str, Tensor], n: int, causal: bool) -> Ring:
    """Whose block each rank held at each step of the forward, by the broker's record.

    At step 0 its own; at step s the one rank r-1 sent it at step s-1 (None if that message
    is missing or holds no K/V block). What it does with it is the rule's.
    """
    p, labels = len(traffic.per_rank), kv_labels(full, n)
    sent: list[list[int]] = []
    for r in range(p):
        parts = sections(traffic, r)
        sent.append(forward_blocks(parts[0], labels)[0] if parts else [])
    cells = []
    for r in range(p):
        row = []
        for s in range(p):
            expected, before = (r - s) % p, sent[(r - 1) % p]
            held = r if s == 0 else before[s - 1] if s - 1 < len(before) else None
            row.append(RingCell(held, expected, work_of(expected, r, causal)))
        cells.append(row)
    return Ring(cells, causal)


def ring_messages(
    traffic: Traffic, full: dict[str, Tensor], n: int, ratio: float
) -> tuple[list[str | None], dict[str, Any]]:
    """Each rank's first problem with the ring's messages (None: none), and the figures."""
    p, labels = len(traffic.per_rank), kv_labels(full, n)
    block_bytes = 2 * full["k"][:, :, :n].numel() * full["k"].element_size()
    bound = (p - 1) * block_bytes + p * block_bytes  # (p-1) K/V blocks, p dK/dV blocks
    problems: list[str | None] = []
    figures: dict[str, Any] = {"forward_blocks": [], "backward_bytes": [], "backward_bound": bound}
    for r in range(p):
        problem, parts = None, sections(traffic, r)
        after, before = (r + 1) % p, (r - 1) % p
        made = traffic.collectives(r)
        strays = [e for e in traffic.per_rank[r] if e.op == OpName.SEND and e.peer != after]
        strays += [e for e in traffic.per_rank[r] if e.op == OpName.RECV and e.peer != before]
        if made:
            problem = f"it called {made[0].op}: the ring passes the K/V blocks with messages only"
        elif strays:
            e = strays[0]
            way = "sent a message to" if e.op == OpName.SEND else "received from"
            problem = (
                f"rank {r} {way} rank {e.peer}: a ring sends only to rank {after} and receives "
                f"only from rank {before}"
            )
        elif parts is None:
            problem = "the grader's mark between the forward and the backward is missing"
        if problem is None and parts is not None:
            owners, problem = forward_blocks(parts[0], labels)
            figures["forward_blocks"].append(owners)
            sent = sum(e.nbytes for e in parts[1] if e.op == OpName.SEND)
            figures["backward_bytes"].append(sent)
            expected = [(r - s) % p for s in range(p - 1)]
            if problem is None and owners != expected:
                problem = rotation_problem(owners, expected, r, p)
            if problem is None and sent > ratio * bound:
                problem = (
                    f"its backward sent {sent} bytes, {sent / bound:.2f}x the {bound} of the "
                    f"{p - 1} K/V blocks and {p} dK/dV blocks ring attention's backward needs "
                    f"(at most {ratio:g}x)"
                )
        problems.append(problem)
    return problems, figures


def rotation_problem(owners: list[int], expected: list[int], r: int, p: int) -> str:
    if len(owners) != len(expected):
        return (
            f"its forward sent {len(owners)} K/V block{'s' * (len(owners) != 1)} to rank "
            f"{(r + 1) % p}; a ring of {p} forwards exactly {p - 1}: every rank needs each "
            "other block once"
        )
    s = next(s for s, (a, b) in enumerate(zip(owners, expected, strict=True)) if a != b)
    return (
        f"at step {s} it sent rank {owners[s]}'s K/V block; a ring forwards at step {s} the "
        f"block it received at step {s - 1}, rank {expected[s]}'s"
        + (" (its own at step 0)" if s == 0 else "")
    )


def carries(event: Event, x: Tensor, p: int) -> bool:
    """Whether the all-to-all's pieces are this rank's heads of ``x``, piece j rank j's.

    Compared as sorted values: any layout of the piece's elements is fine, not their content.
    """
    if len(event.payload) != x.numel() * x.element_size():
        return False
    sent = torch.frombuffer(bytearray(event.payload), dtype=x.dtype).chunk(p)
    return all(
        torch.equal(piece.sort().values, heads.flatten().sort().values)
        for piece, heads in zip(sent, x.chunk(p, dim=1), strict=True)
    )


def ulysses_messages(
    traffic: Traffic, full: dict[str, Tensor], n: int
) -> tuple[list[str | None], dict[str, Any]]:
    """Each rank's first problem with Ulysses' all-to-alls (None: none), and the figures."""
    p = len(traffic.per_rank)
    problems: list[str | None] = []
    figures: dict[str, Any] = {"forward_all_to_alls": [], "backward_all_to_alls": []}
    piece = full["q"][:, :, :n].numel() // p
    for r in range(p):
        mine = {name: t[:, :, r * n : (r + 1) * n] for name, t in full.items()}
        problems.append(_ulysses_problem(traffic, r, p, piece, mine, figures))
    return problems, figures


def _ulysses_problem(
    traffic: Traffic, r: int, p: int, piece: int, mine: dict[str, Tensor], figures: dict
) -> str | None:
    messages = [e for e in traffic.per_rank[r] if e.peer >= 0]
    if messages:
        return f"it made a {messages[0].op} with rank {messages[0].peer}: Ulysses uses all-to-alls"
    others = [e.op for e in traffic.collectives(r) if e.op != OpName.ALL_TO_ALL]
    if others:
        return f"it called {others[0]}: Ulysses needs all-to-alls only"
    parts = sections(traffic, r)
    if parts is None:
        return "it never reached the grader's gate between the forward and the backward"
    size = p * piece * mine["q"].element_size()
    for phase, events, carried in (
        ("forward", parts[0], ("q", "k", "v")),
        ("backward", parts[1], ("grad",)),
    ):
        figures[f"{phase}_all_to_alls"].append(len(events))
        if len(events) != 4 or any(e.nbytes != size for e in events):
            sizes = ", ".join(str(e.nbytes // mine["q"].element_size() // p) for e in events)
            return (
                f"its {phase} made {len(events)} all-to-all{'s' * (len(events) != 1)}"
                f"{f' of {sizes} elements per peer' if events else ''}; Ulysses makes four, "
                f"each of B (S/p)(H/p) D = {piece} elements per peer"
            )
        for name in carried:
            if not any(carries(e, mine[name], p) for e in events):
                what = "the output's gradient" if name == "grad" else name
                return (
                    f"none of its {phase} all-to-alls carries its {what} split by heads: rank "
                    f"{r} sends rank j its positions of heads [j*H/p, (j+1)*H/p)"
                )
    return None
