"""A determined student against the grader: every attack earns nothing and leaves nothing behind.

``submissions/attack_mix`` attacks differently in each function (skips and
interrupts, patched comparisons, the reference imported or read from disk,
collectives by back doors, side channels, the caller's frames and the old
public seed, a frozen clock and idle cost-size calls, a daemon that forges
results.json later, garbage on the broker's socket, a huge message of
escape sequences). The grader must give each 0, write a clean results.json,
and leave no process, file or shared-memory segment behind; an honest
submission graded afterwards scores what it scored before.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from runner import REPO, SUBMISSIONS, materialize, run_grader

from grader.protocol import MAX_TEXT

ATTACKED = ("broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather",
            "reduce_scatter", "all_to_all")  # fmt: skip


def _leftovers(scratch: Path, daemon: bool = False) -> set[str]:
    """What a grading could leave behind: a process or file of its own (every one of them
    has the grader's temporary directory, under ``scratch``, in its command line or path),
    the daemon of ``attack_mix`` (``daemon``: the grading ran it; another test's grading may
    be running it meanwhile, inside its sandbox), or a side channel's file on the host."""
    found = {f"file {p}" for p in scratch.rglob("*")}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if str(scratch).encode() in cmdline or (daemon and b"sleep 1007" in cmdline):
                found.add(f"process {entry}: {cmdline.decode(errors='replace')[:80]}")
    for directory in ("/tmp", "/dev/shm", "/var/tmp"):
        for name in os.listdir(directory):
            if name.startswith("side-channel") or name == "results.json":
                found.add(f"file {directory}/{name}")
    return found


def _grade(
    tmp_path: Path, submission: Path, *args: str, part: str = "collectives", timeout: float = 600
) -> dict:
    """Grade in ``tmp_path``; the grader's own temporary files go to ``tmp_path/tmp``."""
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    done = run_grader(
        ["--config", str(REPO / "tests/graded/grading.yaml"), "run", part,
         "--submission", str(submission), "--results", "results.json", *args],
        timeout=timeout,
        cwd=tmp_path,
        env={"TMPDIR": str(scratch)},
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    return json.loads((tmp_path / "results.json").read_text())


def test_every_attack_earns_nothing_and_leaves_nothing_behind(tmp_path: Path) -> None:
    results = _grade(tmp_path, SUBMISSIONS / "attack_mix", "--world-size", "2")
    assert results["score"] == 0
    by_target = {}
    for test in results["tests"]:
        by_target.setdefault(test["extra_data"]["target"].split(".")[1], []).append(test)
        assert test["score"] == 0 and test["status"] == "failed", test["name"]
        assert "\x1b" not in test["output"] and "\r" not in test["output"]
        assert len(test["output"]) <= MAX_TEXT
    assert set(by_target) == set(ATTACKED)
    outcome = {t: tests[0]["extra_data"]["outcome"] for t, tests in by_target.items()}
    assert outcome["broadcast"] == "error"  # a skip or an interrupt is no pass
    assert outcome["all_reduce"] == "forbidden"  # the reference was nowhere to be found
    assert "All tests passed!" in by_target["reduce_scatter"][0]["output"]  # shown, defused
    assert results["extra_data"]["sandbox"] == "namespaces"
    assert any("opens network sockets" in line for line in results["extra_data"]["review"])
    time.sleep(3)  # the daemon meant to forge results.json two seconds after its call
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "tmp"]
    assert _leftovers(tmp_path / "tmp", daemon=True) == set()


def test_a_module_that_skips_itself_at_import_is_not_passed(tmp_path: Path) -> None:
    results = _grade(tmp_path, SUBMISSIONS / "attack_import_skip", "--world-size", "2")
    assert results["score"] == 0
    for test in results["tests"]:
        assert test["extra_data"]["outcome"] == "error", test["name"]
    assert "Skipped: this module has nothing to grade" in results["tests"][0]["output"]


def test_a_rank_that_stops_reading_blocks_nothing_but_itself(tmp_path: Path) -> None:
    results = _grade(
        tmp_path, SUBMISSIONS / "attack_stops_reading", "-k", "broadcast", "--world-size", "2",
        timeout=240,
    )  # fmt: skip
    assert results["score"] == 0
    for test in results["tests"]:
        assert test["extra_data"]["outcome"] == "timeout", test["name"]
        assert "rank 1 stopped reading what the grader sends it" in test["output"]
        assert "rank 0 " not in test["output"].split("(case:")[0]
    assert _leftovers(tmp_path / "tmp") == set()


def test_links_and_fifos_in_a_submission_are_never_opened(tmp_path: Path) -> None:
    submission = tmp_path / "upload"
    submission.mkdir()
    (submission / "collectives.py").symlink_to(REPO / "reference" / "collectives.py")
    os.mkfifo(submission / "data_parallel.py")  # opening it for reading would block forever
    results = _grade(tmp_path, submission, "-k", "all_reduce", "--world-size", "2")
    assert results["score"] == 0
    for test in results["tests"]:
        assert test["extra_data"]["outcome"] == "not_run"
        assert test["output"] == "not submitted: the submission has no collectives.py"
    review = results["extra_data"]["review"]
    assert "left out of the submission: collectives.py: not a regular file" in review
    assert "left out of the submission: data_parallel.py: not a regular file" in review


def test_an_honest_submission_scores_the_same_after_the_attacks(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    selection = ("-k", "all_reduce", "--world-size", "3")
    before = _grade(first, REPO / "reference", *selection)
    _grade(tmp_path, SUBMISSIONS / "attack_mix", *selection)
    after = _grade(second, REPO / "reference", *selection)
    assert before["score"] == after["score"] == sum(t["max_score"] for t in before["tests"])


def test_what_the_trusted_side_checks_cannot_be_fooled(tmp_path: Path) -> None:
    """``submissions/attack_trust``: a side channel past the broker, frames that lie about what
    they carry, a result that would blow up when compared, a replay meant to give up, and
    floods of messages: each earns nothing, and the grader says why."""
    graded = _grade(tmp_path, materialize("attack_trust", tmp_path / "subs"), "--world-size", "2")
    tests = {t["extra_data"]["test"]: t for t in graded["tests"]}
    for name in ("all_reduce", "broadcast", "all_gather", "scatter", "gather"):
        for test in (name, f"communication[{name}]", f"performance[{name}]"):
            assert tests[test]["score"] == 0, (test, tests[test]["output"])
    side_channel = tests["all_reduce"]
    assert side_channel["extra_data"]["outcome"] in ("forbidden", "error"), side_channel
    assert (
        "a channel outside torch.distributed" in side_channel["output"]
        or "Operation not permitted" in side_channel["output"]  # the sandbox refused the lock
        # or the allow-list the file: no rank may open it (Landlock, where the kernel has it)
        or "Permission denied: '/etc/debian_version'" in side_channel["output"]
    )
    assert "declares float32[0] but carries" in tests["broadcast"]["output"]
    assert "views only 1 elements of storage" in tests["all_gather"]["output"]
    assert "MiB of its messages waiting in the grader" in tests["scatter"]["output"]
    assert "more than 20000 operations" in tests["gather"]["output"]
    # The replay reaches the end of the log: the token messages cost time, never hide it.
    replayed = tests["performance[reduce_scatter]"]["extra_data"]
    assert replayed["outcome"] == "passed"
    assert replayed["time_ratio"] >= 1.0  # its tokens on top of the reference's own ring
    assert graded["tests"] and _leftovers(tmp_path / "tmp") == set()


# The attacks on the strategy parts' verdicts (each with its own test of the words, in the
# part's verdict tests): the part, and the tests it attacks, which it must not earn.
STRATEGY_ATTACKS = {
    "dp_decoy_overlap": ("data_parallel", "overlap"),
    "zero_hidden_unsharded": ("data_parallel", "sharded_optimizer_state"),
    "zero_decoy_broadcasts": ("data_parallel", "sharded_optimizer_state"),
    "zero_keeps_all_state": ("data_parallel", "sharded_optimizer_state"),
    "tp_mlp_decoy": ("tensor_parallel", "parallel_mlp_communication"),
    "tp_early_gate": ("tensor_parallel", "parallel_mlp_communication"),
    "pp_forged_timeline": ("pipeline_parallel", "one_f_one_b_schedule"),
    "pp_asked_early": ("pipeline_parallel", "schedule"),
    "fsdp_decoy_gathers": ("fully_sharded", "communication"),
    "fsdp_forged_marks": ("fully_sharded", "communication"),
    "fsdp_keeps_in_a_list": ("fully_sharded", "memory_at_rest"),
    "fsdp_deferred_reduce_scatter": ("fully_sharded", "communication"),
    "ep_decoy_combine": ("expert_parallel", "communication"),
}


@pytest.mark.parametrize("attack", sorted(STRATEGY_ATTACKS))
def test_strategy_attacks_earn_nothing_and_leave_nothing_behind(
    tmp_path: Path, attack: str
) -> None:
    part, attacked = STRATEGY_ATTACKS[attack]
    submission = materialize(attack, tmp_path / "subs")
    results = _grade(tmp_path, submission, "-k", attacked, "--world-size", "2", part=part)
    assert results["tests"], results
    for test in results["tests"]:
        assert test["score"] == 0, (test["name"], test["output"])
    assert _leftovers(tmp_path / "tmp") == set()
