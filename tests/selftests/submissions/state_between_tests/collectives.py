"""A submission that keeps state in its modules between calls (``test_fresh_imports.py``):
a global of its own, one of a helper module, and a mark on ``torch`` itself. Each test's
first call must find the first two as a fresh import leaves them."""

import torch

from assignments import helper

_calls = 0


def calls_since_import():
    """How many calls this module and its helper saw since they were imported, and whether
    a mark set on torch (which is never imported anew) is there."""
    global _calls
    _calls += 1
    helper.calls += 1
    marked = getattr(torch, "_state_between_tests", False)
    torch._state_between_tests = True
    return [_calls, helper.calls, marked]
