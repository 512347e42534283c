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
) -> tuple[list[float], list[float]]:
    """Alternate student and reference, each after a barrier; drop the warm-up pairs.

    Alternating in one job, rather than timing one then the other, exposes
    both to the same noise of a shared machine: their ratio is what is fair.
    """
    mine, theirs = [], []
    for _ in range(warmup + iterations):
        barrier()
        mine.append(time_call(student, device))
        barrier()
        theirs.append(time_call(reference, device))
    return mine[warmup:], theirs[warmup:]
