"""What the ranks of a job see of this machine: the sandbox's policy, as data.

Two views of one policy. The mounts of the ``namespaces`` level: :func:`hidden` (masked)
and :func:`interpreter` (bound back readable, for Python and torch). The allow-list every
sandboxed rank applies to itself with Landlock (:func:`allowed`), the ``uid`` level's wall
and a second one behind the mounts: the system's libraries, the interpreter and its
packages, the grader's rank side and the job's submission, read-only; a few devices; its
own scratch and process (:func:`grader.sandbox.landlock.own_rules`). Nothing else: not
``/tmp``, not another process's ``/proc``, not the course, wherever it lies.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

from grader.course import config as course
from grader.course.secret import secret_path
from grader.device import Device
from grader.sandbox.landlock import DEVICE, READ, Access, Rule

# What the ranks see of the machine's root: the system, nothing else (another checkout of the
# course, with its reference, may lie anywhere outside these).
_SYSTEM = {"bin", "boot", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "run", "sbin",
           "sys", "tmp", "usr"}  # fmt: skip


def hidden(work: Path) -> list[Path]:
    """What the ranks must not see: every top-level directory but the system's (the course's
    checkouts, with the reference, the hidden tests and the configuration; home directories;
    the secret), the grader's work directory, and the course wherever it lies."""
    tops = [Path("/") / name for name in sorted(os.listdir("/")) if name not in _SYSTEM]
    return [*tops, course.REPO_ROOT, work, Path.home(), secret_path().parent]


def interpreter() -> list[Path]:
    """What the ranks need back: Python, and the directories it imports packages from (torch),
    but not the directory the grader was started in, nor anything inside the course."""
    found = [Path(sys.base_prefix), Path(sys.prefix)]
    found += [path for path in import_folders() if path.is_dir()]
    return list(dict.fromkeys(found))


def import_folders() -> list[Path]:
    """The folders on the interpreter's path (``sys.path`` but the first, the folder it was
    started in) that the ranks may read: none inside the course or holding it, and none
    that is a course checkout of its own (``assignments/`` or a grading configuration in it:
    an instructor's ``PYTHONPATH`` pointing at the grader's checkout, with its reference)."""
    repo = course.REPO_ROOT.resolve()
    found = []
    for entry in filter(None, sys.path[1:]):
        path = Path(entry).resolve()
        if path.is_relative_to(repo) or repo.is_relative_to(path) or _holds_a_course(path):
            continue
        found.append(path)
    return found


def _holds_a_course(path: Path) -> bool:
    return (path / "assignments").is_dir() or (path / course.RELATIVE_CONFIG).is_file()


#: What the dynamic loader and the C library read at a process's start and after: the shared
#: libraries, the loader's cache, the time zone, and who a uid is.
_SYSTEM_READ = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache",
                "/etc/localtime", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf",
                "/proc/cpuinfo", "/proc/meminfo", "/sys/devices/system/cpu")  # fmt: skip
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
#: A rank on a GPU: NVIDIA's device files (read, write, ioctl) and the driver's state.
_GPU_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-caps")
_GPU_READ = ("/proc/driver/nvidia", "/sys/bus/pci", "/sys/devices")


def allowed(readable: list[Path], device: Device = Device.CPU) -> list[Rule]:
    """A rank's allow-list, but for its scratch and process: the system's libraries, the
    interpreter (:func:`interpreter_files`), the ``readable`` folders (the grader's rank
    side, the job's submission), a few devices."""
    rules = [Rule(p, READ) for p in (*_SYSTEM_READ, *map(str, interpreter_files()))]
    rules += [Rule(str(p), READ) for p in readable]
    rules += [Rule(p, DEVICE) for p in _DEVICES]
    if device is Device.CUDA:
        gpus = sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))
        rules += [Rule(p, DEVICE | Access.IOCTL_DEV) for p in (*_GPU_DEVICES, *gpus)]
        rules += [Rule(p, READ) for p in _GPU_READ]
    return rules


def interpreter_files() -> list[Path]:
    """The interpreter and what it imports from: its executable, standard library and
    package folders (a venv's and its base's), not the course, nor the folder it was
    started in."""
    paths = sysconfig.get_paths()
    found = [Path(sys.executable), Path(sys.executable).resolve()]
    found += [Path(paths[key]) for key in ("stdlib", "platstdlib", "purelib", "platlib")]
    found += import_folders()
    return [p for p in dict.fromkeys(found) if p.exists()]


def rank_side(work: Path) -> Path:
    """The folder the ranks import the grader from: a copy of the package in the run's work
    folder, made once. The ranks never read the grader where it is installed, which may be
    inside a course made unreadable to them (an editable install)."""
    lib = work / "lib"
    if not (lib / "grader").is_dir():
        package = Path(__file__).resolve().parents[1]
        lib.mkdir(mode=0o755, exist_ok=True)
        copy_readable(package, lib / "grader")
    return lib


def copy_readable(source: Path, target: Path) -> None:
    """A copy of the package ``source`` that every uid may read, whatever the modes of the
    original (a course made unreadable to others with ``chmod -R o-rwx``)."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    for folder, _, files in os.walk(target):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)
