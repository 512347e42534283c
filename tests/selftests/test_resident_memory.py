"""Memory promises judged by the kernel's count of a rank's process (grader.testkit.resident).

The broker reads a rank's resident memory at the gates of a larger model's training; the
honest reference keeps its memory points, a copy kept anywhere loses them, and a reading
that cannot be made, or memory freed to hide a copy, is never granted.
"""

from __future__ import annotations

import json
import os

from runner import Graded, materialize, run_grader

from grader.broker import memory
from grader.broker.traffic import GatePass
from grader.testkit import resident

MiB = 1 << 20


def test_the_broker_reads_a_process_by_its_pid_and_nothing_else() -> None:
    assert (memory.resident(os.getpid(), 0) or 0) > 10 * MiB
    assert memory.resident(None, 0) is None
    assert memory.resident(2**22 + 7, 0) is None  # above pid_max: no such process


def readings(**above: int) -> list[GatePass]:
    """A rank's measured gates, ``above`` its start reading (in MiB), 200 MiB at the start."""
    start = 200 * MiB
    out = [GatePass("start", True, 0, start)]
    return out + [GatePass(k.replace("_", " "), True, 0, start + v * MiB) for k, v in above.items()]


def honest_fsdp(p: int) -> dict[str, int]:
    shard = 32 // p
    out = {"built": 32, "wrapped": shard, "end": 1}
    for step in (1, 2):
        out.update({f"step_{step}_forward": shard + 1, f"step_{step}_rest": shard})
        out[f"step_{step}_synchronized"] = 2 * shard
    return out


def test_the_honest_figures_pass_and_a_kept_copy_fails() -> None:
    promise = resident.fsdp(2, "bfloat16")
    assert resident.broken(readings(**honest_fsdp(2)), promise) is None
    kept = {**honest_fsdp(2), "step_2_rest": 16 + 16}  # a bfloat16 copy, kept after step 2
    problem = resident.broken(readings(**kept), promise)
    assert problem is not None and "after step 2's zero_grad()" in problem
    assert "16.0 MiB too many" in problem


def test_a_reading_missing_or_off_fails_closed() -> None:
    promise = resident.fsdp(2, "float32")
    figures = honest_fsdp(2)
    del figures["step_1_forward"]
    assert "could not read this rank's memory" in str(resident.broken(readings(**figures), promise))
    unseen = {**honest_fsdp(2), "built": 0}  # the model's 32 MiB not seen: not measurable
    assert "could not be measured reliably" in str(resident.broken(readings(**unseen), promise))
    unread = [*readings(**honest_fsdp(2))[:-1], GatePass("end", True, 0, None)]
    assert "could not read" in str(resident.broken(unread, promise))


def test_memory_freed_below_the_start_to_hide_a_copy_fails() -> None:
    """Ballast held from before the start, freed while a full copy is kept: every reading
    looks honest but the last, below where the rank began."""
    ballast = {**honest_fsdp(2), "end": -32}
    problem = resident.broken(readings(**ballast), resident.fsdp(2, "float32"))
    assert problem is not None and "as if to hide" in problem


def test_the_whole_adamw_state_kept_fails_the_state_test(grade) -> None:
    graded = grade("zero_keeps_all_state", "data_parallel", k="state", world_sizes=(2,))
    message = graded.message("sharded_optimizer_state", 2)
    assert graded.outcome("sharded_optimizer_state", 2) == "failed", message
    assert "after step 1's optimizer step" in message, message
    assert "AdamW's state for every parameter weighs 64 MiB" in message, message
    honest = grade("reference", "data_parallel", k="state", world_sizes=(2,))
    assert honest.outcome("sharded_optimizer_state", 2) == "passed"


def test_the_kernel_is_read_without_a_sandbox_too(tmp_path) -> None:
    """At level none the ranks share the grader's pid namespace and uid: the broker's reading
    is made there too (a reading it could not make would fail the test as well, so the
    message must show the figure read)."""
    submission = materialize("zero_keeps_all_state", tmp_path)
    out = tmp_path / "results.json"
    args = ["run", "data_parallel", "-k", "state", "--world-size", "2", "--sandbox", "none"]
    run_grader([*args, "--submission", str(submission), "--results", str(out)])
    graded = Graded(0, "", "", json.loads(out.read_text()))
    message = graded.message("sharded_optimizer_state", 2)
    assert "after step 1's optimizer step, the kernel counted 128.0 MiB" in message, message
