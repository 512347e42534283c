"""grader.sandbox, checked for real at each level this machine offers.

A student's rank is started as torchrun would: a parent (standing in for torchrun)
starts the trusted wrapper, which calls ``Sandbox.exec``; inside, a probe script tries
what a student might, and reports as JSON. Every process the probe starts carries a
token in its argv, so that the test can find it in /proc and prove that none is left.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from runner import REPO

from grader import sandbox
from grader.sandbox import GUARANTEES, Level, Sandbox, SandboxError, identity

PROBE = r"""
import ctypes, fcntl, json, os, socket, sys, time
mode, token, repo, port, sock = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]

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

def unix():
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(sock)
        s.sendall(b"ping")
        return s.recv(64).decode()

libc = ctypes.CDLL(None, use_errno=True)

def syscall(number, *args):
    if libc.syscall(number, *args) < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))

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
}

if mode == "locks":
    print(json.dumps({k: attempt(KERNEL[k]) for k in ("lockf", "flock")}), flush=True)
elif mode == "kernel":
    limits = {
        "fill_scratch": attempt(lambda: fill("big.bin", int(sys.argv[6]) * 2)),
        "open_files": attempt(lambda: open_many(int(sys.argv[7]) + 8)),
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
        "unix": attempt(unix),
        # Without a cap this would really fill 6 GiB (bytearray zeroes it): not at "none".
        "memory": attempt(lambda: len(bytearray(6 << 30))) if mode == "probe" else "skipped",
        "shadow": attempt(lambda: open("/etc/shadow").read() and None),
        "uid": os.getuid(), "cwd": os.getcwd(), "home": os.environ.get("HOME"),
        "caps": [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0],
        "leaked": "GRADER_TEST_SECRET" in os.environ,
    }), flush=True)
elif mode == "daemon":
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            with open("daemon.pid", "w") as f:
                f.write(str(os.getpid()))
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", token])
        os._exit(0)
    os.wait()
    time.sleep(60)
"""

# The trusted wrapper: rebuilds the Sandbox from JSON and becomes the sandboxed command.
WRAPPER = r"""
import json, sys
from pathlib import Path
from grader.sandbox import Level, Sandbox
spec = json.loads(sys.argv[1])
argv = spec.pop("argv")
for key in ("scratch", "hidden", "readable", "sockets"):
    spec[key] = Path(spec[key]) if key == "scratch" else tuple(map(Path, spec[key]))
Sandbox(**{**spec, "level": Level(spec["level"])}).exec(argv)
"""
# Stands in for torchrun: starts one wrapper and waits.
PARENT = (
    "import subprocess, sys;"
    "sys.exit(subprocess.run([sys.executable, '-c', *sys.argv[1:]]).returncode)"
)


PREFIXES = tuple(sorted({Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}))


def _python_for(uid: int) -> str:
    """An interpreter the uid can run: ours unless it lies in root's 0700 home."""
    if identity.readable_by([Path(sys.executable)], uid, uid):
        return sys.executable
    if not identity.readable_by([Path("/usr/bin/python3")], uid, uid):
        pytest.skip(f"no Python interpreter that uid {uid} can run")
    return "/usr/bin/python3"


def _pids_with(token: str) -> list[int]:
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


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _free_uid() -> int:
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
        return Sandbox(
            level=level,
            scratch=self.base / "scratch",
            hidden=(self.repo, Path.home()),  # this machine's interpreter is in /root/.pyenv
            readable=(self.repo / "grader", *PREFIXES),
            sockets=(self.sock,),
            env={"PYTHONDONTWRITEBYTECODE": "1"},
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
        ]

    def launch(self, box: Sandbox, argv: list[str]) -> subprocess.Popen[str]:
        """parent -> wrapper (trusted, calls Sandbox.exec) -> sandboxed argv."""
        box.prepare()
        spec = {
            "level": box.level.value,
            "scratch": str(box.scratch),
            **{k: [str(p) for p in getattr(box, k)] for k in ("hidden", "readable", "sockets")},
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
            _kill_group(proc)
        return proc.returncode, out, err

    def probe(self, box: Sandbox, python: str = sys.executable) -> dict:
        mode = "probe" if box.level is not Level.NONE else "probe-uncapped"
        code, out, err = self.run(box, self.argv(mode, python))
        assert code == 0, err
        return json.loads(out)


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _serve(server: socket.socket) -> None:
    """The broker: answers each connection's message with ``pong:<message>``."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:  # closed: the test is over
            return
        with conn:
            conn.sendall(b"pong:" + conn.recv(64))


@pytest.fixture
def world() -> Iterator[World]:
    # Not pytest's tmp_path: /tmp/pytest-of-root is 0700, out of a dropped uid's reach.
    base = Path(tempfile.mkdtemp(prefix="sandbox-test-"))
    base.chmod(0o755)
    (base / "repo" / "reference").mkdir(parents=True)
    (base / "repo" / "reference" / "collectives.py").write_text("ANSWER = 42\n")
    (base / "repo" / "grader").mkdir()
    (base / "repo" / "grader" / "ok.py").write_text("readable\n")
    (base / "repo" / "grader" / "probe.py").write_text(PROBE)
    (base / "repo" / "run").mkdir()
    sock = base / "repo" / "run" / "broker.sock"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(sock))
    unix.listen()
    tcp = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_serve, args=(unix,), daemon=True).start()
    token = f"sandbox-test-{uuid.uuid4().hex}"
    try:
        yield World(base, token, tcp.getsockname()[1], sock)
        assert _pids_with(token) == [], "a process of the test outlived it"
    finally:
        for pid in _pids_with(token):
            os.kill(pid, signal.SIGKILL)
        unix.close()
        tcp.close()
        for leftover in (Path("/tmp") / token, Path("/dev/shm") / token):
            leftover.unlink(missing_ok=True)
        shutil.rmtree(base)


def _available(level: Level) -> str | None:
    try:
        sandbox.detect(level.value)
    except SandboxError as exc:
        return str(exc)
    return None


needs_namespaces = pytest.mark.skipif(
    bool(_available(Level.NAMESPACES)), reason=str(_available(Level.NAMESPACES))
)
needs_uid = pytest.mark.skipif(bool(_available(Level.UID)), reason=str(_available(Level.UID)))


@needs_namespaces
def test_namespaces_hide_confine_and_cap(world: World) -> None:
    seen = world.probe(world.sandbox(Level.NAMESPACES))
    assert seen["secret"] == "FileNotFoundError"  # masked by an empty tmpfs
    assert seen["readable"] == "readable\n" and seen["write_scratch"] == "ok"
    assert not (world.base / "scratch" / "mine.txt").exists()  # a tmpfs: not the host's disk
    assert seen["write_repo"] in ("OSError", "PermissionError")  # read-only
    assert not (world.repo / "grader" / "evil.py").exists()
    assert not (Path("/tmp") / world.token).exists()  # a private /tmp, if any
    assert not (Path("/dev/shm") / world.token).exists()
    assert seen["tcp"] in ("ConnectionRefusedError", "OSError", "TimeoutError")
    assert seen["unix"] == "pong:ping"
    assert seen["memory"] == "MemoryError"
    assert seen["write_tmp"] == "ok"  # a private /tmp
    assert seen["uid"] == 65534 and not seen["leaked"]
    assert seen["shadow"] == "PermissionError" and seen["caps"] == "0000000000000000"
    assert seen["cwd"] == seen["home"] == str(world.base / "scratch")


@needs_namespaces
def test_a_hidden_folder_inside_a_later_hidden_one(world: World) -> None:
    """A course in a home directory: both hidden, the home after the course (issue 14's
    student laptop, where bwrap could not remount the buried mount point read-only)."""
    box = world.sandbox(Level.NAMESPACES)
    seen = world.probe(dataclasses.replace(box, hidden=(world.repo, world.base)))
    assert seen["secret"] == "FileNotFoundError" and seen["readable"] == "readable\n"


@needs_uid
def test_uid_level_confines_by_permissions(world: World) -> None:
    uid = _free_uid()
    (world.repo / "reference").chmod(0o700)  # what hides files at this level
    secret, ok = world.repo / "reference" / "collectives.py", world.repo / "grader" / "ok.py"
    assert identity.readable_by([secret, ok], uid, uid) == [ok]
    seen = world.probe(world.sandbox(Level.UID, uid=uid, gid=uid), _python_for(uid))
    assert seen["secret"] == "PermissionError" and seen["readable"] == "readable\n"
    assert seen["write_scratch"] == "ok" and seen["write_repo"] == "PermissionError"
    assert not (world.repo / "grader" / "evil.py").exists()
    assert seen["unix"] == "pong:ping" and seen["memory"] == "MemoryError"
    assert seen["uid"] == uid and not seen["leaked"]
    assert seen["shadow"] == "PermissionError" and seen["caps"] == "0000000000000000"
    assert seen["cwd"] == seen["home"] == str(world.base / "scratch")
    # What this level does not do, as GUARANTEES says: /tmp is shared with the host.
    assert seen["write_tmp"] == "ok" and "/tmp" in GUARANTEES[Level.UID]


x86_64 = pytest.mark.skipif(platform.machine() != "x86_64", reason="the probe's syscall numbers")


@x86_64
@pytest.mark.parametrize(
    "level",
    [
        pytest.param(Level.NAMESPACES, marks=needs_namespaces),
        pytest.param(Level.UID, marks=needs_uid),
    ],
)
def test_kernel_objects_are_refused_and_limits_hold(world: World, level: Level) -> None:
    """The seccomp filter's channels are closed at both levels (syscall_filter's list), and
    a rank cannot fill more than its scratch nor open more files than its cap."""
    uid = _free_uid() if level is Level.UID else sandbox.NOBODY
    limits = {"scratch_bytes": 8 << 20, "max_file_bytes": 8 << 20, "max_open_files": 64}
    box = world.sandbox(level, uid=uid, gid=uid, **limits)
    code, out, err = world.run(box, [*world.argv("kernel", _python_for(uid)), "8", "64"])
    assert code == 0, err
    seen = json.loads(out)
    refused = {"lockf", "flock", "add_key", "keyctl", "ptrace", "shmget", "unshare"}
    assert {k: seen[k] for k in refused} == dict.fromkeys(refused, "PermissionError")
    assert seen["thread"] == "ok"  # clone3's ENOSYS: the C library falls back to clone
    assert seen["fill_scratch"] == "OSError" and seen["open_files"] == "OSError"
    big = world.base / "scratch" / "big.bin"
    assert not big.exists() if level is Level.NAMESPACES else big.stat().st_size <= 8 << 20


@x86_64
def test_without_the_filter_a_lock_is_a_channel(world: World) -> None:
    """What the filter closes is real: at ``none`` the same lock calls succeed."""
    code, out, err = world.run(world.sandbox(Level.NONE), world.argv("locks"))
    seen = json.loads(out)
    assert code == 0 and seen["lockf"] == seen["flock"] == "ok", err


def test_none_level_runs_as_is(world: World) -> None:
    box = world.sandbox(Level.NONE)
    assert box.command(["true"]) == ["true"]
    seen = world.probe(box)
    assert seen["secret"] == "ANSWER = 42\n" and seen["uid"] == os.getuid()  # no isolation at all
    assert seen["write_scratch"] == "ok" and seen["unix"] == "pong:ping"
    assert "No isolation" in GUARANTEES[Level.NONE]


@pytest.mark.parametrize(
    "level",
    [
        pytest.param(Level.NAMESPACES, marks=needs_namespaces),
        pytest.param(Level.UID, marks=needs_uid),
    ],
)
def test_torch_imports_at_the_default_cap(world: World, level: Level) -> None:
    uid = 65534 if level is Level.NAMESPACES else _free_uid()
    if level is Level.UID and _python_for(uid) != sys.executable:
        pytest.skip(f"uid {uid} cannot reach {sys.executable}, the interpreter with torch")
    box = world.sandbox(level, memory_bytes=sandbox.DEFAULT_MEMORY, uid=uid, gid=uid)
    code, out, err = world.run(
        box, [sys.executable, "-c", "import torch; print(torch.ones(2).sum())", world.token]
    )
    assert code == 0 and "tensor(2.)" in out, err


@needs_namespaces
def test_namespaces_daemon_dies_with_the_parent(world: World) -> None:
    proc = world.launch(world.sandbox(Level.NAMESPACES), world.argv("daemon"))
    try:
        # The scratch is the sandbox's own tmpfs: count the processes (+bwrap, probe, daemon).
        assert _wait_until(lambda: len(_pids_with(world.token)) >= 4, 30)
        os.kill(proc.pid, signal.SIGKILL)  # torchrun dies
        assert _wait_until(lambda: not _pids_with(world.token), 5), _pids_with(world.token)
    finally:
        _kill_group(proc)


@needs_uid
def test_uid_daemon_dies_by_kill_uid(world: World) -> None:
    uid = _free_uid()
    box = world.sandbox(Level.UID, uid=uid, gid=uid)
    proc = world.launch(box, world.argv("daemon", _python_for(uid)))
    try:
        pid_file = world.base / "scratch" / "daemon.pid"
        assert _wait_until(lambda: pid_file.exists() and pid_file.read_text(), 20)
        daemon = int(pid_file.read_text())
        assert _wait_until(lambda: daemon in _pids_with(world.token), 5)
        os.kill(proc.pid, signal.SIGKILL)  # torchrun dies: PDEATHSIG takes the rank
        assert _wait_until(lambda: _pids_with(world.token) == [daemon], 5)  # escaped
        assert identity.kill_uid(uid) == 1
        assert _wait_until(lambda: not _pids_with(world.token), 3)
        assert identity.pids_of(uid) == []
    finally:
        _kill_group(proc)


def test_detect_honours_requests_or_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sandbox.detect("none") is Level.NONE
    monkeypatch.setenv(sandbox.ENV_VAR, "none")
    assert sandbox.detect() is Level.NONE
    with pytest.raises(SandboxError, match="unknown sandbox level"):
        sandbox.detect("chroot")
    monkeypatch.setattr(sandbox.shutil, "which", lambda _: None)
    sandbox.unavailable.cache_clear()
    try:
        with pytest.raises(SandboxError, match="bwrap is not installed"):
            sandbox.detect("namespaces")
    finally:
        sandbox.unavailable.cache_clear()


def test_kill_uid_refuses_the_graders_own_uid() -> None:
    with pytest.raises(SandboxError, match="refusing"):
        identity.kill_uid(os.geteuid())


GLOO_JOB = """
import re, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1 << 20)
dist.all_reduce(t)
peak = re.search(r"VmPeak:\\s+(\\d+)", open("/proc/self/status").read()).group(1)
# One short line, one write: whole lines on the shared stdout (the scratch is the rank's own).
print(f"rank{dist.get_rank()} sum {int(t[0])} VmPeak_MiB {int(peak) // 1024}", flush=True)
dist.destroy_process_group()
"""


@needs_namespaces
def test_a_four_rank_gloo_job_runs_inside_at_the_default_cap(world: World) -> None:
    """torch's address space at 4 ranks (printed; ~0.9 GiB on 2 cores) fits the default."""
    job = world.repo / "grader" / "job.py"  # bound in read-only
    job.write_text(GLOO_JOB)
    box = world.sandbox(Level.NAMESPACES, memory_bytes=sandbox.DEFAULT_MEMORY)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv = [*torchrun, "--nproc_per_node=4", "--log-dir", "logs", str(job), world.token]
    code, out, err = world.run(box, argv, timeout=90)
    assert code == 0, err[-2000:]
    reports = sorted(line for line in out.splitlines() if line.startswith("rank"))
    assert [r.split(" VmPeak")[0] for r in reports] == [f"rank{r} sum 4" for r in range(4)]
    print(reports)
