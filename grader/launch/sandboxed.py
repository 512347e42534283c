"""What torchrun starts on every rank: ``python -m grader.launch.sandboxed``, the job's folder
in ``$GRADER_JOB`` (an environment is its process's own; a command line is every user's).

This wrapper is the grader's, and runs outside the sandbox. It reads the
job's sandbox plan (which the ranks cannot see), connects the rank to the broker (or, across
nodes, to itself as the relay), starts the rank inside its sandbox with that connection
and its output going to the rank's log, waits for it, and leaves its exit status where the
grader reads it. It dies with torchrun (``PR_SET_PDEATHSIG``) and the sandbox dies with
it, so no process of the student's outlives the job, even when the grader itself is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from grader.device import ENV_VAR as DEVICE_ENV
from grader.device import Device, parse
from grader.protocol import RankExit, clean, rank_socket
from grader.sandbox import DEFAULT_SCRATCH, NOBODY, Level, Sandbox, die_with, landlock
from grader.sandbox import ENV_VAR as SANDBOX_ENV

JOB_ENV = "GRADER_JOB"
RANK_ENTRY = "grader.rank"  # the rank's process: python -m grader.rank (grader/rank/__main__.py)


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
    # A job across nodes: every rank relays to the head's broker at this address.
    broker: str = ""
    job: str = ""
    key: str = ""  # hex; the file is the grader's alone (0600)

    def write(self, job_dir: Path) -> None:
        descriptor = os.open(job_dir / "sandbox.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as plan:
            plan.write(json.dumps(asdict(self)))  # the enums as their values

    @classmethod
    def read(cls, job_dir: Path) -> SandboxPlan:
        fields = json.loads((job_dir / "sandbox.json").read_text())
        level, where = Level(fields.pop("level")), f"{job_dir}/sandbox.json"
        return cls(level=level, device=parse(fields.pop("device"), where), **fields)


def exit_path(job_dir: Path, rank: int) -> Path:
    return job_dir / f"rank{rank}.exit"


def log_path(job_dir: Path, rank: int) -> Path:
    return job_dir / f"rank{rank}.log"


def rank_exit(job_dir: Path, rank: int) -> RankExit | None:
    """How rank ``rank`` of the job in ``job_dir`` ended, if it did (on this machine)."""
    try:
        status = int(exit_path(job_dir, rank).read_text().strip())
    except (OSError, ValueError):
        return None
    return RankExit(status, last_words(job_dir, rank))


def last_words(job_dir: Path, rank: int, limit: int = 300) -> str:
    """The end of what a rank printed (often why it died), cleaned and capped."""
    try:
        with open(log_path(job_dir, rank), "rb") as log:
            log.seek(0, 2)
            log.seek(max(0, log.tell() - 4096))
            text = log.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return clean(" | ".join(lines[-2:]), limit)


#: glibc's allocator, told to keep what a rank frees and hand it out again: by default it
#: maps each large buffer (a message's 4 MB) afresh and returns it when freed, so that a
#: call pays a page fault for every 4 KB of it, or not, by the allocator's own history. A
#: rank's CPU time, which the performance tests charge, is then the rank's work alone.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def main(job_dir: Path, probe: bool = False) -> int:
    parent = os.getppid()  # torchrun's agent (the grader itself, for a probe)
    if not probe and not _is_torchrun(parent):
        return 137  # orphaned before it could watch torchrun: start nothing, as if killed
    die_with(parent)
    plan = SandboxPlan.read(job_dir)
    rank = int(os.environ["RANK"])
    ours, theirs = (None, None) if probe else _connect(plan, rank)
    sandbox = _sandbox(plan, job_dir, rank, theirs)
    sandbox.prepare()
    argv = [sys.executable, "-m", RANK_ENTRY]
    argv += ["--probe"] if theirs is None else [str(theirs.fileno()), plan.import_dir]
    descriptor = os.open(log_path(job_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(descriptor, "wb") as log:
        child = sandbox.popen(argv, log)
    if theirs is not None:
        theirs.close()  # the rank's end is the rank's alone

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGKILL)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    if ours is None:
        code = child.wait()
    else:
        from grader.nodes.relay import Relay  # across nodes only: it imports torch

        relay = Relay(ours, child, plan.broker, bytes.fromhex(plan.key))
        code = relay.run(plan.job, rank, lambda: last_words(job_dir, rank))
    exit_path(job_dir, rank).write_text(str(code))
    return code if code >= 0 else 128 - code


def _connect(plan: SandboxPlan, rank: int) -> tuple[socket.socket | None, socket.socket]:
    """The relay's end (across nodes) and the rank's end of the rank's one connection: to
    this machine's broker, whose socket the ranks cannot reach, or to this wrapper."""
    if plan.broker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return ours, theirs
    theirs = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.connect(str(rank_socket(Path(plan.socket_dir), rank)))
    return None, theirs


def _sandbox(
    plan: SandboxPlan, job_dir: Path, rank: int, connection: socket.socket | None
) -> Sandbox:
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": os.environ["WORLD_SIZE"],
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


def _is_torchrun(pid: int) -> bool:
    """Whether ``pid`` is a torchrun agent. A wrapper whose torchrun died before its first
    line ran was handed to another parent (init, or a subreaper such as systemd's user
    manager), which would never die with the job; where there is no /proc to tell, it is."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True
    return b"torch.distributed.run" in command or any(
        part.endswith(b"torchrun") for part in command[:2]
    )


if __name__ == "__main__":
    sys.exit(main(Path(os.environ[JOB_ENV]), probe="--probe" in sys.argv[1:]))
