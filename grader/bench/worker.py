"""The program torchrun starts on every rank for ``grader bench``.

For each collective and message size it times the student's function, the
reference's and torch.distributed's own, side by side in this one job, and
logs one call's messages for the alpha-beta projections. Rank 0 writes one
JSON record per measurement; an implementation that fails or hangs is
dropped for the rest of that collective, and the sweep goes on.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from grader.bench import p2p, records
from grader.bench.accounting import recording
from grader.bench.calls import TORCH_COLLECTIVES, collective_call
from grader.bench.timing import time_call
from grader.course.config import REPO_ROOT
from grader.judge.projection import machines, project
from grader.launch.plan import JOB_ENV


def enter_rank(job_dir: Path, rank: int, import_dir: Path) -> records.ReportWriter:
    """The rank's output to its log file, the staged submission and the reference on the
    import path, the message log installed before any student code is imported."""
    log = os.open(records.log_path(job_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.path[:0] = [str(import_dir), str(REPO_ROOT)]
    p2p.install()
    return records.ReportWriter(records.report_path(job_dir, rank))


def main(job_dir: Path) -> int:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    plan = json.loads((job_dir / "bench.json").read_text())
    report = enter_rank(job_dir, rank, Path(plan["import_dir"]))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=plan["op_timeout"]))
    report.write("ready", rank=rank, pid=os.getpid())

    implementations: dict[str, Any] = {}
    # A student release has no reference: the sweep then compares yours with torch's.
    with contextlib.suppress(ImportError):
        implementations["reference"] = importlib.import_module("reference.collectives")
    try:
        implementations["student"] = importlib.import_module("assignments.collectives")
    except BaseException as err:
        report.write("student_error", message=f"{type(err).__name__}: {err}")
    implementations["torch"] = TORCH_COLLECTIVES

    for function in plan["functions"]:
        failed: set[str] = set()
        for size in plan["sizes"]:
            n = max(world_size, size // 4 // world_size * world_size)
            for name, module in implementations.items():
                if name in failed:
                    continue
                try:
                    record = _measure(
                        module, name, function, rank, world_size, n, plan["iterations"]
                    )
                except Exception as err:
                    failed.add(name)
                    record = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
                if rank == 0:
                    report.write("measured", function=function, bytes=n * 4, impl=name, **record)
    report.write("finished")
    return 0


def _measure(
    module: Any, name: str, function: str, rank: int, world_size: int, n: int, iterations: int
) -> dict[str, Any]:
    call = collective_call(module, function, rank, world_size, n)
    call()  # warm-up
    times = []
    for _ in range(iterations):
        dist.barrier()
        times.append(time_call(call, torch.device("cpu")))
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # an iteration lasts as long as its slowest rank
    record: dict[str, Any] = {"seconds": statistics.median(slowest.tolist())}
    if name != "torch":  # torch's own collectives send no messages we can see
        dist.barrier()
        with recording() as log:
            call()
        messages = [None] * world_size if rank == 0 else None
        dist.gather_object(log.messages(), messages, dst=0)
        if rank == 0:
            record["projected"] = {m.name: project(messages, m) for m in machines()}
    return record


if __name__ == "__main__":
    code = main(Path(os.environ[JOB_ENV]))
    sys.stdout.flush()
    os._exit(code)
