"""The program torchrun starts on every rank: ``python -m grader.rank.worker JOB_DIR``.

It reads the plan, puts the submission on the import path, installs the
guards (before any student code is imported, so that nothing escapes them),
and runs the planned graded tests with pytest and the :class:`RankHarness`.
Its stdout and stderr go to the rank's log file: a student's prints must not
garble the grader's terminal.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from grader import protocol
from grader.config import GRADED_DIR, GRADED_PYTEST_ARGS, REPO_ROOT
from grader.rank import forbid, frames, p2p
from grader.rank.harness import RankHarness


def enter_rank(job_dir: Path, rank: int, import_dir: Path) -> protocol.ReportWriter:
    """What every rank of every job does first: its output to its log file, the staged
    submission and the reference on the import path, the p2p watch installed before any
    student code is imported. Returns the rank's report."""
    log = os.open(protocol.log_path(job_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.path[:0] = [str(import_dir), str(REPO_ROOT)]
    frames.configure(import_dir)
    p2p.install(protocol.waiting_path(job_dir, rank))
    return protocol.ReportWriter(protocol.report_path(job_dir, rank))


def main(job_dir: Path) -> int:
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    plan = protocol.Plan.read(job_dir)
    report = enter_rank(job_dir, rank, Path(plan.import_dir))
    stacks = open(protocol.stacks_path(job_dir, rank), "w")  # noqa: SIM115 - lives as long as the rank
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    forbid.install()

    device = torch.device("cpu")
    if plan.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    store, _, _ = next(dist.rendezvous("env://"))
    report.write("ready", rank=rank, pid=os.getpid())

    harness = RankHarness(
        plan.tests, store, rank, world_size, plan.backend, device, report, plan.attempt, job_dir
    )
    nodeids = list(dict.fromkeys(str(GRADED_DIR / t.nodeid) for t in plan.tests))
    pytest.main([*nodeids, *GRADED_PYTEST_ARGS, "-p", "no:timeout", "-q"], plugins=[harness])
    report.write("finished")
    return 0


if __name__ == "__main__":
    code = main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a process group broken by a student can abort it,
    # and every result is already on disk.
    os._exit(code)
