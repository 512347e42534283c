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
