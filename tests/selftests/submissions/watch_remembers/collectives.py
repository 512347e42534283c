"""The reference, remembering what it can between gradings: in watch mode it must find
nothing. Its import fails if this module was imported before in the same process, or if a
mark an earlier import left is still in the rank's scratch folder (its cwd), /tmp or
/dev/shm (where the sandbox lets it write there)."""

import os
import pathlib
import sys

from reference.collectives import *  # noqa: F403

_MARKS = [pathlib.Path(p) / f"watch-remembers-{os.environ['RANK']}" for p in (".", "/tmp", "/dev/shm")]
if getattr(sys, "graded_before", False) or any(m.exists() for m in _MARKS):
    raise RuntimeError("this rank saw an earlier grading")
sys.graded_before = True
for _mark in _MARKS:
    try:
        _mark.write_text("seen")
    except OSError:
        pass
