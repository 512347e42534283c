"""A rank's process: ``python -m grader.rank FD IMPORT_DIR``, or ``--probe``.

Its first act, before the interpreter imports torch or anything of the submission, is to
give up every path outside its allow-list (:func:`grader.sandbox.landlock.enter`, from
the list its trusted wrapper put in its environment). Then it serves the calls the broker
sends on descriptor ``FD``, which the wrapper connected (:mod:`grader.rank.worker`), or,
with ``--probe``, opens the sources it would import and exits: the grader's check that a
rank can start here, made through the very same walls.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from grader.sandbox import landlock


def probe() -> int:
    for name in ("grader.rank.worker", "torch"):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        with open(spec.origin, "rb"):
            pass
    return 0


if __name__ == "__main__":
    try:
        landlock.enter()
    except (landlock.LandlockUnavailable, OSError) as err:
        print(f"the rank cannot restrict itself to its allow-list: {err}", file=sys.stderr)
        sys.exit(3)
    if sys.argv[1:] == ["--probe"]:
        sys.exit(probe())
    from grader.rank import worker

    code = worker.main(int(sys.argv[1]), Path(sys.argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: nothing of the student's runs after the last call
