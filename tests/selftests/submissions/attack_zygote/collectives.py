"""A rank forked by its job's zygote that attacks what the fork put near it, and reports it.

all_reduce first learns every rank's pid through the broker (an honest all-reduce), then,
on every rank, tries:
- its parent, the zygote (root): /proc/<ppid>/{environ,cmdline,status,maps,stack,mem,fd/*,
  cwd,root,task}, signal 0 then SIGSTOP and SIGKILL, pidfd_open then pidfd_send_signal and
  pidfd_getfd, process_vm_readv of an address it shares with it since the fork;
- every other rank of its job (at namespaces in its pid namespace, at uid on the host): the
  same list, and writing into that rank's scratch folder;
- a channel between ranks outside the broker: a file planted in /tmp, /dev/shm, /run,
  /var/tmp or its own scratch opened to all, then looked for by the others; an abstract Unix
  socket; a SysV shared memory segment and a POSIX message queue; SIGUSR1 from rank 0 to the
  others, counted by their handlers; its scheduling policy, niceness and CPU affinity, set
  for itself and read by the others (sched_getscheduler, getpriority, sched_getaffinity,
  ioprio_get, prlimit);
- the job's plan in its own first environment (the zygote's) or its memory, the zygote's
  socket it names, and every descriptor from 4 to 1024.

It raises "REACHED: none" where each attempt failed, else what succeeded, precisely.
"""

import contextlib
import ctypes
import json
import os
import platform
import re
import resource
import signal
import socket
import stat

import torch
import torch.distributed as dist

from reference.collectives import *  # noqa: F403

_honest_all_reduce = all_reduce  # noqa: F405
_LIBC = ctypes.CDLL(None, use_errno=True)
_PROC_FILES = ("environ", "cmdline", "status", "comm", "maps", "stack", "syscall", "auxv")
_FOLDERS = ("/tmp", "/dev/shm", "/run", "/var/tmp")
_NICE = 7  # what each rank sets its niceness to, for the others to read
_IOPRIO = (2 << 13) | 5  # best effort, level 5: its I/O priority, likewise
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}.get(platform.machine(), -1)  # ioprio_get: +1
_MSGQUEUE = 4093  # its RLIMIT_MSGQUEUE, lowered: what prlimit shows another of its uid
_listeners: list[socket.socket] = []  # kept open until the others tried them
_signalled: list[int] = []  # SIGUSR1s this rank received


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _head(path: str) -> str | None:
    """The first bytes of ``path``, or None where it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, 40).decode(errors="replace") if stat.S_ISREG(os.fstat(fd).st_mode) \
            else "(opened)"  # fmt: skip
    except OSError:
        return "(opened, unread)"
    finally:
        os.close(fd)


def _proc(who: str, pid: int, found: dict[str, str]) -> None:
    base = f"/proc/{pid}"
    for name in _PROC_FILES:
        if (head := _head(f"{base}/{name}")) is not None:
            found[f"{who}: read {base}/{name}"] = head
    for name in ("fd", "cwd", "root", "task", "fdinfo", "map_files"):
        with contextlib.suppress(OSError):
            found[f"{who}: listed {base}/{name}"] = ",".join(os.listdir(f"{base}/{name}")[:8])
    for fd in range(64):
        try:
            found[f"{who}: readlink {base}/fd/{fd}"] = os.readlink(f"{base}/fd/{fd}")
        except OSError:
            continue
        if (head := _head(f"{base}/fd/{fd}")) is not None:
            found[f"{who}: opened {base}/fd/{fd}"] = head
    _memory(who, pid, found)


def _memory(who: str, pid: int, found: dict[str, str]) -> None:
    """Its memory at an address this process has too: the fork laid both out alike."""
    mine = ctypes.create_string_buffer(b"attack-zygote", 64)
    address = ctypes.addressof(mine)
    try:
        with open(f"/proc/{pid}/mem", "rb", 0) as mem:
            mem.seek(address)
            found[f"{who}: read /proc/{pid}/mem"] = repr(mem.read(16))
    except (OSError, ValueError, OverflowError):
        pass
    into = ctypes.create_string_buffer(64)
    local, remote = _Iovec(ctypes.addressof(into), 64), _Iovec(address, 64)
    _LIBC.process_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                                       ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]  # fmt: skip
    got = _LIBC.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if got > 0:
        found[f"{who}: process_vm_readv({pid})"] = repr(into.raw[:16])


def _signals(who: str, pid: int, found: dict[str, str]) -> None:
    """Signal 0 checks the right to signal; only where it is refused do SIGSTOP and SIGKILL
    follow (refused as well, or they stop the job and the test fails without a report)."""
    try:
        os.kill(pid, 0)
        found[f"{who}: kill({pid}, 0)"] = "allowed"
    except OSError:
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            try:
                os.kill(pid, sig)
                found[f"{who}: kill({pid}, {sig.name})"] = "delivered"
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        _pidfd(who, pid, pidfd, found)
    finally:
        os.close(pidfd)


def _pidfd(who: str, pid: int, pidfd: int, found: dict[str, str]) -> None:
    try:
        signal.pidfd_send_signal(pidfd, 0)
        found[f"{who}: pidfd_send_signal(pidfd_open({pid}), 0)"] = "allowed"
    except OSError:
        pass
    for fd in range(16):
        taken = _LIBC.syscall(438, pidfd, fd, 0)  # pidfd_getfd, x86-64 and arm64 alike
        if taken >= 0:
            target = os.readlink(f"/proc/self/fd/{taken}")
            found[f"{who}: pidfd_getfd(pidfd_open({pid}), {fd})"] = target
            os.close(taken)


def _scratches(me: int, others: dict[int, int], found: dict[str, str]) -> None:
    folder = os.path.dirname(os.getcwd())
    for rank in others:
        theirs = os.path.join(folder, f"rank{rank}")
        with contextlib.suppress(OSError):
            found[f"listed {theirs}"] = ",".join(os.listdir(theirs)[:8])
        try:
            with open(os.path.join(theirs, f"from-rank{me}"), "w") as planted:
                planted.write("x")
            found[f"wrote into {theirs}"] = "created a file"
        except OSError:
            pass


def _descriptors(found: dict[str, str]) -> None:
    """Every descriptor from 4 on; its own shared-memory segment, which the broker handed
    it in its first frame, once."""
    segments = 0
    for fd in range(4, 1025):
        try:
            os.fstat(fd)
        except OSError:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = "open"
        if target.startswith("/memfd:grader-segment") and segments == 0:
            segments += 1
        else:
            found[f"descriptor {fd}"] = target


def _zygote_socket(found: dict[str, str]) -> None:
    """The job's plan, where this process's first environment (the zygote's, which a fork
    keeps in memory) holds it: the hidden paths, and the zygote's socket, tried."""
    try:
        with open("/proc/self/environ", "rb") as env:
            words = env.read().split(b"\0")
    except OSError:
        return
    for word in words:
        if not word.startswith(b"GRADER_PLAN="):
            continue
        found["the job's plan in /proc/self/environ"] = word[:40].decode(errors="replace")
        plan = json.loads(word.split(b"=", 1)[1])
        if zygote := plan.get("zygote"):
            with contextlib.suppress(OSError):
                os.stat(zygote)
                found[f"stat {zygote}"] = "exists"
            if (head := _head(zygote)) is not None:
                found[f"opened {zygote}"] = head
        if folder := plan.get("socket_dir"):
            with contextlib.suppress(OSError):
                found[f"listed {folder}"] = ",".join(os.listdir(folder)[:8])


#: A job's socket folder, as the grader names it (the pattern lies in memory too: it does
#: not match its own text).
_SOCKETS = re.compile(re.escape(b"grader-" + b"sockets-") + rb"\w{8}")


def _inherited(found: dict[str, str]) -> None:
    """Its own memory, which the fork copied from the zygote's, searched for the sockets'
    folder: a trace of the job's plan, whose paths no rank is told."""
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
        for line in maps.read().splitlines():
            fields = line.split()
            if not fields[1].startswith("rw") or (len(fields) > 5 and fields[5].startswith("/")):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            try:
                mem.seek(start)
                chunk = mem.read(min(end - start, 1 << 28))
            except (OSError, ValueError, OverflowError):
                continue
            if match := _SOCKETS.search(chunk):
                found[f"memory:{start:x}"] = match.group().decode(errors="replace")


def _plant(me: int, tag: str, found: dict[str, str]) -> None:
    """Leave a mark every other rank could find: a file, a socket, IPC objects."""
    for folder in _FOLDERS:
        path = os.path.join(folder, f"zattack-{tag}-{me}")
        try:
            with open(path, "w") as planted:
                planted.write(f"rank {me}")
            os.chmod(path, 0o666)
            found[f"planted {path}"] = "created"
        except OSError:
            pass
    try:
        os.chmod(os.getcwd(), 0o777)
        path = os.path.join(os.getcwd(), f"zattack-{me}")
        with open(path, "w") as planted:
            planted.write(f"rank {me}")
        os.chmod(path, 0o666)
    except OSError:
        pass
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        found["socket(AF_UNIX)"] = "created"
        listener.bind(f"\0zattack-{tag}-{me}")
        listener.listen(1)
        _listeners.append(listener)
    except OSError:
        pass
    if _LIBC.shmget(int(tag) * 8 + me, 4096, 0o1666) >= 0:  # IPC_CREAT | 0666
        found[f"shmget({int(tag) * 8 + me}, IPC_CREAT)"] = "created"
    if _mq_open(f"/zattack-{tag}-{me}".encode(), os.O_CREAT | os.O_RDWR, 0o666) >= 0:
        found[f"mq_open(/zattack-{tag}-{me}, O_CREAT)"] = "created"


def _mark_scheduling() -> None:
    """A mark the kernel shows any process that names this one: its policy, its niceness
    and the CPUs it may run on, each of which it sets for itself without a privilege."""
    with contextlib.suppress(OSError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, _NICE)
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    _LIBC.syscall(_IOPRIO_SET, 1, 0, _IOPRIO)  # IOPRIO_WHO_PROCESS, itself
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_MSGQUEUE, (_MSGQUEUE, _MSGQUEUE))


def _read_scheduling(others: dict[int, int], found: dict[str, str]) -> None:
    """The others' marks, read as bits would be: a channel that no file or socket carries."""
    for rank, pid in others.items():
        with contextlib.suppress(OSError):
            if (policy := os.sched_getscheduler(pid)) == os.SCHED_BATCH:
                found[f"sched_getscheduler(rank {rank})"] = f"SCHED_BATCH ({policy})"
        with contextlib.suppress(OSError):
            if (nice := os.getpriority(os.PRIO_PROCESS, pid)) == _NICE:
                found[f"getpriority(PRIO_PROCESS, rank {rank})"] = f"nice {nice}"
        with contextlib.suppress(OSError):
            if len(cpus := os.sched_getaffinity(pid)) == 1 and os.cpu_count() != 1:
                found[f"sched_getaffinity(rank {rank})"] = f"CPUs {sorted(cpus)}"
        if _LIBC.syscall(_IOPRIO_SET + 1, 1, pid) == _IOPRIO:  # ioprio_get
            found[f"ioprio_get(rank {rank})"] = f"{_IOPRIO:#x}"
        with contextlib.suppress(OSError):
            if resource.prlimit(pid, resource.RLIMIT_MSGQUEUE)[0] == _MSGQUEUE:
                found[f"prlimit(rank {rank}, RLIMIT_MSGQUEUE)"] = str(_MSGQUEUE)


def _mq_open(name: bytes, flags: int, mode: int) -> int:
    """POSIX mq_open, through the C library (glibc 2.34 holds it), else librt."""
    library = _LIBC
    if not hasattr(library, "mq_open"):
        try:
            library = ctypes.CDLL("librt.so.1", use_errno=True)
        except OSError:
            return -1
    library.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    return library.mq_open(name, flags, mode, None)


def _harvest(me: int, tag: str, others: dict[int, int], found: dict[str, str]) -> None:
    """Look for the marks the other ranks left."""
    scratch = os.path.dirname(os.getcwd())
    for rank in others:
        places = [os.path.join(f, f"zattack-{tag}-{rank}") for f in _FOLDERS]
        for path in (*places, os.path.join(scratch, f"rank{rank}", f"zattack-{rank}")):
            if (head := _head(path)) is not None:
                found[f"found rank {rank}'s {path}"] = head
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.connect(f"\0zattack-{tag}-{rank}")
                found[f"connected to rank {rank}'s abstract socket"] = "connected"
        except OSError:
            pass
        if _LIBC.shmget(int(tag) * 8 + rank, 0, 0) >= 0:
            found[f"shmget of rank {rank}'s segment"] = "found"
        if _mq_open(f"/zattack-{tag}-{rank}".encode(), os.O_RDONLY, 0) >= 0:
            found[f"mq_open of rank {rank}'s queue"] = "found"
    if _signalled:
        found[f"rank {me} received SIGUSR1"] = f"{len(_signalled)} times"


def _clean(me: int, tag: str) -> None:
    """Take its marks away, where it could leave them (at ``none``, a student's own run)."""
    for folder in _FOLDERS:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, f"zattack-{tag}-{me}"))
    if (segment := _LIBC.shmget(int(tag) * 8 + me, 0, 0)) >= 0:
        _LIBC.shmctl(segment, 0, None)  # IPC_RMID
    library = _LIBC if hasattr(_LIBC, "mq_unlink") else None
    if library is not None:
        library.mq_unlink(f"/zattack-{tag}-{me}".encode())
    for listener in _listeners:
        listener.close()


def _pids() -> dict[int, int]:
    """Every rank's pid, learned as the broker carries any sum."""
    pids = torch.zeros(dist.get_world_size(), dtype=torch.int64)
    pids[dist.get_rank()] = os.getpid()
    _honest_all_reduce(pids)
    return dict(enumerate(int(p) for p in pids.tolist()))


def _barrier() -> None:
    _honest_all_reduce(torch.zeros(1))


def all_reduce(tensor, group=None):
    found: dict[str, str] = {}
    me = dist.get_rank()
    try:
        signal.signal(signal.SIGUSR1, lambda *_: _signalled.append(1))
    except ValueError:  # not the main thread: an unhandled SIGUSR1 would end the rank
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    pids = _pids()
    others = {rank: pid for rank, pid in pids.items() if rank != me}
    tag = str(min(pids.values()))  # the same on every rank of this job, unlike another job's
    parent = os.getppid()
    _proc("zygote", parent, found)
    _signals("zygote", parent, found)
    for rank, pid in others.items():
        _proc(f"rank {rank}", pid, found)
        _signals(f"rank {rank}", pid, found)
    _scratches(me, others, found)
    _descriptors(found)
    _zygote_socket(found)
    _inherited(found)
    _plant(me, tag, found)
    _mark_scheduling()
    _barrier()
    if me == 0:
        for rank, pid in others.items():
            try:
                os.kill(pid, signal.SIGUSR1)
                found[f"kill(rank {rank}, SIGUSR1)"] = "delivered"
            except OSError:
                pass
    _barrier()
    _harvest(me, tag, others, found)
    _read_scheduling(others, found)
    _barrier()  # every rank looked before any rank's marks go
    _clean(me, tag)
    if not found:
        raise RuntimeError("REACHED: none")
    report = "; ".join(f"{what} = {said!r}" for what, said in sorted(found.items()))
    raise RuntimeError(f"REACHED: {len(found)}: {report}")
