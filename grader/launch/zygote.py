"""A job's zygote: its ranks forked from one process that imported torch once.

Every rank imports the same torch, two seconds of CPU each, before it runs a line of the
student's: four ranks and torchrun spend five such imports per job. At ``uid`` the sandbox
is a uid, limits, a system-call filter and a Landlock allow-list, all of which a process
applies to itself, so none of it needs an exec. The grader therefore starts one trusted
process per job (:func:`start`: its own user, outside any sandbox, with a rank's
environment) that imports the rank's side, torch with it, and then forks each rank that
its wrapper asks for. The child walls itself in exactly as an exec'd rank is walled
(:meth:`grader.sandbox.Sandbox.enter`, then the rank's own allow-list, then
:func:`grader.rank.__main__.serve`) before it reads a byte of the submission. Android
starts its apps this way. At ``namespaces`` each rank keeps a bubblewrap of its own: ranks
sharing one would see each other's scratch (``stat``) and pid counter, channels between them
that no broker carries, which a namespace per rank closes. Jobs across nodes, and kernels
without pidfds, exec their ranks too.

A child inherits the zygote's memory: the interpreter, torch, the grader's rank side, and
the requests of the ranks forked before it (a rank number and a sandbox, which the rank
knows of itself). The zygote never reads the course, the secret, a broker's key, the
paths hidden from the ranks or the sockets' folder. The
child closes every descriptor but its connection (at :data:`RANK_FD`), its log (stdout and
stderr) and /dev/null (stdin).

The protocol, on a Unix socket in the job's socket folder (the grader's alone): a wrapper
sends one line of JSON, ``{"rank", "local_rank", "world_size"}``, with the rank's
connection and its log as SCM_RIGHTS; the zygote answers ``{"pid"}`` once forked, and
``{"exit"}`` (a return code as Popen gives it) when the rank has ended. A wrapper that
hangs up (torchrun ended it) has its rank killed.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, NoReturn

from grader.launch import orphans
from grader.launch.plan import JOB_ENV, SandboxPlan, rank_sandbox
from grader.sandbox import Level, Sandbox, landlock, syscall_filter

RANK_FD = 3  # where a forked rank finds its connection to the broker
SOCKET_NAME = "zygote"
_LINE_BYTES = 4096


def wanted(plan: SandboxPlan) -> bool:
    """Whether the ranks of a job so planned are forked: at ``uid``, on this machine only."""
    return plan.level is Level.UID and not plan.broker and _pidfds()


@functools.cache
def _pidfds() -> bool:
    """Whether this kernel gives descriptors for processes (Linux 5.3), as the zygote's loop
    waits on its ranks' ends with them; elsewhere every rank starts afresh."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


def start(plan: SandboxPlan, job_dir: Path, size: int) -> subprocess.Popen[bytes]:
    """Start the zygote of the job in ``job_dir`` so planned, serving ``size`` ranks; its
    socket (``plan.zygote``) is listening on return, and a wrapper that connects early waits
    in the backlog until torch is imported."""
    sandbox = rank_sandbox(plan, job_dir, 0, size, 0)
    env = {**sandbox.environment(), "HOME": str(job_dir), "TMPDIR": str(job_dir)}
    env.pop(landlock.ENV_VAR, None)  # each child is handed its own
    env.update({"PWD": str(job_dir), JOB_ENV: str(job_dir)})
    # What a rank's sandbox needs of the plan, as every rank is handed the zygote's memory:
    # none of the hidden paths nor the sockets' folder. In a descriptor, never in its
    # environment, which every forked rank would read in its own /proc/self/environ.
    told = _plan_file(replace(plan, hidden=[], readable=[], socket_dir="", zygote=""))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener, told:
        listener.bind(plan.zygote)
        listener.listen(size)
        fds = (listener.fileno(), told.fileno())
        command = [sys.executable, "-m", __name__, *map(str, fds), str(size)]
        log = job_dir / "zygote.log"
        return orphans.start_trusted(command, log, env=env, pass_fds=fds, cwd=job_dir)


def _plan_file(plan: SandboxPlan) -> IO[bytes]:
    """The plan in an anonymous file, read from its start."""
    told = os.fdopen(os.memfd_create("grader-plan"), "w+b")
    told.write(plan.to_json().encode())
    told.seek(0)
    return told


class Forked:
    """A wrapper's view of its rank, forked by the zygote: what it needs of a Popen."""

    def __init__(self, path: Path, request: dict[str, int], connection: int, log: int) -> None:
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._answers = self._socket.makefile("rb")
        try:
            self._socket.connect(str(path))
            message = json.dumps(request).encode() + b"\n"
            socket.send_fds(self._socket, [message], [connection, log])
        except OSError as err:  # it is gone (its log in the job's folder says why)
            os.write(log, f"the rank was not started: its job's zygote is gone ({err})\n".encode())
            self._socket.shutdown(socket.SHUT_RDWR)  # so that every answer is the end
        self.pid = self._answer("pid")  # 0: never forked

    def _answer(self, key: str) -> int:
        try:
            line = self._answers.readline(_LINE_BYTES)
        except OSError:
            line = b""
        if not line:  # the zygote is gone, and its ranks with it
            return 0 if key == "pid" else -signal.SIGKILL
        return int(json.loads(line)[key])

    def send_signal(self, sig: int) -> None:
        """End the rank (any signal): hanging up has the zygote kill it, race-free."""
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)

    def wait(self) -> int:
        """Until the rank ends; its return code (negative: the signal that ended it)."""
        return self._answer("exit")


@dataclass
class _Rank:
    wrapper: socket.socket
    pid: int = 0
    pidfd: int = -1


class Zygote:
    """The zygote's one loop: each event (a wrapper's connection, its request, its hang-up,
    a rank's end) has its handler, registered as the selector key's data."""

    def __init__(self, listener: socket.socket, job_dir: Path, plan: SandboxPlan, size: int):
        self.listener = listener
        self.job_dir = job_dir
        self.plan = plan
        self.to_fork = size
        self.ranks: list[_Rank] = []
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, self._accept)

    def run(self) -> None:
        while self.to_fork or self.ranks:
            for key, _ in self.selector.select():
                handler: Callable[[], None] = key.data
                handler()

    def _accept(self) -> None:
        wrapper, _ = self.listener.accept()
        rank = _Rank(wrapper)
        self.ranks.append(rank)
        self.selector.register(wrapper, selectors.EVENT_READ, lambda: self._request(rank))

    def _request(self, rank: _Rank) -> None:
        message, fds, _, _ = socket.recv_fds(rank.wrapper, _LINE_BYTES, 2)
        try:
            if len(fds) != 2 or not message.endswith(b"\n") or self.to_fork == 0:
                self._forget(rank)
                return
            asked = json.loads(message)
            sandbox = rank_sandbox(
                self.plan, self.job_dir, asked["rank"], asked["world_size"], asked["local_rank"]
            )
            rank.pid = os.fork()
            if rank.pid == 0:
                self._become(sandbox, *fds)
        finally:
            for fd in fds:
                os.close(fd)
        self.to_fork -= 1
        rank.pidfd = os.pidfd_open(rank.pid)
        self.selector.modify(rank.wrapper, selectors.EVENT_READ, lambda: self._hung_up(rank))
        self.selector.register(rank.pidfd, selectors.EVENT_READ, lambda: self._ended(rank))
        rank.wrapper.sendall(json.dumps({"pid": rank.pid}).encode() + b"\n")

    def _hung_up(self, rank: _Rank) -> None:
        """The wrapper hung up (or wrote what it must not): the rank is killed."""
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(rank.pidfd, signal.SIGKILL)
        self.selector.unregister(rank.wrapper)

    def _ended(self, rank: _Rank) -> None:
        _, status = os.waitpid(rank.pid, 0)
        with contextlib.suppress(OSError):  # a wrapper that hung up hears nothing
            exit_code = os.waitstatus_to_exitcode(status)
            rank.wrapper.sendall(json.dumps({"exit": exit_code}).encode() + b"\n")
        self.selector.unregister(rank.pidfd)
        os.close(rank.pidfd)
        self._forget(rank)

    def _forget(self, rank: _Rank) -> None:
        with contextlib.suppress(KeyError):
            self.selector.unregister(rank.wrapper)
        rank.wrapper.close()
        self.ranks.remove(rank)

    def _become(self, sandbox: Sandbox, connection: int, log: int) -> NoReturn:
        """The child: it walls itself in and serves as the rank; it never returns."""
        code = 1
        try:
            self.selector.close()  # this copy's descriptors only: the zygote keeps its own
            self.listener.close()
            for rank in self.ranks:
                rank.wrapper.close()
            _descriptors(connection, log)
            os.environ.clear()
            os.environ.update(sandbox.environment())
            sandbox.enter()
            from grader.rank import __main__ as rank_main

            # As ``python -m grader.rank FD IMPORT_DIR`` started in its scratch would have them.
            sys.argv = [str(rank_main.__file__), str(RANK_FD), self.plan.import_dir]
            sys.path[0] = str(sandbox.scratch)

            if (refused := rank_main.confine()) is not None:
                code = refused
            else:
                rank_main.serve(RANK_FD, Path(self.plan.import_dir))
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _descriptors(connection: int, log: int) -> None:
    """Stdout and stderr to the log, stdin from /dev/null, the connection at RANK_FD, and
    no other descriptor open."""
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(connection, RANK_FD)  # after the log: a log at RANK_FD is at 1 and 2 already
    os.closerange(RANK_FD + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1])


def main(listener_fd: int, plan_fd: int, size: int) -> int:
    with os.fdopen(plan_fd, "rb") as told:
        plan = SandboxPlan.from_json(told.read().decode())
    job_dir = Path(os.environ.pop(JOB_ENV))
    listener = socket.socket(fileno=listener_fd)
    zygote = Zygote(listener, job_dir, plan, size)
    for module in ("grader.rank.__main__", "grader.rank.worker"):  # torch with it, once here
        importlib.import_module(module)

    syscall_filter.program()  # built once, before any fork: a child only loads it
    gc.collect()
    gc.freeze()  # what the children share stays shared: the collector writes to no page of it
    if (threads := len(os.listdir("/proc/self/task"))) != 1:
        print(f"the zygote runs {threads} threads: a fork would copy one", file=sys.stderr)
        return 1
    zygote.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
