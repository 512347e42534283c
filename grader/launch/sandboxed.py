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
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import BinaryIO

from grader.launch.plan import JOB_ENV, SandboxPlan, exit_path, log_path, rank_sandbox
from grader.launch.zygote import Forked
from grader.protocol import RankExit, clean, rank_socket
from grader.sandbox import Sandbox, die_with

RANK_ENTRY = "grader.rank"  # the rank's process: python -m grader.rank (grader/rank/__main__.py)


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


def main(job_dir: Path, probe: bool = False) -> int:
    parent = os.getppid()  # torchrun's agent (the grader itself, for a probe)
    if not probe and not _is_torchrun(parent):
        return 137  # orphaned before it could watch torchrun: start nothing, as if killed
    die_with(parent)
    plan = SandboxPlan.read(job_dir)
    rank = int(os.environ["RANK"])
    ours, theirs = (None, None) if probe else _connect(plan, rank)
    world_size, local_rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))
    sandbox = rank_sandbox(plan, job_dir, rank, world_size, local_rank, theirs)
    sandbox.prepare()
    descriptor = os.open(log_path(job_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(descriptor, "wb") as log:
        asked = {"rank": rank, "world_size": world_size, "local_rank": local_rank}
        child = _start(plan, sandbox, asked, theirs, log)
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


def _start(
    plan: SandboxPlan,
    sandbox: Sandbox,
    asked: dict[str, int],
    connection: socket.socket | None,
    log: BinaryIO,
) -> subprocess.Popen[bytes] | Forked:
    """The rank, started: forked by its job's zygote where the plan names one (``asked``:
    which rank), else run in its sandbox (a probe without ``connection``)."""
    if plan.zygote and connection is not None:
        return Forked(Path(plan.zygote), asked, connection.fileno(), log.fileno())
    argv = [sys.executable, "-m", RANK_ENTRY]
    argv += ["--probe"] if connection is None else [str(connection.fileno()), plan.import_dir]
    return sandbox.popen(argv, log)


def _connect(plan: SandboxPlan, rank: int) -> tuple[socket.socket | None, socket.socket]:
    """The relay's end (across nodes) and the rank's end of the rank's one connection: to
    this machine's broker, whose socket the ranks cannot reach, or to this wrapper."""
    if plan.broker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return ours, theirs
    theirs = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.connect(str(rank_socket(Path(plan.socket_dir), rank)))
    return None, theirs


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
