"""A rank's process: ``python -m grader.rank FD IMPORT_DIR``, or ``--probe``.

Its first act, before the interpreter imports torch or anything of the submission, is to
give up every path outside its allow-list (:func:`grader.sandbox.landlock.enter`, from
the list its trusted wrapper put in its environment). Then it serves the calls the broker
sends on descriptor ``FD``, which the wrapper connected (:mod:`grader.rank.worker`), or,
with ``--probe``, opens the sources it would import and exits: the grader's check that a
rank can start here, made through the very same walls. A rank that its job's zygote forked
(:mod:`grader.launch.zygote`) takes the same two steps, :func:`confine` then :func:`serve`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import NoReturn

from grader.sandbox import landlock


def confine() -> int | None:
    """Apply the allow-list; the exit status of a rank that cannot, else None."""
    try:
        landlock.enter()
    except (landlock.LandlockUnavailable, OSError) as err:
        print(f"the rank cannot restrict itself to its allow-list: {err}", file=sys.stderr)
        return 3
    return None


def probe() -> int:
    for name in ("grader.rank.worker", "torch"):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        with open(spec.origin, "rb"):
            pass
    return 0


def serve(connection: int, import_dir: Path) -> NoReturn:
    """Serve the broker's calls, then end: no interpreter teardown, so that nothing of the
    student's runs after the last call."""
    from grader.rank import worker

    code = worker.main(connection, import_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if (refused := confine()) is not None:
        sys.exit(refused)
    if sys.argv[1:] == ["--probe"]:
        sys.exit(probe())
    serve(int(sys.argv[1]), Path(sys.argv[2]))
