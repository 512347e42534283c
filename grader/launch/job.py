"""One torchrun job: started in its own session, so that it can be ended whole.

Killing torchrun alone leaves its workers running (pytest-timeout issue #159),
and torchrun starts each worker in a session of its own, so that even its
process group does not hold them. A job is therefore ended by SIGKILL to every
process descended from torchrun, found through /proc *before* torchrun dies
(afterwards its orphans belong to init), and then to torchrun's own group.
Nothing is lost: every result is on disk already.

The job's folder (the sandbox plan its rank wrappers read, and a short
folder for the ranks' sockets) is made here too: :func:`prepare_job`, and
:func:`node_job` for one node's share of a job across nodes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from grader.course.config import RankLimits
from grader.launch import tmpdir
from grader.launch.sandboxed import SandboxPlan, last_words
from grader.protocol import rank_socket
from grader.sandbox import DEFAULT_SCRATCH, Level, die_with, view

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
    sandbox: str  # a grader.sandbox.Level value
    hidden: tuple[Path, ...]
    readable: tuple[Path, ...]
    pythonpath: str
    memory_bytes: int
    device: str = "cpu"
    head: Head | None = None  # a job across nodes: this grader is node 0 (grader.nodes)
    scratch_bytes: int = DEFAULT_SCRATCH
    identity: Identity | None = None  # as root: the run's own uids, a uid per local rank


def job_settings(
    work: Path,
    level: Level,
    device: str,
    head: Head | None = None,
    limits: RankLimits | None = None,
    identity: Identity | None = None,
) -> JobSettings:
    """What every job of a run shares; made the same way on every node of a run."""
    import_dir = work / "import"
    package = Path(__file__).resolve().parents[1]  # grader/
    limits = limits or RankLimits()
    return JobSettings(
        work_dir=work,
        import_dir=import_dir,
        sandbox=level.value,
        hidden=tuple(p for p in view.hidden(work) if p.exists()),
        readable=(package, import_dir, *view.interpreter()),
        pythonpath=str(package.parent),
        memory_bytes=limits.memory_bytes,
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

    def start(self) -> None:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            # --standalone: a free port of its own, so that graders can run side by side
            *(self.rendezvous.arguments() if self.rendezvous else ["--standalone"]),
            f"--nproc-per-node={self.per_node}",
            "--max-restarts=0",
            f"--log-dir={self.job_dir / 'torchrun'}",
            "-m",
            self.module,
            str(self.job_dir),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("TORCH_DISTRIBUTED_DEBUG", None)
        with open(self.job_dir / "torchrun.log", "wb") as log:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                # the grader killed: torchrun and its ranks go too
                preexec_fn=functools.partial(die_with, os.getpid()),
            )

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def wait(self) -> int:
        """Until torchrun exits (after :meth:`start`); its exit status."""
        assert self._process is not None, "the job was not started"
        return self._process.wait()

    def kill(self) -> None:
        """End torchrun and every process it started; idempotent."""
        if self._process is None:
            return
        workers = {pid for pid in self.worker_pids if _is_worker(pid)}  # not a reused pid
        for pid in {*descendants(self._process.pid), *workers}:
            _signal(pid, signal.SIGKILL)
        _signal_group(self._process.pid, signal.SIGKILL)
        self._process.wait()
        if self.identity is not None:  # a daemon that escaped the process tree
            self.identity.end_jobs()

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
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
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
    for path in (job_dir, socket_dir):
        path.chmod(0o711)  # the sandbox's uid reaches its socket, and nothing else here
    (job_dir / "scratch").mkdir(mode=0o711)
    SandboxPlan(
        level=settings.sandbox,
        socket_dir=str(socket_dir),
        import_dir=str(settings.import_dir),
        hidden=[str(p) for p in settings.hidden],
        readable=[str(p) for p in settings.readable],
        pythonpath=settings.pythonpath,
        memory_bytes=settings.memory_bytes,
        scratch_bytes=settings.scratch_bytes,
        first_uid=settings.identity.first if settings.identity else None,
        device=settings.device,
        **relay,
    ).write(job_dir)


PROBE_SECONDS = 60.0  # torch's import in the sandbox, on a loaded machine


def probe(settings: JobSettings) -> str | None:
    """Why a rank of a job with ``settings`` cannot start here, or None when it can.

    Rank 0's wrapper runs as torchrun would start it, in probe mode: the same sandbox
    command, paths, uid and limits as a graded job, importing the interpreter's torch and
    the grader's rank side instead of serving calls. Seconds, once per run.
    """
    job_dir = settings.work_dir / "probe"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    command = [sys.executable, "-m", RANK_WRAPPER, str(job_dir), "--probe"]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # bound in, as the broker's
    socket_dir = None
    try:
        socket_dir = prepare_job(settings, job_dir, {})
        listener.bind(str(rank_socket(socket_dir, 0)))
        done = subprocess.run(
            command, env=env, capture_output=True, timeout=PROBE_SECONDS, start_new_session=True
        )
    except subprocess.TimeoutExpired:
        return f"a rank did not start within {PROBE_SECONDS:.0f} s"
    finally:
        listener.close()
        if settings.identity is not None:
            settings.identity.end_jobs()
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)
    if done.returncode == 0:
        shutil.rmtree(job_dir, ignore_errors=True)
        return None
    said = [line.strip() for line in done.stderr.decode(errors="replace").splitlines()]
    words = last_words(job_dir, 0) or next((line for line in reversed(said) if line), "")
    shutil.rmtree(job_dir, ignore_errors=True)
    return words or f"the rank's wrapper exited with status {done.returncode}"
