"""Every message between the trusted grader and a rank, declared in one place.

Frames (:mod:`grader.wire`) carry a ``type``; each side handles a type with a
method of its own (``broker_<type>`` on a rank; in the broker, the handler its table
names, :class:`grader.broker.server.Broker`). What a rank says is untrusted: the
broker reads it through the typed records below, which validate every field and clean
every text (length capped, control characters removed) before it can reach a verdict,
the terminal or results.json.

Rank to broker::

    hello      {rank}                                  once, when it serves: the rank is up
    segment    {}                                      it mapped the segment it was given
    importing  {module} / imported {module}            around the submission's import
    send       {op, peer, group, tag, dtype, numel, shape?, strides?, at} + payload
    recv       {op, peer, group, tag, dtype, numel, shape?, strides?, at}
    collective {op, name, group, inputs, outputs, root?, reduce_op?, form?, whole?, at}
                                                       + payloads (a tensor described as
                                                       {dtype, numel, shape?, strides?})
    wait       {op, block}                             hand op's outcome over (block: the rank
                                                       waits for it; else a test or a future)
    result     {call, value, rebound}                  + tensors: the call returned
    failure    {call, error}                           the call raised
    stack      {frames}                                answer to dump_stack
    mark       {label}                                 a scenario's point in the trace
    gate       {op, label}                             a scenario's gate: answered when it opens

Broker to rank::

    segment    {}                                      + its shared memory's descriptor
    call       {call, function | scenario, args,       + tensors
                world_size, fresh}                     (fresh: a test's first call)
    done       {op}                                    + payloads (a receive's, a collective's)
    refused    {op, message}
    dump_stack {}

Between the grader's own processes when a job spans nodes (:mod:`grader.nodes`);
whoever connects to the head proves that it knows the course's secret::

    challenge {nonce}                                  head to whoever connects
    join      {role, node | job and rank, proof}      the answer: a node, or a rank's relay
    accept    {proof}                                  head to it: the head's own proof
    run       {world_size, level, device}              + the staged submission: head to node
    job       {id, per_node}                           head to node: start your ranks of it
    ready     {level}                                  node to head: it took the run, at level
    finish    {}                                       head to node: grading is over
    refuse    {message}                                node to head: it cannot take part
    exited    {status, last_words}                     relay to broker: its rank's process ended
    broken    {error}                                  relay to broker: its rank broke the format

A relay passes its rank's frames on unchanged, but never one of the last two
types, which only the relay may send.
"""

from __future__ import annotations

import math
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grader.wire import Frame

# Outcomes of a graded test.
PASSED = "passed"
FAILED = "failed"
ERROR = "error"
TIMEOUT = "timeout"
CRASHED = "crashed"
FORBIDDEN = "forbidden"
NOT_RUN = "not_run"

# Frame types, rank to broker.
HELLO = "hello"
IMPORTING = "importing"
IMPORTED = "imported"
SEND = "send"
RECV = "recv"
COLLECTIVE = "collective"
WAIT = "wait"
RESULT = "result"
FAILURE = "failure"
STACK = "stack"
MARK = "mark"
GATE = "gate"
#: A call's own traffic: handling one of these changes nothing the pool waits for (a rank's
#: outcome, its connection, its stack), unless it ends the rank's call.
OPERATIONS = frozenset({SEND, RECV, COLLECTIVE, WAIT, MARK, GATE})
# Frame types, broker to rank.
CALL = "call"
DONE = "done"
REFUSED = "refused"
DUMP_STACK = "dump_stack"
SEGMENT = "segment"  # the rank's shared-memory segment, its descriptor attached (grader.segment)
# Frame types between the grader's processes on several nodes.
CHALLENGE = "challenge"
JOIN = "join"
ACCEPT = "accept"  # the head's proof, in answer to a join
RUN = "run"
READY = "ready"  # a node took the run, at the sandbox level it names
JOB = "job"
FINISH = "finish"
REFUSE = "refuse"
EXITED = "exited"
BROKEN = "broken"
RELAY_ONLY = (EXITED, BROKEN)
# The error type of a rank whose operation the broker refused: it suffered from a fault the
# broker reports itself (grader.rank.link.BrokerRefused).
REFUSED_ERROR = "BrokerRefused"

MAX_TEXT = 2000


class OpName(str, Enum):
    """What an operation a rank posts is, by the name torch.distributed gives it: a message, a
    wait for one, a mark, or a built-in collective. The broker's record, its rules and every
    judge of a call compare against these, never against a string of their own."""

    SEND = "send"
    RECV = "recv"
    WAIT = "wait"
    MARK = "mark"
    BARRIER = "barrier"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALL_REDUCE = "all_reduce"
    SCATTER = "scatter"
    GATHER = "gather"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"

    __str__ = str.__str__  # "send" in a message, as the wire carries it
    __format__ = str.__format__


class Form(str, Enum):
    """The calls of torch.distributed that are another layout of one collective: the whole
    tensor cut into the pieces the collective (:class:`OpName`) moves."""

    ALL_GATHER_INTO_TENSOR = "all_gather_into_tensor"
    REDUCE_SCATTER_TENSOR = "reduce_scatter_tensor"
    ALL_TO_ALL_SINGLE = "all_to_all_single"

    __str__ = str.__str__
    __format__ = str.__format__


def rank_socket(socket_dir: Path, rank: int) -> Path:
    """The Unix socket where rank ``rank`` meets the broker (or its node's relay)."""
    return socket_dir / f"rank{rank}.sock"


# Whole escape sequences first (ESC [ ... letter), then any other control character.
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean(text: Any, limit: int = MAX_TEXT) -> str:
    """Untrusted text made safe to show: a string, no control characters, at most ``limit``."""
    text = _CONTROL.sub("", str(text))
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ProtocolError(Exception):
    """A rank sent something the protocol does not allow; the rank is treated as broken."""


def field_int(header: dict[str, Any], name: str, low: int = -(1 << 31), high: int = 1 << 62) -> int:
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ProtocolError(f"{name} must be an integer in [{low}, {high}]")
    return value


def field_ranks(header: dict[str, Any], world_size: int) -> tuple[int, ...]:
    group = header.get("group")
    if (
        not isinstance(group, list)
        or not group
        or len(group) > world_size
        or len(set(group)) != len(group)
        or not all(isinstance(r, int) and 0 <= r < world_size for r in group)
    ):
        raise ProtocolError("group must list distinct ranks of the world")
    return tuple(group)


@dataclass(frozen=True)
class TensorMeta:
    """A tensor as a rank describes it: its dtype and size, which its payload must match, and
    the shape and strides of the student's tensor, which only the broker's refusals read
    (:mod:`grader.broker.rules`: gloo refuses some shapes and views). Two descriptions are
    equal when their dtypes and sizes are: the bytes carried are the same."""

    dtype: str
    numel: int
    shape: tuple[int, ...] | None = field(default=None, compare=False)  # None: not reported
    strides: tuple[int, ...] | None = field(default=None, compare=False)

    @classmethod
    def read(cls, raw: Any) -> TensorMeta:
        if not isinstance(raw, dict) or not isinstance(raw.get("dtype"), str):
            raise ProtocolError("tensor description malformed")
        numel = field_int(raw, "numel", 0)
        shape, strides = _dims(raw, "shape", 0), _dims(raw, "strides", -(1 << 62))
        if shape is not None and (math.prod(shape) != numel or len(strides or ()) != len(shape)):
            raise ProtocolError("a tensor's shape and strides do not match its size")
        return cls(clean(raw["dtype"], 20), numel, shape, strides)

    def __str__(self) -> str:
        return f"{self.dtype}[{self.numel}]"


def _dims(raw: dict[str, Any], name: str, low: int) -> tuple[int, ...] | None:
    """A tensor's shape or strides as reported (None if not), each an integer from ``low``."""
    dims = raw.get(name)
    if dims is None:
        return None
    if not isinstance(dims, list) or len(dims) > 16:
        raise ProtocolError(f"a tensor's {name} must be a list of at most 16 integers")
    return tuple(field_int({name: d}, name, low) for d in dims)


@dataclass(frozen=True)
class RankError:
    """How a call raised on a rank: exception type, message, the student's frames."""

    type: str
    message: str
    frames: tuple[str, ...] = ()
    raiser: str = ""  # the innermost student function it came from, e.g. "all_reduce"
    refused: bool = False  # a system call the sandbox refuses (a socket, a process, a lock)

    @classmethod
    def read(cls, raw: Any) -> RankError:
        if not isinstance(raw, dict):
            raise ProtocolError("failure without an error")
        frames = raw.get("frames") if isinstance(raw.get("frames"), list) else []
        return cls(
            clean(raw.get("type", "Exception"), 80),
            clean(raw.get("message", ""), MAX_TEXT),
            tuple(clean(f, 300) for f in frames[:20]),
            clean(raw.get("raiser", ""), 80),
            raw.get("refused") is True,
        )

    def where(self) -> str:
        return f" (at {self.frames[-1]})" if self.frames else ""

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "message": self.message,
            "frames": list(self.frames),
            "raiser": self.raiser,
            "refused": self.refused,
        }


@dataclass(frozen=True)
class RankExit:
    """How a rank's process ended, as its trusted wrapper saw it."""

    status: int  # the exit code, or minus the signal that killed it
    last_words: str = ""  # the end of what it printed, cleaned

    @classmethod
    def read(cls, raw: dict[str, Any]) -> RankExit:
        return cls(field_int(raw, "status", -64, 255), clean(raw.get("last_words", ""), 300))

    def to_wire(self) -> dict[str, Any]:
        return {"status": self.status, "last_words": self.last_words}

    def describe(self) -> str:
        if self.status < 0:
            try:
                return f"killed by {signal.Signals(-self.status).name}"
            except ValueError:
                return f"killed by signal {-self.status}"
        return f"exit status {self.status}"

    @property
    def stopped_by_grader(self) -> bool:
        """Killed as part of ending the job, not on its own (SIGKILL, SIGTERM)."""
        return self.status in (-9, -15)


@dataclass(frozen=True)
class CallRequest:
    """One call a graded test asks of the ranks: the submission's ``function`` or the grader's
    scenario (``target``, ``"part.name"``) on the first ``world_size`` ranks, rank r on
    ``args[r]``, and how the broker records it. ``gates[r]``: the
    :class:`grader.broker.ops.Gate` rank r's scenario passes, in order; ``fresh``: a test's
    first call, for which every rank starts the submission afresh."""

    world_size: int
    target: str
    args: Sequence[Sequence[Any]]
    scenario: bool = False
    case: str = ""  # the input case, which every message of a failed call names
    gates: Sequence[Sequence[Any]] = ()
    keep_payloads: bool = True
    fresh: bool = False
    timed: bool = False

    @property
    def part(self) -> str:
        return self.target.split(".")[0]

    def frames(self, call_id: int) -> list[Frame]:
        """The CALL frame each rank gets: the target, its arguments packed for the wire."""
        from grader import wire  # torch: only where a call is made

        frames = []
        for rank_args in self.args:
            node, buffers = wire.pack(list(rank_args))
            header = {
                "type": CALL,
                "call": call_id,
                "world_size": self.world_size,
                "scenario" if self.scenario else "function": self.target,
                "args": node,
                "fresh": self.fresh,
            }
            frames.append(wire.Frame(header, buffers))
        return frames
