"""What a node other than the head does in a run across nodes: lend its ranks.

    grader run --nnodes 2 --node-rank 1 --rdzv-endpoint HEAD:29400

It joins the head (:mod:`grader.nodes.head`), receives the staged
submission, and then, for each job the head starts, starts this node's
torchrun agent in the job's rendezvous, with every rank relaying to the
head's broker. It grades nothing: the head writes the results. It ends its
job when the head starts the next one, says grading is over, or goes.

Its sandbox is its own: the level its own ``--sandbox`` asks for (the best
this machine has, by default) is its minimum. A head that asks for less is
refused; one that asks for more gets it, if this machine has it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from grader import protocol, sandbox, wire
from grader.device import parse
from grader.launch.job import JobSettings, TorchrunJob, job_settings, node_job
from grader.nodes import JOIN_SECONDS, Nodes, NodesError, node_key, unpack_folder
from grader.nodes.channel import Sealed, connect
from grader.nodes.head import PORT_KEY
from grader.sandbox import identity as uids
from grader.wire import Frame

EXIT_DONE, EXIT_FAILED = 0, 2


_STRENGTH = {sandbox.Level.NONE: 0, sandbox.Level.UID: 1, sandbox.Level.NAMESPACES: 2}


def node_level(own: sandbox.Level, asked: object) -> sandbox.Level:
    """The level this node applies when the head asks for ``asked`` and this node's own
    minimum is ``own``; SandboxError (one line) if it will not or cannot."""
    try:
        wanted = sandbox.Level(asked)
    except (TypeError, ValueError):
        said = protocol.clean(asked, 20)
        raise sandbox.SandboxError(f"the head asks for an unknown sandbox level {said!r}") from None
    if _STRENGTH[wanted] < _STRENGTH[own]:
        raise sandbox.SandboxError(
            f"the head asks for sandbox level {wanted.value!r}, weaker than this node's "
            f"{own.value!r}: a node never grades below its own level (start node 0 with "
            f"--sandbox {own.value}, or this node with --sandbox {wanted.value})"
        )
    return own if wanted is own else sandbox.detect(wanted)


def join_head(nodes: Nodes, key: bytes, timeout: float = JOIN_SECONDS) -> tuple[Sealed, str]:
    """This node's grader, connected to the head (which may start after it), and the head's
    port, where this node's relays connect too."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout
    while True:  # quietly: torch's store client prints a trace for every failed try
        try:
            socket.create_connection((nodes.host, nodes.port), timeout=5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise NodesError(
                    f"no head at {nodes.endpoint} within {timeout:.0f} s: start node 0 "
                    "(`grader run ... --node-rank 0`) there"
                ) from None
            time.sleep(0.5)
    store = dist.TCPStore(nodes.host, nodes.port, is_master=False, timeout=timedelta(seconds=60))
    port = store.get(PORT_KEY).decode()
    del store
    address = f"{nodes.host}:{port}"
    return connect(address, key, {"role": "node", "node": nodes.rank}), address


def lend_ranks(nodes: Nodes, sandbox_request: sandbox.Level | None = None) -> int:
    """Serve the head's jobs until grading is over; 0 then, 2 if the run broke."""
    key = node_key()
    try:
        own = sandbox.detect(sandbox_request)  # before the head says anything
        link, address = join_head(nodes, key)
        run = wire.recv_frame(link)
    except sandbox.SandboxError as err:
        return _fail(str(err))
    except (OSError, NodesError, wire.WireError) as err:
        return _fail(f"cannot join the head at {nodes.endpoint}: {err}")
    if run is None or run.header["type"] != protocol.RUN or len(run.buffers) != 1:
        return _fail(
            f"the head at {nodes.endpoint} refused node {nodes.rank}: is $GRADER_SECRET the same "
            "on every node, and is another node started with --node-rank "
            f"{nodes.rank}?"
        )
    try:
        level = node_level(own, run.header.get("level"))
        ranks_device = parse(run.header.get("device"), "the head's run")
    except (sandbox.SandboxError, ValueError) as err:
        with contextlib.suppress(OSError):
            wire.send_frame(link, Frame({"type": protocol.REFUSE, "message": str(err)}))
        return _fail(str(err))
    work = Path(tempfile.mkdtemp(prefix="grader-node-")).resolve()
    job: _NodeJob | None = None
    identity = uids.reserve() if os.geteuid() == 0 and sys.platform == "linux" else None
    try:
        work.chmod(0o711)
        unpack_folder(run.buffers[0], work / "import")
        settings = job_settings(work, level, ranks_device, identity=identity)
        wire.send_frame(link, Frame({"type": protocol.READY, "level": level.value}))
        print(
            f"node {nodes.rank}: joined the head at {nodes.endpoint} (sandbox: {level.value})",
            flush=True,
        )
        while (frame := wire.recv_frame(link)) is not None:
            if job is not None:
                job.end()
                job = None
            if frame.header["type"] == protocol.FINISH:
                print(f"node {nodes.rank}: grading is over", flush=True)
                return EXIT_DONE
            if frame.header["type"] == protocol.JOB:
                job = _start(settings, nodes, frame.header, address, key)
        return _fail(f"the head at {nodes.endpoint} went away before grading was over")
    except (OSError, wire.WireError) as err:
        return _fail(f"lost the head at {nodes.endpoint}: {err}")
    finally:
        if job is not None:
            job.end()
        shutil.rmtree(work, ignore_errors=True)
        if identity is not None:  # this node's own uids: their processes end, nobody else's
            identity.release()


@dataclass(frozen=True)
class _NodeJob:
    """This node's share of one of the head's jobs: its torchrun agent and its ranks' sockets."""

    torchrun: TorchrunJob
    socket_dir: Path

    def end(self) -> None:
        self.torchrun.kill()
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def _start(settings: JobSettings, nodes: Nodes, header: dict, address: str, key: bytes) -> _NodeJob:
    job_id = protocol.clean(header.get("id", ""), 40)
    per_node = protocol.field_int(header, "per_node", 1, 1024)
    job, socket_dir = node_job(
        settings, settings.work_dir / job_id, nodes, job_id, per_node, address, key
    )
    job.start()
    return _NodeJob(job, socket_dir)


def _fail(message: str) -> int:
    print(f"grader: error: {message}", file=sys.stderr)
    return EXIT_FAILED
