"""grader.sandbox, checked for real at each level this machine offers.

A student's rank is started as torchrun would: a parent (standing in for torchrun)
starts the trusted wrapper, which calls ``Sandbox.exec``; inside, a probe script tries
what a student might, and reports as JSON (the harness: ``sandbox_probe.py``). No process
the probe starts outlives its test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from runner import REPO
from sandbox_probe import (
    PROBE,
    World,
    free_uid,
    kill_group,
    needs_namespaces,
    needs_uid,
    pids_with,
    python_for,
    serve,
    wait_until,
    x86_64,
)

from grader import sandbox
from grader.course import config as course
from grader.sandbox import Level, SandboxError, identity, view


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
    threading.Thread(target=serve, args=(unix,), daemon=True).start()
    token = f"sandbox-test-{uuid.uuid4().hex}"
    try:
        yield World(base, token, tcp.getsockname()[1], sock)
        assert pids_with(token) == [], "a process of the test outlived it"
    finally:
        for pid in pids_with(token):
            os.kill(pid, signal.SIGKILL)
        unix.close()
        tcp.close()
        for leftover in (Path("/tmp") / token, Path("/dev/shm") / token):
            leftover.unlink(missing_ok=True)
        shutil.rmtree(base)


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
    # No socket of its own (the seccomp filter): only the connection its wrapper made.
    assert seen["tcp"] == seen["unix_path"] == "PermissionError"
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
    uid = free_uid()
    (world.repo / "reference").chmod(0o700)  # what hides files at this level
    secret, ok = world.repo / "reference" / "collectives.py", world.repo / "grader" / "ok.py"
    assert identity.readable_by([secret, ok], uid, uid) == [ok]
    seen = world.probe(world.sandbox(Level.UID, uid=uid, gid=uid), python_for(uid))
    assert seen["secret"] == "PermissionError" and seen["readable"] == "readable\n"
    assert seen["write_scratch"] == "ok" and seen["write_repo"] == "PermissionError"
    assert not (world.repo / "grader" / "evil.py").exists()
    assert seen["unix"] == "pong:ping" and seen["memory"] == "MemoryError"
    assert seen["tcp"] == seen["unix_path"] == "PermissionError"
    assert seen["uid"] == uid and not seen["leaked"]
    assert seen["shadow"] == "PermissionError" and seen["caps"] == "0000000000000000"
    assert seen["cwd"] == seen["home"] == str(world.base / "scratch")
    # What permissions alone do not do: /tmp is shared with the host. The Landlock allow-list
    # that a rank applies to itself closes it (test_wall.py, with the real rank).
    assert seen["write_tmp"] == "ok"


#: The levels that sandbox a rank, each with the seccomp filter.
sandboxed_levels = pytest.mark.parametrize(
    "level",
    [
        pytest.param(Level.NAMESPACES, marks=needs_namespaces),
        pytest.param(Level.UID, marks=needs_uid),
    ],
)


@x86_64
@sandboxed_levels
def test_kernel_objects_are_refused_and_limits_hold(world: World, level: Level) -> None:
    """The seccomp filter's channels are closed at both levels (syscall_filter's list), and
    a rank cannot fill more than its scratch nor open more files than its cap."""
    uid = free_uid() if level is Level.UID else sandbox.NOBODY
    limits = {"scratch_bytes": 8 << 20, "max_file_bytes": 8 << 20, "max_open_files": 64}
    box = world.sandbox(level, uid=uid, gid=uid, **limits)
    code, out, err = world.run(box, [*world.argv("kernel", python_for(uid)), "8", "64"])
    assert code == 0, err
    seen = json.loads(out)
    refused = {"lockf", "flock", "add_key", "keyctl", "ptrace", "shmget", "unshare"}
    refused |= {"fork", "spawn"}  # a new process (spawn: vfork's clone, then exec)
    assert {k: seen[k] for k in refused} == dict.fromkeys(refused, "PermissionError")
    assert seen["thread"] == "ok"  # clone3's ENOSYS: the C library falls back to clone
    assert seen["fill_scratch"] == "OSError" and seen["open_files"] == "OSError"
    big = world.base / "scratch" / "big.bin"
    assert not big.exists() if level is Level.NAMESPACES else big.stat().st_size <= 8 << 20


@x86_64
@sandboxed_levels
def test_a_call_through_another_abi_kills_the_whole_rank(world: World, level: Level) -> None:
    """Not only the calling thread: a rank with another thread would otherwise hang on."""
    uid = free_uid() if level is Level.UID else sandbox.NOBODY
    box = world.sandbox(level, uid=uid, gid=uid)
    code, out, err = world.run(box, world.argv("x32", python_for(uid)), timeout=20)
    assert "survived" not in out
    assert code == 128 + signal.SIGSYS, (code, err)


@x86_64
def test_without_the_filter_a_lock_is_a_channel(world: World) -> None:
    """What the filter closes is real: at ``none`` the same lock calls succeed."""
    code, out, err = world.run(world.sandbox(Level.NONE), world.argv("locks"))
    seen = json.loads(out)
    assert code == 0 and seen["lockf"] == seen["flock"] == "ok", err


def test_none_level_runs_as_is(world: World) -> None:
    box = world.sandbox(Level.NONE)
    seen = world.probe(box)
    assert seen["secret"] == "ANSWER = 42\n" and seen["uid"] == os.getuid()  # no isolation at all
    assert seen["write_scratch"] == "ok" and seen["unix"] == "pong:ping"


@sandboxed_levels
def test_torch_imports_at_the_default_cap(world: World, level: Level) -> None:
    uid = 65534 if level is Level.NAMESPACES else free_uid()
    if level is Level.UID and python_for(uid) != sys.executable:
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
        # The probe says when it runs (its scratch is the sandbox's own tmpfs); killed earlier,
        # torchrun would die while bubblewrap still builds the sandbox. The daemon the probe
        # tries to start is refused.
        assert select.select([proc.stdout], [], [], 30)[0], "the probe never started"
        assert proc.stdout.readline().strip() == "running"
        assert len(pids_with(world.token)) >= 4  # torchrun's stand-in, the wrapper, bwrap, it
        os.kill(proc.pid, signal.SIGKILL)  # torchrun dies
        assert wait_until(lambda: not pids_with(world.token), 5), pids_with(world.token)
    finally:
        kill_group(proc)


@needs_uid
def test_uid_rank_starts_no_daemon_and_dies_with_torchrun(world: World) -> None:
    """The filter refuses the rank a process of its own (a daemon would escape PDEATHSIG in
    a session of its own); the rank itself dies with torchrun, and nothing of its uid is
    left for ``kill_uid`` (test_isolation kills an escaped process of a run's uid)."""
    uid = free_uid()
    box = world.sandbox(Level.UID, uid=uid, gid=uid)
    proc = world.launch(box, world.argv("daemon", python_for(uid)))
    try:
        pid_file = world.base / "scratch" / "daemon.pid"
        assert wait_until(lambda: pid_file.exists() and pid_file.read_text(), 20)
        assert pid_file.read_text() == "refused"
        assert wait_until(lambda: identity.pids_of(uid) != [], 5)  # the rank, sleeping
        os.kill(proc.pid, signal.SIGKILL)  # torchrun dies: PDEATHSIG takes the rank
        assert wait_until(lambda: not pids_with(world.token), 5), pids_with(world.token)
        assert identity.kill_uid(uid) == 0
        assert identity.pids_of(uid) == []
    finally:
        kill_group(proc)


def test_detect_honours_requests_or_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sandbox.detect(sandbox.requested("none")) is Level.NONE
    monkeypatch.setenv(sandbox.ENV_VAR, "none")
    assert sandbox.requested() is Level.NONE and sandbox.requested("auto") is Level.NONE
    assert sandbox.detect(sandbox.requested()) is Level.NONE
    monkeypatch.setenv(sandbox.ENV_VAR, "auto")
    assert sandbox.requested() is None
    with pytest.raises(SandboxError, match="unknown sandbox level 'chroot'"):
        sandbox.requested("chroot")
    monkeypatch.setattr(sandbox.shutil, "which", lambda _: None)
    sandbox.unavailable.cache_clear()
    try:
        with pytest.raises(SandboxError, match="bwrap is not installed"):
            sandbox.detect(Level.NAMESPACES)
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
def test_a_gloo_rank_inside_gets_no_socket(world: World) -> None:
    """gloo's rendezvous store and its pairs are TCP sockets: inside, a rank has none (its one
    connection is the broker's), so a process group of a backend of its own never forms."""
    job = world.repo / "grader" / "job.py"  # bound in read-only
    job.write_text(GLOO_JOB)
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    box = world.sandbox(Level.NAMESPACES, memory_bytes=sandbox.DEFAULT_MEMORY, env=env)
    code, out, err = world.run(box, [sys.executable, str(job), world.token], timeout=90)
    assert code != 0 and "sum" not in out
    assert "EPERM" in out + err, (out + err)[
        -2000:
    ]  # torch: "The server socket has failed to bind ... EPERM"


def test_a_rank_wrapper_whose_torchrun_is_gone_starts_nothing(tmp_path: Path) -> None:
    """A wrapper orphaned before its first line ran (here: started by this process, not by
    torchrun, as if torchrun had died and the wrapper been handed to another parent) exits
    at once, as killed, without reading its job's plan or starting a sandbox."""
    done = subprocess.run(
        [sys.executable, "-m", "grader.launch.sandboxed"],
        env={**os.environ, "RANK": "0", "PYTHONPATH": str(REPO), "GRADER_JOB": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr) == (137, "")


def test_no_course_checkout_on_the_import_path_is_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instructor's PYTHONPATH may name the grader's checkout (with its reference), the
    folder above the course, or a folder inside it: the ranks read none of them, and still
    read the interpreter's own package folders."""
    checkout = tmp_path / "grader-checkout"
    (checkout / "tests" / "graded").mkdir(parents=True)
    (checkout / "tests" / "graded" / "grading.yaml").write_text("parts: {}\n")
    (checkout / "reference").mkdir()
    other_course = tmp_path / "course-copy"
    (other_course / "assignments").mkdir(parents=True)
    packages = tmp_path / "packages"
    packages.mkdir()
    course_dir = course.REPO_ROOT
    entries = [
        str(checkout),
        str(other_course),
        str(course_dir.parent),
        str(course_dir / "reference"),
    ]
    monkeypatch.setattr(sys, "path", [sys.path[0], *entries, str(packages), *sys.path[1:]])
    readable = {*view.interpreter(), *view.interpreter_files()}
    for entry in entries:
        assert Path(entry).resolve() not in readable, entry
    assert packages.resolve() in readable


def test_the_ranks_copy_of_the_grader_is_readable_in_a_course_closed_to_others(
    tmp_path: Path,
) -> None:
    """An editable install inside a course made unreadable to others (`chmod -R o-rwx`): the
    copy the ranks import is readable by every uid all the same."""
    package = tmp_path / "course" / "grader"
    (package / "rank").mkdir(parents=True)
    (package / "rank" / "__init__.py").write_text("")
    for path in (package / "rank" / "__init__.py", package / "rank", package):
        path.chmod(0o700 if path.is_dir() else 0o600)
    view.copy_readable(package, tmp_path / "lib" / "grader")
    for path in (tmp_path / "lib" / "grader").rglob("*"):
        assert path.stat().st_mode & 0o005 == (0o005 if path.is_dir() else 0o004), path
