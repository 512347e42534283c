"""A submission that keeps state between calls wherever it easily can (``test_fresh_imports.py``):
a global of its own, one of a helper module, a module of no file in ``sys.modules``, its helper
loaded again under another name and path, an attribute of ``builtins``, its draws from the
random generators, a finder that would hand this very module back to the next import, its
helper put in the place of a library module that an earlier test imported, and a mark on
``torch`` itself. Each test's first call must find all but the last as on a fresh start."""

import builtins
import importlib.util
import random
import sys
import types

import torch

from assignments import helper

_calls = 0


class _Keep:
    """A finder that gives the next import of this module this very module, state and all."""

    def __init__(self, module):
        self.module = module

    def find_spec(self, name, path=None, target=None):
        if name == self.module.__name__:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Keep(sys.modules[__name__]))


def _alias():
    """The helper's file loaded again, as ``helper_alias``, through ``/proc/self/root``."""
    if "helper_alias" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "helper_alias", "/proc/self/root" + helper.__file__
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["helper_alias"] = module
    return sys.modules["helper_alias"]


def calls_since_import():
    """How many calls each place that keeps state saw, the random draws, and whether the mark
    set on torch (which is never put back) is there."""
    global _calls
    _calls += 1
    helper.calls += 1
    kept = sys.modules.setdefault("kept_state", types.ModuleType("kept_state"))
    kept.calls = getattr(kept, "calls", 0) + 1
    builtins.kept_calls = getattr(builtins, "kept_calls", 0) + 1
    alias = _alias()
    alias.calls += 1
    counts = [_calls, helper.calls, kept.calls, builtins.kept_calls, alias.calls]
    draws = [random.random(), float(torch.rand(1))]
    marked = getattr(torch, "_state_between_tests", False)
    torch._state_between_tests = True
    return [counts, draws, marked]


def import_library():
    """Import a library module (``colorsys``) no rank has at its start; say whether it was
    there already."""
    there = "colorsys" in sys.modules
    import colorsys  # noqa: F401

    return there


def in_place_of_library():
    """The helper's file loaded again as ``colorsys``, in the place of the library module, and
    the calls it has seen: a module judged not the submission's at one test's start, then
    replaced, must be judged anew at the next."""
    module = sys.modules.get("colorsys")
    if not hasattr(module, "calls"):
        spec = importlib.util.spec_from_file_location("colorsys", helper.__file__)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["colorsys"] = module
    module.calls += 1
    return module.calls
