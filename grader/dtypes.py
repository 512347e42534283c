"""The dtypes the grader knows, by name: one list that the wire, the broker and the course's
options read (names only, so that reading options does not import torch)."""

from __future__ import annotations

FLOATING = ("float16", "bfloat16", "float32", "float64")
"""The floating-point dtypes a course may choose for a test (grading.yaml's ``dtype``)."""

NAMES = (*FLOATING, "int8", "uint8", "int16", "int32", "int64", "bool")
"""Every dtype a tensor may have on the wire."""
