"""One torchrun job: started in its own session, so that it can be ended whole.

Killing torchrun alone leaves its workers running (pytest-timeout issue #159),
and torchrun starts each worker in a session of its own, so that even its
process group does not hold them. A job is therefore ended by SIGKILL to every
process descended from torchrun, found through /proc *before* torchrun dies,
and then to torchrun's own group; whatever escapes, orphaned, is ended by the
grader that adopted it (:mod:`grader.launch.orphans`). Nothing is lost: every
result is on disk already.

The job's folder (the sandbox plan its rank wrappers read, and a short
folder for the ranks' sockets) is made here too: :func:`prepare_job`, and
:func:`node_job` for one node's share of a job across nodes. :func:`launch` starts a
job of this machine's ranks with every rank's socket listening, before any broker is
up: none of it imports torch, so that the grader starts its first job before its own
import of torch, and the two imports share the CPUs.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from grader.course.config import RankLimits
from grader.course.secret import SECRET_ENV
from grader.device import Device
from grader.launch import orphans, tmpdir, zygote
from grader.launch.plan import JOB_ENV, SandboxPlan
from grader.protocol import rank_socket
from grader.sandbox import DEFAULT_SCRATCH, Level, view, walled
from grader.sandbox.landlock import Rule

if TYPE_CHECKING:
    from grader.nodes import Nodes
    from grader.nodes.head import Head
    from grader.sandbox.identity import Identity


RANK_WRAPPER = "grader.launch.sandboxed"  # what torchrun starts on every rank of a graded job


@dataclass(frozen=True)
class JobSettings:
    """What every job of one grading run shares."""

    work_dir: Path
    import_dir: Path
    level: Level
    hidden: tuple[Path, ...]
    readable: tuple[Path, ...]
    pythonpath: str
    memory_bytes: int
    allow: tuple[Rule, ...] = ()  # the ranks' Landlock allow-list (grader.sandbox.view.allowed)
    device: Device = Device.CPU
    head: Head | None = None  # a job across nodes: this grader is node 0 (grader.nodes)
    scratch_bytes: int = DEFAULT_SCRATCH
    identity: Identity | None = None  # as root: the run's own uids, a uid per local rank


def job_settings(
    work: Path,
    level: Level,
    device: Device,
    head: Head | None = None,
    limits: RankLimits | None = None,
    identity: Identity | None = None,
) -> JobSettings:
    """What every job of a run shares; made the same way on every node of a run."""
    import_dir = work / "import"
    lib = view.rank_side(work)
    limits = limits or RankLimits()
    readable = (lib, import_dir)
    return JobSettings(
        work_dir=work,
        import_dir=import_dir,
        level=level,
        hidden=tuple(p for p in view.hidden(work) if p.exists()),
        readable=(*readable, *view.interpreter()),
        pythonpath=str(lib),
        memory_bytes=limits.memory_bytes,
        allow=tuple(view.allowed(list(readable), device)) if walled(level) else (),
        device=device,
        head=head,
        scratch_bytes=limits.scratch_bytes,
        identity=identity if level is not Level.NONE else None,
    )


@dataclass(frozen=True)
class Rendezvous:
    """torchrun's c10d rendezvous of one job across ``nodes`` nodes, in the head's store."""

    nodes: int
    endpoint: str
    id: str

    def arguments(self) -> list[str]:
        return [
            f"--nnodes={self.nodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.id}",
            "--rdzv-conf=is_host=0",  # the head's grader hosts the store, for the whole run
        ]


class TorchrunJob:
    """``per_node`` ranks on this machine: the whole job, or this node's share of it."""

    def __init__(
        self,
        job_dir: Path,
        per_node: int,
        module: str,
        rendezvous: Rendezvous | None = None,
        identity: Identity | None = None,
    ) -> None:
        self.job_dir = job_dir
        self.per_node = per_node
        self.module = module
        self.rendezvous = rendezvous
        self.identity = identity  # its uids' processes are ended with the job
        self._process: subprocess.Popen[bytes] | None = None
        # The ranks' pids as they report them: ended too, even if torchrun is gone already.
        self.worker_pids: set[int] = set()
        self.zygote: subprocess.Popen[bytes] | None = None  # at uid: what forks the ranks

    def start(self) -> None:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            # --standalone: a free port of its own, so that graders can run side by side
            *(self.rendezvous.arguments() if self.rendezvous else ["--standalone"]),
            f"--nproc-per-node={self.per_node}",
            "--max-restarts=0",
            "-m",
            self.module,
        ]
        # The job's folder in the environment, not on a command line (which every user reads);
        # the course's secret in neither.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env.update({JOB_ENV: str(self.job_dir), "PET_LOG_DIR": str(self.job_dir / "torchrun")})
        for name in ("TORCH_DISTRIBUTED_DEBUG", SECRET_ENV):
            env.pop(name, None)
        # the grader killed: torchrun and its ranks go too
        self._process = orphans.start_trusted(command, self.job_dir / "torchrun.log", env=env)

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def wait(self) -> int:
        """Until torchrun exits (after :meth:`start`); its exit status."""
        assert self._process is not None, "the job was not started"
        return self._process.wait()

    def kill(self) -> None:
        """End torchrun, the zygote and every process they started; idempotent."""
        if self.zygote is not None:  # its ranks die with it
            self.zygote.kill()
            self.zygote.wait()
        if self._process is None:
            return
        workers = {pid for pid in self.worker_pids if _is_worker(pid)}  # not a reused pid
        if self._process.poll() is None:  # torchrun's pid is still its own, even as a zombie
            workers |= set(descendants(self._process.pid))
            _signal_group(self._process.pid, signal.SIGKILL)
        # else torchrun was reaped (it exited, or an earlier kill): its pid may be another
        # process's by now, and its orphans are no longer its descendants
        for pid in workers:
            _signal(pid, signal.SIGKILL)
        self._process.wait()
        if self.identity is not None:  # a daemon that escaped the process tree
            self.identity.end_jobs()
        orphans.end()  # a rank's bwrap killed as it started left its child (this job's, or
        # an earlier one's that was not handed over yet)

    def log_tail(self, lines: int = 5) -> str:
        return log_tail(self.job_dir, lines)

    def __enter__(self) -> TorchrunJob:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()


def log_tail(job_dir: Path, lines: int = 5) -> str:
    """The last lines torchrun printed for the job in ``job_dir``, without its usual banner."""
    try:
        text = (job_dir / "torchrun.log").read_text(errors="replace")
    except OSError:
        return ""
    useful = [line for line in text.splitlines() if line.strip() and "OMP_NUM_THREADS" not in line]
    return "\n".join(useful[-lines:])


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` in the process tree (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for pid, parent, _ in orphans.processes():
        children.setdefault(parent, []).append(pid)
    found, frontier = [], [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return found


def _is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"grader." in cmdline.read()
    except OSError:
        return False


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by torchrun, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def node_job(
    settings: JobSettings,
    job_dir: Path,
    nodes: Nodes,
    job_id: str,
    per_node: int,
    broker: str,
    key: bytes,
) -> tuple[TorchrunJob, Path]:
    """This node's share of a job across nodes (not started), and its sockets' folder: its
    ranks relay to the broker at ``broker`` (host:port), proving themselves with ``key``."""
    relay = {"broker": broker, "job": job_id, "key": key.hex()}
    socket_dir = prepare_job(settings, job_dir, relay)
    rendezvous = Rendezvous(nodes.count, nodes.endpoint, job_id)
    job = TorchrunJob(job_dir, per_node, RANK_WRAPPER, rendezvous, settings.identity)
    return job, socket_dir


#: Jobs are numbered per process: several jobs of one run (watch mode's gradings, each on
#: a fresh job; the reference's) share the run's work folder.
_JOB_NUMBERS = itertools.count(1)


@dataclass
class Launched:
    """A job of this machine's ranks, started, with rank r's socket listening at
    ``listeners[r]``: a rank that connects before the broker accepts waits in the backlog."""

    job: TorchrunJob
    job_dir: Path
    socket_dir: Path
    listeners: list[socket.socket] = field(default_factory=list)

    def end(self) -> None:
        """Kill the job and remove its sockets: a job no pool holds."""
        self.job.kill()
        for listener in self.listeners:
            listener.close()
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def job_folder(settings: JobSettings) -> Path:
    """Where the run's next job keeps its files (not made yet)."""
    return settings.work_dir / f"job{next(_JOB_NUMBERS)}"


def launch(settings: JobSettings, size: int) -> Launched:
    """Start a job of ``size`` ranks on this machine, each rank's socket bound and listening."""
    job_dir = job_folder(settings)
    job = TorchrunJob(job_dir, size, RANK_WRAPPER, identity=settings.identity)
    socket_dir, listeners = None, []
    try:
        socket_dir = prepare_job(settings, job_dir, {})
        listeners = listen(socket_dir, size)
        plan = SandboxPlan.read(job_dir)
        if plan.zygote:  # first: its torch and torchrun's import at once
            job.zygote = zygote.start(plan, job_dir, size)
        job.start()
        return Launched(job, job_dir, socket_dir, listeners)
    except BaseException:  # an interrupt before the caller holds the job: end what began
        job.kill()
        for listener in listeners:
            listener.close()
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)
        raise


def listen(socket_dir: Path, size: int) -> list[socket.socket]:
    """Every rank's Unix socket in ``socket_dir``, bound and listening for its one connection."""
    listeners: list[socket.socket] = []
    try:
        for rank in range(size):
            listeners.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            # Each frame then says which process wrote it: the broker meters the rank that
            # speaks, though its wrapper made the connection (accounting.sender_pid).
            listeners[-1].setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            listeners[-1].bind(str(rank_socket(socket_dir, rank)))
            listeners[-1].listen(1)
    except BaseException:
        for listener in listeners:
            listener.close()
        raise
    return listeners


def prepare_job(settings: JobSettings, job_dir: Path, relay: dict[str, str]) -> Path:
    """The job's folder, with the sandbox plan its wrappers read; returns its sockets' folder.

    ``relay``: for a job across nodes, where and how the wrappers reach the broker.
    """
    job_dir.mkdir(parents=True)
    socket_dir = tmpdir.socket_folder()
    try:
        _write_plan(settings, job_dir, socket_dir, relay)
    except BaseException:  # an interrupt before the caller holds the folder
        shutil.rmtree(socket_dir, ignore_errors=True)
        raise
    return socket_dir


def _write_plan(
    settings: JobSettings, job_dir: Path, socket_dir: Path, relay: dict[str, str]
) -> None:
    socket_dir.chmod(0o700)  # the wrappers connect the ranks: no rank reaches a socket
    job_dir.chmod(0o711)  # a rank's uid passes through to its scratch, and reads nothing here
    (job_dir / "scratch").mkdir(mode=0o711)
    plan = SandboxPlan(
        level=settings.level,
        socket_dir=str(socket_dir),
        import_dir=str(settings.import_dir),
        hidden=[str(p) for p in settings.hidden],
        readable=[str(p) for p in settings.readable],
        pythonpath=settings.pythonpath,
        memory_bytes=settings.memory_bytes,
        allow=[rule.to_text() for rule in settings.allow],
        scratch_bytes=settings.scratch_bytes,
        first_uid=settings.identity.first if settings.identity else None,
        device=settings.device,
        **relay,
    )
    if zygote.wanted(plan):
        plan = replace(plan, zygote=str(socket_dir / zygote.SOCKET_NAME))
    plan.write(job_dir)
