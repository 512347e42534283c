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

Imported anew, a file of the submission is not compiled anew: :class:`CompiledOnce` keeps each
file's code by its exact text, so each test runs the module's code afresh on new globals
without parsing it again (a tenth of a rank's time in a whole grading; the ranks cannot
write ``__pycache__`` in their sandbox).
"""

from __future__ import annotations

import builtins
import importlib
import importlib.machinery
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any, ClassVar

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


class CompiledOnce(importlib.machinery.SourceFileLoader):
    """The submission's source files, each compiled once per rank for the same text.

    A module's code object is immutable: running it again, on the fresh globals of a new
    import, is what compiling its text again would give. The text is the key, so a file
    that changes (a watched submission staged anew) is compiled anew."""

    _compiled: ClassVar[dict[str, tuple[bytes, CodeType]]] = {}  # path: (text, its code)

    def source_to_code(self, data: Any, path: Any, *, _optimize: int = -1) -> CodeType:
        text = bytes(data)
        kept = self._compiled.get(path)
        if kept is not None and kept[0] == text:
            return kept[1]
        code = super().source_to_code(text, path, _optimize=_optimize)
        self._compiled[path] = (text, code)
        return code


def compiled_once(import_dir: Path) -> Callable[[str], importlib.machinery.FileFinder]:
    """A path hook (``sys.path_hooks``) that finds the staged submission's modules in
    ``import_dir`` and its folders with :class:`CompiledOnce`, and leaves every other path
    entry to the hooks after it."""
    staged = os.path.realpath(import_dir)
    loaders = [
        (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES),
        (CompiledOnce, importlib.machinery.SOURCE_SUFFIXES),
        (importlib.machinery.SourcelessFileLoader, importlib.machinery.BYTECODE_SUFFIXES),
    ]

    def hook(entry: str) -> importlib.machinery.FileFinder:
        where = os.path.realpath(entry or os.getcwd())
        if where != staged and not where.startswith(staged + os.sep):
            raise ImportError("not the submission's folder")  # the next hook's entry
        return importlib.machinery.FileFinder(entry, *loaders)

    return hook
