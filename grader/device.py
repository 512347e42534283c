"""Where the ranks keep their tensors: a :class:`Device`, chosen once by the grader
(:func:`detect`) and told to each rank as ``$GRADER_DEVICE`` (its ``.value``)."""

from __future__ import annotations

import ctypes.util
import os
from enum import Enum
from pathlib import Path

ENV_VAR = "GRADER_DEVICE"
#: Signs of a GPU that torch might use: NVIDIA's driver loaded or its device files (WSL's,
#: Jetson's too), ROCm's. With none of them and no CUDA driver library, the ranks' device is
#: the CPU, known without importing torch; with any, torch is asked.
_GPU_SIGNS = (
    Path("/proc/driver/nvidia"),
    Path("/dev/nvidiactl"),
    Path("/dev/dxg"),
    Path("/dev/nvhost-ctrl-gpu"),
    Path("/dev/kfd"),
)


class Device(str, Enum):
    CPU = "cpu"
    CUDA = "cuda"


def parse(text: object, where: str) -> Device:
    """``text`` read as a device; a ValueError of one line, naming ``where`` it came from."""
    try:
        return Device(text)
    except (TypeError, ValueError):
        choices = ", ".join(d.value for d in Device)
        raise ValueError(f"{where}: unknown device {str(text)[:20]!r} (choose {choices})") from None


def of_rank() -> Device:
    """The device the grader gave this rank (``$GRADER_DEVICE``, set by its wrapper)."""
    return parse(os.environ.get(ENV_VAR, Device.CPU.value), f"${ENV_VAR}")


def detect(chosen: Device | None = None) -> Device:
    """The ranks' device: ``chosen`` (``--backend``), else a GPU if torch can use one.
    Imports torch where a GPU's device file is there (call it where an interrupt waits)."""
    if chosen is not None:
        return chosen
    if not any(path.exists() for path in _GPU_SIGNS) and ctypes.util.find_library("cuda") is None:
        return Device.CPU
    import torch  # a GPU may be there: whether torch can use it is torch's to say

    return Device.CUDA if torch.cuda.is_available() else Device.CPU
