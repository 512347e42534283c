"""A rank that walks everything it can reach, as a determined student would, and reports it.

all_reduce tries, on every rank:
- every listening TCP port and every Unix socket the kernel lists (``/proc/net``), each
  abstract name, and a fresh socket of every family: any connection is a hole;
- every process's command line and environment (``/proc/*/cmdline``, ``environ``), and every
  path those name: another grading's work folder, the reference's, the course;
- every file under ``/`` it can list, opened and its first bytes read (``/tmp``,
  ``/dev/shm``, the course, the secret, homes), and files it can create outside its scratch;
- what its process inherited: every descriptor it holds (a socket beside its connection, a
  file it could not open itself) and its own memory, searched for a grader's secret, a
  course secret as the tests make them, or another submission's marker (a rank forked from
  a process that held them would find them there).

It then raises what it reached that is not the interpreter's, the system's libraries or its
own: "REACHED: none" where the wall holds, else the paths and the first bytes read, which
the test looks for in results.json (any byte of the reference, the secret, the hidden tests
or another submission fails it).
"""

import os
import re
import socket
import stat
import sys
import time

from reference.collectives import *  # noqa: F403

_OWN = ("/proc/self", f"/proc/{os.getpid()}", "/proc/thread-self", os.getcwd(), sys.executable,
        os.path.realpath(sys.executable))
_LIBRARIES = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib", "/etc", "/dev/null",
              "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/sys/devices/system/cpu",
              "/proc/cpuinfo", "/proc/meminfo")  # fmt: skip
#: Where to look besides what it can list: where courses, homes and graders' folders lie.
_ROOTS = ("/", "/tmp", "/dev/shm", "/var/tmp", "/run", "/root", "/home", "/srv", "/opt", "/work",
          "/autograder", "/proc")  # fmt: skip
#: What it would look for by name in every folder it knows of, listable or not.
_GUESSES = ("reference/collectives.py", "reference/context_parallel.py",
            "tests/graded/grading.yaml", "tests/graded/test_collectives.py",
            "reference/import/assignments/collectives.py", "import/assignments/collectives.py",
            ".config/grader/secret", "source/reference/collectives.py")  # fmt: skip


def _expected(path: str) -> bool:
    """What any rank reads: the interpreter, the libraries, the grader's rank side, its own."""
    own = (*_OWN, *(p for p in sys.path if p and p != "/"))
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in (*own, *_LIBRARIES))


def _read(path: str, found: dict[str, str]) -> None:
    if _expected(path):
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO or a tty never blocks it
    except OSError:
        return
    try:
        head = os.read(fd, 48) if stat.S_ISREG(os.fstat(fd).st_mode) else b"(opened)"
    except OSError:
        head = b"(opened)"
    finally:
        os.close(fd)
    found[path] = head.decode(errors="replace")


def _walk(found: dict[str, str], budget: list[int]) -> None:
    known = {os.path.dirname(p) for p in sys.path if p} | {os.getcwd()}
    known |= {os.path.dirname(p) for p in known} | {os.path.dirname(p) for p in known}
    for root in sorted(known | set(_ROOTS)):
        for guess in _GUESSES:
            _read(os.path.join(root, guess), found)
        for folder, dirs, files in os.walk(root, topdown=True):
            dirs[:] = [d for d in dirs if not _expected(os.path.join(folder, d))]
            if folder == "/proc":  # processes: their files are _processes's
                dirs[:] = [d for d in dirs if not d.isdigit() and d not in ("self", "thread-self")]
            for name in files:
                budget[0] -= 1
                if budget[0] < 0:
                    return
                _read(os.path.join(folder, name), found)


def _processes(found: dict[str, str]) -> None:
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:  # unlisted: guessed, as pids are small numbers
        pids = [str(pid) for pid in range(1, 1 << 15)]
    deadline = time.monotonic() + 3  # within the call's time limit, on a busy machine too
    for pid in pids:
        if time.monotonic() > deadline:
            return
        for what in ("cmdline", "environ"):
            path = f"/proc/{pid}/{what}"
            try:
                with open(path, "rb") as f:
                    words = f.read().split(b"\0")
            except OSError:
                continue
            if pid != str(os.getpid()):
                found[path] = b" ".join(words)[:48].decode(errors="replace")
            for word in words:  # a path on another's command line: where its files are
                for named in re.findall(rb"/[\w./-]+", word):
                    _open_named(named.decode(errors="replace"), found)


def _open_named(path: str, found: dict[str, str]) -> None:
    if os.path.isdir(path):
        try:
            for name in os.listdir(path)[:50]:
                _read(os.path.join(path, name), found)
        except OSError:
            return
    else:
        _read(path, found)


def _listening() -> list[tuple[int, object]]:
    """(family, address) of every TCP listener and Unix socket /proc/net lists."""
    targets: list[tuple[int, object]] = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = open(f"/proc/net/{name}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                port = int(fields[1].rsplit(":", 1)[1], 16)
                targets.append((family, ("127.0.0.1", port) if family == socket.AF_INET
                                else ("::1", port)))  # fmt: skip
    try:
        for line in open("/proc/net/unix").read().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8:
                path = fields[7]
                targets.append((socket.AF_UNIX, "\0" + path[1:] if path[0] == "@" else path))
    except OSError:
        pass
    return targets


def _connections(found: dict[str, str]) -> None:
    families = [socket.AF_INET, socket.AF_INET6, socket.AF_UNIX, socket.AF_NETLINK,
                getattr(socket, "AF_PACKET", 17), getattr(socket, "AF_VSOCK", 40)]  # fmt: skip
    for family in families:
        try:
            socket.socket(family, socket.SOCK_DGRAM if family == 16 else socket.SOCK_STREAM).close()
            found[f"socket:{family}"] = "a socket of its own"
        except OSError:
            pass
    for family, address in _listening()[:200]:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(1)
                s.connect(address)
                found[f"connect:{address!r}"] = "connected"
        except OSError:
            pass


def _writes(found: dict[str, str]) -> None:
    for folder in ("/tmp", "/dev/shm", "/var/tmp", "/run", os.path.expanduser("~")):
        path = os.path.join(folder, f"wall-{os.getpid()}")
        try:
            with open(path, "w") as f:
                f.write("x")
            os.unlink(path)
            if not _expected(path):
                found[f"write:{folder}"] = "created a file"
        except OSError:
            pass


def _descriptors(found: dict[str, str]) -> None:
    sockets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            sockets.append(f"fd:{fd}")
        elif target.startswith("/") and fd not in ("1", "2"):  # stdout and stderr: its log
            _read(target, found)
    for fd in sockets[1:]:  # one is its connection, which it cannot tell from another
        found[fd] = "a second socket"


#: A secret as the grader holds it, a course's as the tests make it, another's marker: each a
#: prefix and what follows it (the patterns lie in memory too: none matches its own text).
_SECRETS = ((b"GRADER_" + b"SECRET=", rb"[\w-]{8}"), (b"wall-" + b"secret-", rb"[0-9a-f]{32}"),
            (b"VIC" + b"TIM-", rb"[0-9a-f]{32}"))  # fmt: skip


def _memory(found: dict[str, str]) -> None:
    patterns = [re.compile(re.escape(prefix) + rest) for prefix, rest in _SECRETS]
    deadline = time.monotonic() + 3
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
        for line in maps.read().splitlines():
            fields = line.split()
            if not fields[1].startswith("rw") or (len(fields) > 5 and fields[5].startswith("/")):
                continue  # the secrets would be in the heap and anonymous memory
            start, end = (int(x, 16) for x in fields[0].split("-"))
            for at in range(start, end, 1 << 23):
                if time.monotonic() > deadline:
                    return
                try:
                    mem.seek(at)
                    chunk = mem.read(min(1 << 23, end - at))
                except (OSError, ValueError, OverflowError):
                    break
                for pattern in patterns:
                    if match := pattern.search(chunk):
                        found[f"memory:{at:x}"] = match.group().decode(errors="replace")


#: What it reached, most telling first: the report is cut at 2000 characters.
_KINDS = (
    ("connections", lambda p: p.startswith(("connect:", "socket:"))),
    ("writes", lambda p: p.startswith("write:")),
    ("course", lambda p: re.search(r"/reference/|/tests/graded|secret|/grader-[\w]{8}|/import/", p)),
    ("processes", lambda p: p.startswith("/proc/")),
    ("other files", lambda p: True),
)


def _kind(path: str) -> int:
    return next(i for i, (_, matches) in enumerate(_KINDS) if matches(path))


def all_reduce(tensor, group=None):  # noqa: ARG001
    found: dict[str, str] = {}
    _descriptors(found)
    _memory(found)
    _connections(found)
    _processes(found)
    _writes(found)
    _walk(found, [20_000])
    if not found:
        raise RuntimeError("REACHED: none")
    kinds = [_kind(path) for path in found]
    counts = ", ".join(f"{name} {kinds.count(i)}" for i, (name, _) in enumerate(_KINDS))
    ordered = sorted(found.items(), key=lambda item: (_kind(item[0]), item[0]))
    report = "; ".join(f"{path} = {head!r}" for path, head in ordered)
    raise RuntimeError(f"REACHED: {len(found)} ({counts}): {report}")
