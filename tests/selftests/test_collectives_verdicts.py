"""The verdicts a careful TA would give the collectives part, submission by submission."""

from __future__ import annotations

import json
from pathlib import Path

from runner import materialize, run_grader

from grader.testkit.calls import COLLECTIVES

FUNCTIONS = COLLECTIVES


def test_reference_earns_every_point(grade):
    graded = grade("reference")
    collectives = [t for t in graded.tests if t["extra_data"]["part"] == "collectives"]
    kinds = [t["extra_data"]["kind"] for t in collectives]
    # Correctness at 4 world sizes, communication at 3, performance at 2.
    assert (kinds.count("correctness"), kinds.count("communication")) == (32, 24)
    assert kinds.count("performance") == 16
    assert all(t["score"] == t["max_score"] for t in collectives), [
        (t["name"], t["output"]) for t in collectives if t["score"] != t["max_score"]
    ]
    ring = graded.test("communication[all_reduce]", 4)["extra_data"]
    assert ring["bytes_ratio"] == 1.0
    assert ring["student"]["rounds"] == 6  # 2(p-1) steps of the ring


def test_untouched_stubs_earn_nothing_and_every_test_is_reported(grade):
    graded = grade("stubs")
    assert graded.returncode == 1
    assert graded.results["score"] == 0
    assert len([t for t in graded.tests if t["extra_data"]["part"] == "collectives"]) == 72
    for function in FUNCTIONS:
        for name, world_size in ((function, 1), (function, 4), (f"performance[{function}]", 4)):
            # A cost test checks the result too: no points for the cost of code that fails.
            assert graded.outcome(name, world_size) == "failed"
            assert graded.message(name, world_size) == (
                f"not implemented yet: {function} raises NotImplementedError"
            )


def test_faults_get_their_own_verdict_and_spare_the_other_tests(grade):
    graded = grade("coll_faults", "collectives", world_sizes=(3,))
    assert graded.outcome("broadcast", 3) == "error"
    broadcast = graded.message("broadcast", 3)
    assert broadcast.startswith("rank 1: ValueError: index out of range on rank 1 (at assignments/")
    assert (
        "in broadcast" in broadcast and "(case: broadcast of float32[1] from rank 0)" in broadcast
    )

    assert graded.outcome("reduce", 3) == "crashed"
    assert graded.message("reduce", 3).startswith(
        "rank 1: the process died during the call (exit status 3) (case: reduce of float32[1]"
    )

    # The broker sees the deadlock at once: no timeout, both waits named.
    assert graded.outcome("all_reduce", 3) == "timeout"
    assert graded.message("all_reduce", 3).startswith(
        "deadlock: rank 0 waits in send to rank 1 at "
    )
    assert "in all_reduce while rank 1 waits in send to rank 0 at " in graded.message(
        "all_reduce", 3
    )
    assert graded.message("all_reduce", 3).endswith(
        "(rank 2 returned) (case: all_reduce of float32[1])"
    )

    assert graded.outcome("scatter", 3) == "timeout"
    assert graded.message("scatter", 3).startswith("rank 0 waits in send to rank 2 at ")
    assert "; rank 2 is stuck at assignments/collectives.py:" in graded.message("scatter", 3)
    assert "in scatter (stopped after 10 s)" in graded.message("scatter", 3)
    # In a fresh job, on the large tensors where it does not spin, scatter is correct.
    assert graded.outcome("communication[scatter]", 3) == "passed"

    # A message nobody receives is named at the end of the call, and costs nothing after it.
    assert graded.outcome("gather", 3) == "error"
    assert graded.message("gather", 3).startswith("rank 0 sent 12 bytes to rank 1 (tag 0, at ")
    assert "that rank 1 never received" in graded.message("gather", 3)
    for function in ("all_gather", "reduce_scatter", "all_to_all"):
        assert graded.outcome(function, 3) == "passed", graded.message(function, 3)


def test_wrong_results_are_explained(grade):
    graded = grade("coll_wrong", "collectives", world_sizes=(2, 3, 4))
    assert graded.outcome("broadcast", 2) == "failed"
    assert (
        "it came back unchanged: nothing was received into it, or the result was never copied "
        "back into it with copy_" in graded.message("broadcast", 2)
    )
    assert graded.outcome("reduce", 4) == "failed"
    assert "rank 3's contribution is missing" in graded.message("reduce", 4)
    assert graded.outcome("all_reduce", 3) == "failed"
    assert graded.message("all_reduce", 3).startswith("rank 0: all_reduce of float32[1]: element 0")
    # Recursive doubling is right for powers of two only.
    assert graded.outcome("all_gather", 2) == "passed"
    assert graded.outcome("all_gather", 4) == "passed"
    assert graded.outcome("all_gather", 3) != "passed"
    for function in ("scatter", "gather", "reduce_scatter", "all_to_all"):
        for world_size in (2, 3, 4):
            assert graded.outcome(function, world_size) == "passed"


def test_cheats_earn_nothing(tmp_path: Path):
    """A forbidden collective, a swallowed one, a forged results.json, an exit 0 mid-test."""
    done = run_grader(
        [
            "run",
            "collectives",
            "--submission",
            str(materialize("coll_cheats", tmp_path / "submissions")),
            "--world-size",
            "2",
            "--results",
            "results.json",  # where the forger writes: the grader's cwd (the ranks have their own)
        ],
        cwd=tmp_path,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    by_name = {t["extra_data"]["test"]: t for t in results["tests"]}
    assert done.returncode == 1
    for function in ("all_reduce", "broadcast"):
        assert by_name[function]["extra_data"]["outcome"] == "forbidden"
        assert (
            f"called a built-in collective ({function}) at assignments/collectives.py"
            in (by_name[function]["output"])
        )
    assert by_name["scatter"]["extra_data"]["outcome"] == "crashed"
    assert by_name["reduce"]["status"] == "passed"  # it did the work; its forgery is overwritten
    cheated = ("all_reduce", "broadcast", "scatter")
    for test in results["tests"]:
        if test["extra_data"]["target"].split(".")[1] in cheated:
            assert test["score"] == 0, test["name"]  # no cost points either
    honest = [t for t in results["tests"] if t["extra_data"]["target"].split(".")[1] not in cheated]
    assert results["score"] == sum(t["score"] for t in honest) == 10  # 5 functions x 2 points
    assert len(results["tests"]) == 24


def test_exit_during_import_costs_the_part_only(grade):
    graded = grade("coll_import_exit", "collectives", world_sizes=(2,))
    assert graded.returncode == 1
    assert {graded.outcome(f, 2) for f in FUNCTIONS} == {"crashed"}
    assert "while importing the submission" in graded.message("broadcast", 2)
    assert graded.message("all_to_all", 2) == (
        "not run: importing assignments.collectives ends the process (in an earlier test)"
    )


def test_syntax_error_is_one_clear_line(grade):
    graded = grade("coll_syntax", "collectives", world_sizes=(2,))
    assert graded.returncode == 1
    assert "Traceback" not in graded.stdout + graded.stderr
    for function in FUNCTIONS:
        assert graded.outcome(function, 2) == "error"
        assert graded.message(function, 2).startswith(
            "assignments/collectives.py has a syntax error (line 4): invalid syntax"
        )


def test_correct_but_unusual_algorithms_earn_correctness_points_not_communication_points(grade):
    """Everyone-sends-everything all-reduce and linear broadcast: right, but not efficient."""
    graded = grade("coll_unusual", "collectives", world_sizes=(2, 3, 4))
    for function in FUNCTIONS:
        for world_size in (2, 3, 4):
            assert graded.outcome(function, world_size) == "passed", graded.message(function, 3)
    # Each rank sends its whole tensor to p-1 others: (p-1) n against 2(p-1)/p n, p/2 times
    # the bound, which is the bound itself at p = 2 only.
    assert graded.outcome("communication[all_reduce]", 2) == "passed"
    for world_size, ratio in ((3, "1.50"), (4, "2.00")):
        assert graded.outcome("communication[all_reduce]", world_size) == "failed"
        assert graded.message("communication[all_reduce]", world_size).startswith(
            f"the busiest rank (rank 0) moves {ratio}x the bound; at most 1.25x earns the points"
        )
    # The root sends n to each of p-1 ranks: within 2x of n up to p = 3.
    assert graded.outcome("communication[broadcast]", 3) == "passed"
    assert graded.outcome("communication[broadcast]", 4) == "failed"


def test_every_collective_deadlocking_is_named_at_once(grade):
    graded = grade("coll_deadlock_all", "collectives", world_sizes=(1, 2))
    for function in FUNCTIONS:
        assert graded.outcome(function, 2) == "timeout"
        assert graded.message(function, 2).startswith(
            "deadlock: rank 0 waits in recv from rank 1 at assignments/collectives.py:11 in "
            "_wait_forever while rank 1 waits in recv from rank 0"
        )
    # Seen by the broker as it happens: nothing was stopped by a timeout.
    assert not any("stopped after" in t["output"] for t in graded.tests)


def test_what_gloo_and_nccl_refuse_is_refused_here_with_the_fix(grade):
    """A non-contiguous tensor sent or received as it is, and an isend never waited: real
    backends raise or corrupt the buffer, so the broker refuses them and names the fix."""
    graded = grade("coll_backend_rules", "collectives", k="broadcast", world_sizes=(2,))
    assert graded.outcome("broadcast", 2) == "error"
    message = graded.message("broadcast", 2)
    assert "input tensor has to be contiguous" in message
    assert "t.contiguous()" in message and "assignments/collectives.py" in message
    assert "non-contiguous" in message  # the case that failed: the 3x5 view
    graded = grade("coll_backend_rules", "collectives", k="all_reduce", world_sizes=(2,))
    assert graded.outcome("all_reduce", 2) == "error"
    message = graded.message("all_reduce", 2)
    assert "the isend to rank 1 at assignments/collectives.py" in message
    assert "was never waited" in message and ".wait()" in message
