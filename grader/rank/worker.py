"""What runs on a rank, inside the sandbox, once its entry point (:mod:`grader.rank.__main__`)
has applied its allow-list.

It connects to the trusted broker, makes ``broker`` the process-group
backend, and then runs the calls the grader sends, one after the other: a
function of the submission (``collectives.all_reduce``) or a scenario of the
grader's (``data_parallel.train``, in :mod:`grader.scenarios`, which drives
the student's classes), on arguments the grader made. It sends back what
the call returned and the caller's own argument objects after the call. A
test's first call starts the submission afresh (:mod:`grader.rank.fresh`), so
that nothing it kept (a global, a class attribute, a cache) passes from one
test to the next. It decides nothing: it holds no expected value, no seed and
no clock that counts, and whatever it says is checked by the trusted side.
"""

from __future__ import annotations

import errno
import gc
import importlib
import os
import sys
import threading
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from grader import protocol, sandbox, wire
from grader.device import Device, of_rank
from grader.rank import backend, frames, fresh
from grader.rank.link import BrokerLink
from grader.sandbox import syscall_filter
from grader.wire import Frame


def main(connection: int, import_dir: Path) -> int:
    """Serve the broker's calls on the descriptor ``connection`` (connected by the trusted
    wrapper: a rank opens no socket), importing the submission from ``import_dir``."""
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    sys.path[:0] = [str(import_dir)]
    sys.path_hooks.insert(0, fresh.compiled_once(import_dir))
    sys.path_importer_cache.pop(str(import_dir), None)
    frames.configure(import_dir)
    link = BrokerLink(connection, rank)
    main_thread = threading.main_thread().ident
    link.stack_reader = lambda: _student_stack(main_thread)
    backend.register(link)
    _form_group(rank, world_size)
    device = _device(rank)
    # Torch's hundreds of thousands of objects would be walked by every full collection,
    # some 15 ms of CPU now and then in whichever call triggers it: the local work the
    # performance tests time would depend on the garbage collector's moods. Frozen, the
    # collector leaves them alone (they live as long as the process anyway).
    gc.collect()
    gc.freeze()
    pristine = fresh.Pristine.now()
    link.post(protocol.HELLO, rank=rank)
    while (frame := link.calls.get()) is not None:
        size = frame.header.get("world_size", world_size)
        if size != dist.get_world_size():
            _form_group(rank, size)
        if frame.header.get("fresh"):
            pristine.restore(import_dir)
        _run_call(link, frame, device)
    return 0


def _form_group(rank: int, world_size: int) -> None:
    """The default process group of ranks 0..world_size-1: one job serves every world size."""
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ["WORLD_SIZE"] = str(world_size)
    dist.init_process_group(
        backend.BACKEND_NAME, store=dist.HashStore(), rank=rank, world_size=world_size
    )


def _device(rank: int) -> torch.device:
    """The rank's GPU when the grader asked for one per rank, else the CPU."""
    if of_rank() is Device.CUDA and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _run_call(link: BrokerLink, frame: Frame, device: torch.device) -> None:
    call = frame.header.get("call")
    try:
        target = _resolve(link, frame.header)
        args = _to_device(wire.decode(frame.header["args"], frame.buffers), device)
        kept = _keep(args)
        returned = target(*args)
        node, buffers = wire.pack({"returned": returned, "args": kept})
        rebound = _rebound(args, kept)
    except BaseException as err:  # everything, SystemExit and KeyboardInterrupt too
        error = protocol.RankError(
            type(err).__name__,
            protocol.clean(_message(err)),
            tuple(frames.student_frames(err.__traceback__)),
            frames.innermost_student_function(err.__traceback__),
            _refused_by_sandbox(err),
        )
        link.post(protocol.FAILURE, call=call, error=error.to_wire())
        return
    link.post(protocol.RESULT, buffers, call=call, value=node, rebound=rebound)


def _resolve(link: BrokerLink, header: dict[str, Any]) -> Any:
    """The student's function, or the grader's scenario bound to the student's module."""
    if "scenario" in header:
        part, name = header["scenario"].split(".")
        student = _import_student(link, part)
        scenario = getattr(importlib.import_module(f"grader.scenarios.{part}"), name)
        return lambda *args: scenario(student, *args)
    part, name = header["function"].split(".")
    return getattr(_import_student(link, part), name)


def _import_student(link: BrokerLink, part: str) -> ModuleType:
    module = f"assignments.{part}"
    if module in sys.modules and sys.modules[module] is not None:
        return sys.modules[module]
    link.post(protocol.IMPORTING, module=module)
    importlib.invalidate_caches()  # staged after this rank started (watch mode's ranks ahead)
    loaded = importlib.import_module(module)
    link.post(protocol.IMPORTED, module=module)
    return loaded


def _to_device(value: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list | tuple):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _keep(value: Any) -> Any:
    """A copy of the argument structure that holds the very tensor objects passed in:
    what the caller owns, whatever the callee rebinds in its lists."""
    if isinstance(value, list | tuple):
        return type(value)(_keep(v) for v in value)
    if isinstance(value, dict):
        return {k: _keep(v) for k, v in value.items()}
    return value


def _rebound(args: Any, kept: Any, path: str = "args") -> list[str]:
    """Where the callee replaced a tensor of the caller's lists instead of filling it in."""
    found = []
    if isinstance(args, list | tuple) and isinstance(kept, list | tuple):
        if len(args) != len(kept):
            found.append(f"{path} (its length changed)")
        for i, (now, before) in enumerate(zip(args, kept, strict=False)):
            if isinstance(before, torch.Tensor):
                found += [f"{path}[{i}]"] if now is not before else []
            else:
                found += _rebound(now, before, f"{path}[{i}]")
    return found


def _message(err: BaseException) -> str:
    text = str(err)
    if isinstance(err, SyntaxError):
        return f"{err.msg} ({frames.display_path(err.filename or '?')}, line {err.lineno})"
    if isinstance(err, SystemExit):
        return f"sys.exit({err.code!r}) was called"
    if _refused_by_sandbox(err):
        refused = ", ".join(syscall_filter.REFUSED)
        return f"{text}: the sandbox refuses this system call ({refused}; docs/trust.md says why)"
    return text


def _refused_by_sandbox(err: BaseException) -> bool:
    """A system call's EPERM, in a sandboxed rank, that names no file: the filter's refusal."""
    return (
        isinstance(err, PermissionError)
        and err.errno == errno.EPERM
        and err.filename is None
        and os.environ.get(sandbox.ENV_VAR, sandbox.Level.NONE.value) != sandbox.Level.NONE.value
    )


def _student_stack(thread_id: int | None) -> list[str]:
    frame = sys._current_frames().get(thread_id or 0)
    if frame is None:
        return []
    return [
        f"{frames.display_path(s.filename)}:{s.lineno} in {s.name}"
        for s in traceback.extract_stack(frame)
        if frames.is_student_file(s.filename)
    ]
