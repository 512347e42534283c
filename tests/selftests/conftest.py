"""The project's own tests: run the real `grader` command on submissions and read its verdicts.

Submissions live in ``submissions/<name>/``: broken ones written to fail in one
precise way each, so that the verdict a careful TA would give can be asserted,
along with every other test of theirs being unaffected.
"""

from __future__ import annotations

import json
import signal
import sys

import pytest
from runner import REPO, Graded, materialize, run_grader

# The Ctrl-C these tests send must reach the grader as a terminal's would. A suite started
# in the background (`pytest &` in a script) inherits SIGINT ignored from the shell, and an
# ignored signal stays ignored across exec: every grader it started would ignore it too.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_sessionstart(session: pytest.Session) -> None:
    """The suite grades at the sandbox level a course uses: where this machine cannot give
    one, it stops at once with the one line that says why and how to get it, rather than
    failing a hundred tests on it."""
    if sys.platform != "linux" or getattr(session.config, "workerinput", None) is not None:
        return  # elsewhere the tests that need a level skip; xdist's workers: the controller
    from grader import sandbox

    why = sandbox.unavailable(sandbox.Level.NAMESPACES)
    if why is not None:
        pytest.exit(f"the project's tests need a sandbox level here: {why} (bash .ci/run "
                    "installs everything they need)", returncode=2)  # fmt: skip


@pytest.fixture(scope="session")
def grade(tmp_path_factory: pytest.TempPathFactory):
    """``grade(submission, *parts, k=..., world_sizes=[...])``: a cached `grader run`."""
    cache: dict[tuple, Graded] = {}

    def run(
        submission: str, *parts: str, k: str | None = None, world_sizes: tuple[int, ...] = ()
    ) -> Graded:
        key = (submission, parts, k, tuple(world_sizes))
        if key not in cache:
            out = tmp_path_factory.mktemp("results") / "results.json"
            known = {"reference": "reference", "stubs": str(REPO / "assignments")}
            path = known.get(submission) or str(
                materialize(submission, tmp_path_factory.mktemp("submissions"))
            )
            args = ["run", *parts, "--submission", path, "--results", str(out)]
            args += ["-k", k] if k else []
            for size in world_sizes:
                args += ["--world-size", str(size)]
            done = run_grader(args)
            results = json.loads(out.read_text()) if out.exists() else {}
            cache[key] = Graded(done.returncode, done.stdout, done.stderr, results)
        return cache[key]

    return run
