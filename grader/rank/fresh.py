"""Each test starts the submission afresh, on ranks that served the tests before it.

One job's ranks serve every test of a grading, so what the submission did in one test could
linger into the next, and its grade would depend on which tests ran first. At a test's first
call the worker puts back what the submission is likely to have changed, by accident or
on purpose, as it was before the submission first ran (:class:`Pristine`): the submission's
modules are dropped and imported anew; the import system's finders, hooks and path, and the
builtins, are restored; the random generators are seeded alike for every test. What is not
put back is what only a submission set on keeping state reaches (a thread it left running, an
attribute it set on torch, the environment, a file in the rank's own ``/tmp``); no rank holds
anything a later test's grade could use.
"""

from __future__ import annotations

import builtins
import importlib
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

SEED = 0  # the student's own random draws, alike in every test (the inputs are the grader's)


@dataclass(frozen=True)
class Pristine:
    """The import system and the builtins of a rank before the submission first ran."""

    modules: frozenset[str]
    packages: frozenset[str]  # the top-level names of those modules
    meta_path: tuple[Any, ...]
    path_hooks: tuple[Any, ...]
    path: tuple[str, ...]
    builtins: dict[str, Any]
    # Modules imported since then and judged not the submission's (torch imports thousands
    # lazily, torch._dynamo at a first optimizer), by name and object: each is judged once
    # (a realpath each), and another object put in its place is judged anew.
    libraries: dict[str, ModuleType] = field(default_factory=dict)

    @classmethod
    def now(cls) -> Pristine:
        return cls(
            frozenset(sys.modules),
            frozenset(name.partition(".")[0] for name in sys.modules),
            tuple(sys.meta_path),
            tuple(sys.path_hooks),
            tuple(sys.path),
            dict(vars(builtins)),
        )

    def restore(self, import_dir: Path) -> None:
        """Start a test: the state of :meth:`now`, the submission's modules dropped."""
        sys.meta_path[:] = self.meta_path
        sys.path_hooks[:] = self.path_hooks
        sys.path[:] = self.path
        sys.path_importer_cache.clear()
        importlib.invalidate_caches()
        current = vars(builtins)
        for name in set(current) - set(self.builtins):
            del current[name]
        current.update(self.builtins)
        staged = os.path.realpath(import_dir) + os.sep
        for name in sys.modules.keys() - self.modules:
            module = sys.modules.get(name)
            if name in self.libraries and self.libraries[name] is module:
                continue
            if _submissions(name, module, staged, self.packages):
                sys.modules.pop(name, None)
            elif isinstance(module, ModuleType):
                self.libraries[name] = module
        random.seed(SEED)
        torch.manual_seed(SEED)


def _submissions(name: str, module: Any, staged: str, tops: frozenset[str]) -> bool:
    """Whether a module imported since :meth:`Pristine.now` is the submission's: its package,
    a file of the staged copy under any name or path, or a module of no file outside every
    package the rank had before."""
    if name == "assignments" or name.startswith("assignments."):
        return True
    try:
        where = getattr(module, "__file__", None)
    except Exception:  # a module object of the submission's making
        return True
    if not isinstance(where, str):
        return name.partition(".")[0] not in tops
    return os.path.realpath(where).startswith(staged)
