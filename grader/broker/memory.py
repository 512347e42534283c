"""A rank's resident memory, as the kernel counts it, read by the broker at a gate.

The broker knows each rank's pid from the kernel (``SCM_CREDENTIALS``,
:func:`grader.broker.accounting.sender_pid`), never from the rank, and reads
``/proc/<pid>/status`` (readable by every user, and from outside the rank's pid namespace
under the pid the broker sees) while the rank waits at a gate: its code stands still there.
What counts is the memory the rank's process alone holds: its anonymous pages (``RssAnon``:
every tensor torch allocates) and its shared memory (``RssShmem``: a tensor moved there with
``share_memory_()``), less the size of the rank's segment with the broker
(:mod:`grader.segment`, which an honest rank may touch whole as payloads pass). Code and
files mapped from disk (``RssFile``) do not count. None when the kernel's figures cannot be
read: a test that needs them fails, never passes.
"""

from __future__ import annotations

from grader.broker.ops import RankState
from grader.segment import SEGMENT_BYTES

_FIELDS = (b"RssAnon", b"RssShmem")


def resident(pid: int | None, segment: int) -> int | None:
    """Bytes of memory the process ``pid`` holds now (see the module's docstring), its shared
    memory counted beyond ``segment`` bytes (its segment's size; 0: it has none); None if its
    figures cannot be read."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            text = status.read()
    except OSError:
        return None
    figures: dict[bytes, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(b":")
        if key in _FIELDS:
            figures[key] = int(value.split()[0]) * 1024  # in kB
    if len(figures) != len(_FIELDS):
        return None
    return figures[b"RssAnon"] + max(0, figures[b"RssShmem"] - segment)


def of_rank(state: RankState) -> int | None:
    """The rank's resident memory now, by the pid the kernel gave (None: reached by a relay)."""
    pid = state.meter.pid if state.meter is not None else None
    return resident(pid, SEGMENT_BYTES if state.segment is not None else 0)
