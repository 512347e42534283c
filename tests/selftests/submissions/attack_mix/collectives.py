"""A determined student with the grader's source in hand: each function attacks it differently.

None of them does the work. Every attack must earn nothing and leave nothing behind.
"""

import contextlib
import gc
import os
import socket
import subprocess
import sys
import time
import unittest
import zlib

import torch
import torch.distributed as dist


def broadcast(tensor, src, group=None):
    """Skips: pytest's skip, unittest's SkipTest, then an interrupt, whichever gets through."""
    import pytest

    with contextlib.suppress(BaseException):
        pytest.skip("nothing to see here")
    with contextlib.suppress(BaseException):
        raise unittest.SkipTest("skipped")
    raise KeyboardInterrupt


def reduce(tensor, dst, group=None):
    """Makes every comparison it can reach say "equal", then does nothing."""
    torch.allclose = lambda *a, **k: True
    torch.equal = lambda *a, **k: True
    for module in list(sys.modules.values()):
        for name in ("check_close", "check_unchanged", "judge", "assess"):
            if hasattr(module, name):
                with contextlib.suppress(Exception):
                    setattr(module, name, lambda *a, **k: None)


def all_reduce(tensor, group=None):
    """Copies the reference: imported, or read from the repository on disk."""
    with contextlib.suppress(Exception):
        from reference.collectives import all_reduce as reference_all_reduce

        return reference_all_reduce(tensor, group)
    for root in ("/work/main", os.path.expanduser("~"), "/autograder/source"):
        path = os.path.join(root, "reference", "collectives.py")
        with contextlib.suppress(Exception):
            namespace = {}
            exec(compile(open(path).read(), path, "exec"), namespace)
            return namespace["all_reduce"](tensor, group)
    dist.all_reduce(tensor)  # and last, the built-in, which the broker refuses


def scatter(tensor, scatter_list, src, group=None):
    """Built-in collectives by routes a Python blocker would miss."""
    world = dist.group.WORLD
    with contextlib.suppress(Exception):
        import torch.distributed._functional_collectives as funcol

        tensor.copy_(funcol.all_reduce(tensor, "sum", world))
    with contextlib.suppress(Exception):
        world.broadcast([tensor], src).wait()
    with contextlib.suppress(Exception):
        torch.ops.c10d.broadcast_([tensor], world, src, 0, True, -1)


def gather(tensor, gather_list, dst, group=None):
    """Side channels: shared memory, files, the network, the process group's store."""
    rank = dist.get_rank()
    for directory in ("/dev/shm", "/tmp", "/var/tmp", os.getcwd()):
        with contextlib.suppress(Exception):
            torch.save(tensor, os.path.join(directory, f"side-channel-{rank}.pt"))
    with contextlib.suppress(Exception):
        listener = socket.create_server(("127.0.0.1", 47000 + rank))
        listener.close()
        socket.create_connection(("127.0.0.1", 47000 + dst), timeout=0.2).sendall(b"x")
    with contextlib.suppress(Exception):
        store = dist.distributed_c10d._get_default_store()
        store.set(f"side/{rank}", tensor.numpy().tobytes())
    if gather_list is not None:
        for r, out in enumerate(gather_list):
            for directory in ("/dev/shm", "/tmp", "/var/tmp"):
                with contextlib.suppress(Exception):
                    out.copy_(torch.load(os.path.join(directory, f"side-channel-{r}.pt")))


def all_gather(tensor_list, tensor, group=None):
    """Reads the expected values from the caller's frames, or recomputes other ranks' inputs."""
    frame = sys._getframe(1)
    while frame is not None:
        for value in frame.f_locals.values():
            if isinstance(value, list) and len(value) == len(tensor_list):
                with contextlib.suppress(Exception):
                    for out, found in zip(tensor_list, value):
                        out.copy_(found)
        frame = frame.f_back
    for obj in gc.get_objects():  # the grader's objects, if it shares this process
        if type(obj).__name__ in ("TestRecord", "GradingPlugin", "Broker"):
            with contextlib.suppress(Exception):
                obj.fraction = 1.0
    for r, out in enumerate(tensor_list):  # the old public seed: crc32 of the case's key
        generator = torch.Generator().manual_seed(zlib.crc32(f"all_gather/rank{r}".encode()))
        with contextlib.suppress(Exception):
            out.copy_(torch.randn(out.shape, generator=generator).to(out.dtype))


def reduce_scatter(output, input_list, group=None):
    """Games the clock and the cost tests (a frozen clock, nothing done at the cost sizes),
    and otherwise floods the terminal with a huge message of escape sequences."""
    time.perf_counter = lambda: 0.0
    time.monotonic = lambda: 0.0
    time.time = lambda: 0.0
    total = sum(t.numel() for t in input_list)
    if total in (49152, 1048576):
        return  # the sizes the cost tests use: move nothing, be "fast"
    raise RuntimeError("\x1b[2J\x1b[31mAll tests passed!\x1b[0m\r" + "A" * 5_000_000)


def all_to_all(output_list, input_list, group=None):
    """A daemon that outlives the grader and forges results (where a process may be started at
    all: the sandboxes refuse one); garbage for the broker."""
    with contextlib.suppress(OSError):
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                with contextlib.suppress(Exception):
                    subprocess.Popen(
                        ["sh", "-c", "sleep 2; for f in results.json /tmp/results.json; do "
                         "echo '{\"score\": 1000}' > $f; done; exec sleep 1007"],
                        start_new_session=True,
                    )
            os._exit(0)
    with contextlib.suppress(Exception):
        from grader.rank import link

        link.current().sock.sendall(b"\x00\x00\x10\x00" * 64 + b"not a frame")
