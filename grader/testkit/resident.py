"""Memory promises, judged by what the kernel counts of a rank's process, never by the rank.

The broker reads a rank's resident memory as it passes a measured gate
(:mod:`grader.broker.memory`). The scenarios (:func:`grader.scenarios.fully_sharded.hold`,
:func:`grader.scenarios.data_parallel.hold_state`) place those gates before their model
exists, once it is built, once the student's class holds it, at moments of each step, and
after dropping it all. Each reading above the first is compared with what the promise allows
at that moment (the shards, their gradients, a share of the optimizer's state): a full copy
kept anywhere, the student's own lists included, stands out by its size. The model is large
(32 MiB of float32 weights) against the process's own noise (about 1 MiB).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grader.broker.ops import Gate
from grader.broker.traffic import GatePass
from grader.testkit.data import generator

WIDTH, DEPTH, ROWS, STEPS = 1024, 8, 4, 2
MiB = 1 << 20
LAYER = WIDTH * WIDTH * 4
FULL = DEPTH * LAYER
MODEL = f"a model of {DEPTH} Linear layers ({FULL // MiB} MiB of float32 weights)"
COMPUTE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
WORDS = {
    "built": "once the model was built",
    "wrapped": "once your class was constructed",
    "forward": "after step {}'s forward returned",
    "synchronized": "after step {}'s finish_gradient_synchronization()",
    "grads": "once step {}'s gradients were set",
    "stepped": "after step {}'s optimizer step",
    "rest": "after step {}'s zero_grad()",
    "end": "once everything was dropped",
}


@dataclass(frozen=True)
class Promise:
    """What a class may hold at each measured gate above the first reading (``allowed``, in
    bytes), how much over it fails (``margin``: half the least a kept copy weighs), and how
    the message names what it holds and what it should keep."""

    allowed: dict[str, int]
    margin: int
    holds: str  # "its float32 shards"
    kept: str  # "the full weights weigh 32 MiB in the compute dtype"
    fix: str


def gates(p: int, r: int, moments: tuple[str, ...], inputs: bool) -> list[Gate]:
    """Rank ``r``'s gates: ``start``, ``built``, ``wrapped``, then in each step its input
    (``inputs``: from the secret seed) and its measured ``moments``, then ``end``."""
    gen = generator(f"resident/{p}/{r}")
    marker = torch.zeros(1)
    out = [Gate.handing(label, marker, measure=True) for label in ("start", "built", "wrapped")]
    for step in range(1, STEPS + 1):
        if inputs:
            x = torch.randn(ROWS, WIDTH, generator=gen)
            out.append(Gate.handing(f"step {step} input", x))
        out += [Gate.handing(f"step {step} {m}", marker, measure=True) for m in moments]
    out.append(Gate.handing("end", marker, measure=True))
    return out


def fsdp(p: int, dtype: str) -> Promise:
    """FSDP's: the float32 shards once wrapped, their gradients after a synchronization."""
    shards = DEPTH * math.ceil(WIDTH * WIDTH / p) * 4
    allowed = {"built": FULL, "wrapped": shards, "end": 0}
    for step in range(1, STEPS + 1):
        allowed.update({f"step {step} forward": shards, f"step {step} rest": shards})
        allowed[f"step {step} synchronized"] = 2 * shards
    full = DEPTH * WIDTH * WIDTH * COMPUTE_BYTES[dtype]
    return Promise(
        allowed,
        full // 2,
        "its float32 shards (and their gradients)",
        f"the full weights weigh {full / MiB:.0f} MiB in the compute dtype",
        "Between uses a rank keeps only its shards: nothing may keep a gathered full weight "
        "after its layer's forward, neither autograd (save a note to gather it again) nor "
        "the wrapper's own references",
    )


def zero(p: int) -> Promise:
    """ZeRO-1's: the parameters and their gradients whole, AdamW's two moments for about 1/p
    of the elements (1/p plus one parameter: owners are whole parameters)."""
    share = 2 * (FULL // p + LAYER)
    allowed = {"built": FULL, "wrapped": FULL, "end": 0}
    for step in range(1, STEPS + 1):
        allowed[f"step {step} grads"] = 2 * FULL + (share if step > 1 else 0)
        allowed.update(
            {f"step {step} stepped": 2 * FULL + share, f"step {step} rest": 2 * FULL + share}
        )
    return Promise(
        allowed,
        FULL // 4,
        "the parameters, their gradients and AdamW's state for this rank's 1/p of them",
        f"AdamW's state for every parameter weighs {2 * FULL / MiB:.0f} MiB",
        "ZeRO-1 keeps optimizer state only for the parameters a rank owns: its local optimizer "
        "must see only those, and nothing may keep a state for the others",
    )


def broken(passes: list[GatePass], promise: Promise) -> str | None:
    """Why a rank's readings (``passes``) break ``promise``, or None."""
    labels = {"start", *promise.allowed}
    readings = {g.label: g.resident for g in passes if g.label in labels}
    if set(readings) != labels or None in readings.values():
        return (
            "the grader could not read this rank's memory from the kernel (/proc/PID/status of "
            "the rank's process): a memory promise cannot be judged, so it is not granted"
        )
    above = {k: v - readings["start"] for k, v in readings.items()}  # type: ignore[operator]
    if abs(above["built"] - promise.allowed["built"]) > promise.margin:
        return (
            f"the kernel counted {above['built'] / MiB:.1f} MiB more in the rank's process once "
            f"a model of {promise.allowed['built'] / MiB:.0f} MiB was built: its memory could "
            "not be measured reliably, so the memory promise is not granted"
        )
    for label, allowed in promise.allowed.items():
        if label == "end" and above[label] < -promise.margin:
            return (
                f"the rank's process held {-above[label] / MiB:.1f} MiB less once everything "
                "was dropped than before the model was built: it freed memory it held before, "
                "as if to hide what it held meanwhile"
            )
        # Once everything is dropped, what the allocator still holds (a few MiB of freed
        # pages it cannot hand back) is no promise's: "end" only bounds what was freed.
        if label != "end" and above[label] - allowed > promise.margin:
            return (
                f"{_words(label)}, the kernel counted {above[label] / MiB:.1f} MiB in the "
                "rank's process above what it held before the model was built, where "
                f"{promise.holds} allow {allowed / MiB:.1f} MiB: "
                f"{(above[label] - allowed) / MiB:.1f} MiB too many ({promise.kept}). "
                + promise.fix
            )
    return None


def _words(label: str) -> str:
    """A measured gate in the student's words."""
    *step, moment = label.split()
    return WORDS[moment].format(*step[1:])
