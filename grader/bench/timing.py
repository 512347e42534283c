"""Timing a call on a rank: wall clock on the CPU, CUDA events on a GPU."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def time_call(call: Callable[[], object], device: torch.device) -> float:
    """Seconds one call takes on this rank, with the device's queued work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    call()
    return time.perf_counter() - begin


def paired_times(
    student: Callable[[], object],
    reference: Callable[[], object],
    barrier: Callable[[], None],
    device: torch.device,
    iterations: int,
    warmup: int,
    repeats: int = 1,
) -> tuple[list[float], list[float]]:
    """Time student and reference alternately, each after a barrier; drop the warm-up pairs.

    Alternating in one job, rather than timing one then the other, exposes
    both to the same noise of a shared machine: their ratio is what is fair.
    The order flips every pair (student first, then reference first), so that
    whatever favours the first or the second call of a pair cancels out. Each
    sample times ``repeats`` calls back to back: the skew with which ranks
    leave a barrier, and the scheduler's hiccups, weigh less on a longer sample.
    """

    def repeated(call: Callable[[], object]) -> Callable[[], None]:
        def calls() -> None:
            for _ in range(repeats):
                call()

        return calls

    student, reference = repeated(student), repeated(reference)
    mine, theirs = [], []
    for i in range(warmup + iterations):
        pair = {}
        for name in ("student", "reference") if i % 2 == 0 else ("reference", "student"):
            barrier()
            pair[name] = time_call(student if name == "student" else reference, device)
        mine.append(pair["student"])
        theirs.append(pair["reference"])
    return mine[warmup:], theirs[warmup:]
