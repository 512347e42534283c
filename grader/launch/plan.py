"""A job's plan: how its ranks are sandboxed, written by the grader into the job's folder
(``sandbox.json``, the grader's alone) and read by the trusted processes that start the
ranks, each rank's wrapper (:mod:`grader.launch.sandboxed`) and, at ``uid``, the job's
zygote (:mod:`grader.launch.zygote`); with where a rank's log and exit status lie.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from grader.device import ENV_VAR as DEVICE_ENV
from grader.device import Device, parse
from grader.sandbox import DEFAULT_SCRATCH, NOBODY, Level, Sandbox, landlock
from grader.sandbox import ENV_VAR as SANDBOX_ENV

JOB_ENV = "GRADER_JOB"  # the job's folder, in the environment of what torchrun starts


@dataclass(frozen=True)
class SandboxPlan:
    """How the ranks of one job are sandboxed; written by the grader into the job directory."""

    level: Level
    socket_dir: str
    import_dir: str
    hidden: list[str]
    readable: list[str]
    pythonpath: str
    memory_bytes: int
    allow: list[str]  # the Landlock allow-list, as Rule.to_text; empty: none
    scratch_bytes: int = DEFAULT_SCRATCH
    # As root, local rank r runs as first_uid + r (grader.sandbox.identity); otherwise every rank is
    # nobody in a user namespace of its own.
    first_uid: int | None = None
    device: Device = Device.CPU
    # At uid, on this machine: the socket of the job's zygote, which forks the ranks.
    zygote: str = ""
    # A job across nodes: every rank relays to the head's broker at this address.
    broker: str = ""
    job: str = ""
    key: str = ""  # hex; the file is the grader's alone (0600)

    def write(self, job_dir: Path) -> None:
        descriptor = os.open(job_dir / "sandbox.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as plan:
            plan.write(self.to_json())

    def to_json(self) -> str:
        return json.dumps(asdict(self))  # the enums as their values

    @classmethod
    def read(cls, job_dir: Path) -> SandboxPlan:
        return cls.from_json((job_dir / "sandbox.json").read_text(), f"{job_dir}/sandbox.json")

    @classmethod
    def from_json(cls, text: str, where: str = "the job's plan") -> SandboxPlan:
        fields = json.loads(text)
        level = Level(fields.pop("level"))
        return cls(level=level, device=parse(fields.pop("device"), where), **fields)


def exit_path(job_dir: Path, rank: int) -> Path:
    return job_dir / f"rank{rank}.exit"


def log_path(job_dir: Path, rank: int) -> Path:
    return job_dir / f"rank{rank}.log"


#: glibc's allocator, told to keep what a rank frees and hand it out again: by default it
#: maps each large buffer (a message's 4 MB) afresh and returns it when freed, so that a
#: call pays a page fault for every 4 KB of it, or not, by the allocator's own history. A
#: rank's CPU time, which the performance tests charge, is then the rank's work alone.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def rank_sandbox(
    plan: SandboxPlan,
    job_dir: Path,
    rank: int,
    world_size: int,
    local_rank: int,
    connection: socket.socket | None = None,
) -> Sandbox:
    """Rank ``rank``'s sandbox in the job so planned."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "PYTHONPATH": plan.pythonpath,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        DEVICE_ENV: plan.device.value,
        SANDBOX_ENV: plan.level.value,  # how the rank words a refused system call
        **STEADY_MALLOC,
    }
    uid = NOBODY if plan.first_uid is None else plan.first_uid + local_rank
    return Sandbox(
        plan.level,
        job_dir / "scratch" / f"rank{rank}",
        hidden=tuple(map(Path, plan.hidden)),
        readable=tuple(map(Path, plan.readable)),
        connection=None if connection is None else connection.fileno(),
        allow=tuple(map(landlock.Rule.from_text, plan.allow)),
        env=env,
        memory_bytes=plan.memory_bytes,
        scratch_bytes=plan.scratch_bytes,
        max_file_bytes=plan.scratch_bytes,
        uid=uid,
        gid=uid if plan.first_uid is None else plan.first_uid,
    )
