"""The harness of test_sandbox.py: a probe a student's rank might run, the trusted wrapper
that starts it in a Sandbox, and a stand-in for torchrun around both.

Every process the probe starts carries a token in its argv, so that a test can find it in
/proc and prove that none is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from runner import REPO

from grader import sandbox
from grader.sandbox import Level, Sandbox, SandboxError, identity

PROBE = r"""
import ctypes, fcntl, json, os, socket, subprocess, sys, time
mode, token, repo, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sock, connection = sys.argv[5], int(sys.argv[6])  # the broker's path; the wrapper's connection

def attempt(action):
    try:
        return action() or "ok"
    except BaseException as exc:
        return type(exc).__name__

def write(path):
    with open(path, "w") as f:
        f.write("student")

def tcp():
    socket.create_connection(("127.0.0.1", port), timeout=3).close()

def unix():  # on the connection the trusted wrapper made
    with socket.socket(fileno=connection) as s:
        s.settimeout(5)
        s.sendall(b"ping")
        return s.recv(64).decode()

def unix_path():  # a connection of the rank's own, to the same socket
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sock)

libc = ctypes.CDLL(None, use_errno=True)

def syscall(number, *args):
    if libc.syscall(number, *args) < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))

def fork():
    if os.fork() == 0:  # where a child is allowed at all, it leaves at once
        os._exit(0)
    os.wait()

def fill(path, megabytes):
    with open(path, "wb") as f:
        for _ in range(megabytes):
            f.write(bytes(1 << 20))

def open_many(count):
    files = [open("/etc/passwd") for _ in range(count)]
    for f in files:
        f.close()

KERNEL = {  # channels no namespace separates: the seccomp filter refuses each
    "lockf": lambda: fcntl.lockf(os.open("/etc/passwd", os.O_RDONLY), fcntl.LOCK_SH),  # F_SETLK
    "flock": lambda: fcntl.flock(os.open("/etc/passwd", os.O_RDONLY), fcntl.LOCK_SH),
    "add_key": lambda: syscall(248, b"user", b"side-channel-probe", b"x", 1, -4),  # x86-64
    "keyctl": lambda: syscall(250, 0, -4, 0),  # KEYCTL_GET_KEYRING_ID of the user keyring
    "ptrace": lambda: syscall(101, 16, os.getppid(), 0, 0),  # PTRACE_ATTACH
    "shmget": lambda: syscall(29, 0, 4096, 0o1600),  # IPC_PRIVATE | IPC_CREAT
    "unshare": lambda: syscall(272, 0x10000000),  # CLONE_NEWUSER
    "thread": lambda: __import__("threading").Thread(target=int).start(),  # clone3 falls back
    "fork": fork,
    "spawn": lambda: subprocess.run([sys.executable, "-c", "pass"]) and None,  # vfork's clone
}

if mode == "locks":
    print(json.dumps({k: attempt(KERNEL[k]) for k in ("lockf", "flock")}), flush=True)
elif mode == "kernel":
    limits = {
        "fill_scratch": attempt(lambda: fill("big.bin", int(sys.argv[7]) * 2)),
        "open_files": attempt(lambda: open_many(int(sys.argv[8]) + 8)),
    }
    print(json.dumps({**{k: attempt(v) for k, v in KERNEL.items()}, **limits}), flush=True)
elif mode.startswith("probe"):
    print(json.dumps({
        "secret": attempt(lambda: open(f"{repo}/reference/collectives.py").read()),
        "readable": attempt(lambda: open(f"{repo}/grader/ok.py").read()),
        "write_scratch": attempt(lambda: write("mine.txt")),
        "write_repo": attempt(lambda: write(f"{repo}/grader/evil.py")),
        "write_tmp": attempt(lambda: write(f"/tmp/{token}")),
        "write_shm": attempt(lambda: write(f"/dev/shm/{token}")),
        "tcp": attempt(tcp),
        "unix_path": attempt(unix_path),
        "unix": attempt(unix),
        # Without a cap this would really fill 6 GiB (bytearray zeroes it): not at "none".
        "memory": attempt(lambda: len(bytearray(6 << 30))) if mode == "probe" else "skipped",
        "shadow": attempt(lambda: open("/etc/shadow").read() and None),
        "uid": os.getuid(), "cwd": os.getcwd(), "home": os.environ.get("HOME"),
        "caps": [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0],
        "leaked": "GRADER_TEST_SECRET" in os.environ,
    }), flush=True)
elif mode == "x32":  # a system call through another ABI, beside a second thread
    __import__("threading").Thread(target=time.sleep, args=(30,)).start()
    libc.syscall(39 | 0x40000000)  # getpid, as x32 numbers it
    print("survived", flush=True)
elif mode == "daemon":
    try:
        child = os.fork()
    except PermissionError:  # the sandbox's filter: a rank starts no process
        with open("daemon.pid", "w") as f:
            f.write("refused")
        child = -1
    if child == 0:
        os.setsid()
        if os.fork() == 0:
            with open("daemon.pid", "w") as f:
                f.write(str(os.getpid()))
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", token])
        os._exit(0)
    if child > 0:
        os.wait()
    print("running", flush=True)  # the probe is up, whatever became of its daemon
    time.sleep(60)
"""

# The trusted wrapper, as the rank's (grader.launch.sandboxed): dies with its parent, rebuilds
# the Sandbox from JSON, connects the rank to the broker's socket, starts the sandboxed command
# with that connection and its output (stdout and stderr) into its own stdout, and exits with
# its status.
WRAPPER = r"""
import json, os, socket, sys
from pathlib import Path
from grader.sandbox import Level, Sandbox, die_with
die_with(os.getppid())  # the stand-in for torchrun
spec = json.loads(sys.argv[1])
argv, broker = spec.pop("argv"), spec.pop("broker")
connection = socket.socket(socket.AF_UNIX)
connection.connect(broker)
argv = [str(connection.fileno()) if a == "{connection}" else a for a in argv]
for key in ("scratch", "hidden", "readable"):
    spec[key] = Path(spec[key]) if key == "scratch" else tuple(map(Path, spec[key]))
spec = {**spec, "level": Level(spec["level"]), "connection": connection.fileno()}
child = Sandbox(**spec).popen(argv, sys.stdout.buffer)
connection.close()
code = child.wait()
sys.exit(code if code >= 0 else 128 - code)
"""
# Stands in for torchrun: starts one wrapper and waits.
PARENT = (
    "import subprocess, sys;"
    "sys.exit(subprocess.run([sys.executable, '-c', *sys.argv[1:]]).returncode)"
)


PREFIXES = tuple(sorted({Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}))


def python_for(uid: int) -> str:
    """An interpreter the uid can run: ours unless it lies in root's 0700 home."""
    if identity.readable_by([Path(sys.executable)], uid, uid):
        return sys.executable
    if not identity.readable_by([Path("/usr/bin/python3")], uid, uid):
        pytest.skip(f"no Python interpreter that uid {uid} can run")
    return "/usr/bin/python3"


def pids_with(token: str) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            zombie = " Z " in Path(f"/proc/{entry}/stat").read_text().split(")", 1)[1][:3]
        except OSError:
            continue
        if token.encode() in cmdline and not zombie:
            found.append(int(entry))
    return found


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def free_uid() -> int:
    """A uid no process uses: tests must not kill (or be killed with) anyone's nobody."""
    while True:
        uid = random.randrange(61000, 65000)
        if not identity.pids_of(uid):
            return uid


@dataclass
class World:
    """A fake repository to hide, a broker socket and a TCP listener on the host."""

    base: Path
    token: str
    port: int
    sock: Path

    @property
    def repo(self) -> Path:
        return self.base / "repo"

    def sandbox(self, level: Level, **options) -> Sandbox:
        options.setdefault("memory_bytes", 1 << 30)
        env = {"PYTHONDONTWRITEBYTECODE": "1", **options.pop("env", {})}
        return Sandbox(
            level=level,
            scratch=self.base / "scratch",
            hidden=(self.repo, Path.home()),  # this machine's interpreter is in /root/.pyenv
            readable=(self.repo / "grader", *PREFIXES),
            env=env,
            **options,
        )

    def argv(self, mode: str, python: str = sys.executable) -> list[str]:
        probe = str(self.repo / "grader" / "probe.py")
        return [
            python,
            probe,
            mode,
            self.token,
            str(self.repo),
            str(self.port),
            str(self.sock),
            "{connection}",
        ]

    def launch(self, box: Sandbox, argv: list[str]) -> subprocess.Popen[str]:
        """parent -> wrapper (trusted, calls Sandbox.exec) -> sandboxed argv."""
        box.prepare()
        spec = {
            "level": box.level.value,
            "scratch": str(box.scratch),
            **{k: [str(p) for p in getattr(box, k)] for k in ("hidden", "readable")},
            "broker": str(self.sock),
            "env": dict(box.env),
            "memory_bytes": box.memory_bytes,
            "scratch_bytes": box.scratch_bytes,
            "max_file_bytes": box.max_file_bytes,
            "max_open_files": box.max_open_files,
            "uid": box.uid,
            "gid": box.gid,
            "argv": argv,
        }
        env = {**os.environ, "PYTHONPATH": str(REPO), "GRADER_TEST_SECRET": "1"}
        return subprocess.Popen(
            [sys.executable, "-c", PARENT, WRAPPER, json.dumps(spec)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def run(self, box: Sandbox, argv: list[str], timeout: float = 60) -> tuple[int, str, str]:
        proc = self.launch(box, argv)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            kill_group(proc)
        return proc.returncode, out, err

    def probe(self, box: Sandbox, python: str = sys.executable) -> dict:
        mode = "probe" if box.level is not Level.NONE else "probe-uncapped"
        code, out, err = self.run(box, self.argv(mode, python))
        assert code == 0, err
        return json.loads(out)


def kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def serve(server: socket.socket) -> None:
    """The broker: answers each connection's message with ``pong:<message>``."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:  # closed: the test is over
            return
        with conn, contextlib.suppress(OSError):  # a rank that never spoke: nothing to answer
            conn.sendall(b"pong:" + conn.recv(64))


def _available(level: Level) -> str | None:
    try:
        sandbox.detect(level)
    except SandboxError as exc:
        return str(exc)
    return None


needs_namespaces = pytest.mark.skipif(
    bool(_available(Level.NAMESPACES)), reason=str(_available(Level.NAMESPACES))
)
needs_uid = pytest.mark.skipif(bool(_available(Level.UID)), reason=str(_available(Level.UID)))

x86_64 = pytest.mark.skipif(platform.machine() != "x86_64", reason="the probe's syscall numbers")
