"""Reading what a rank's scenario returned into a checked record, on the trusted side.

A scenario runs in the rank's process, so its return is the submission's word: each
scenario's observation record (such as :class:`grader.testkit.fully_sharded.Observed`) reads
it with these checks, which raise :class:`~grader.protocol.ProtocolError` (or ValueError for
one value) on any other structure, and :func:`read_every_rank` charges a malformed return to
the submission in one line, never a KeyError in the graded test.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

from torch import Tensor

from grader import failures
from grader.judge.call import case_suffix
from grader.protocol import ProtocolError, clean
from grader.testkit.compare import rank_blame

T = TypeVar("T")


def read_every_rank(
    returned: Sequence[Any], read: Callable[[Any], T], scenario: str, case: str
) -> list[T]:
    """Every rank's record, ``read`` from its return; a malformed one breaks the protocol,
    charged to the submission (the lowest rank's, with the ranks whose return is malformed the
    same way)."""
    seen: list[T] = []
    problems: dict[int, str] = {}
    for r, tree in enumerate(returned):
        try:
            seen.append(read(tree))
        except ProtocolError as err:
            problems[r] = f"{scenario} returned a malformed observation: {err}"
    if problems:
        fault = failures.Fault.PROTOCOL
        raise fault.failure(rank_blame(problems) + case_suffix(case), case, fault.cause)
    return seen


def per_step(
    value: Any, field: str, count: int, names: Collection[str], read: Callable[[Any], Any]
) -> tuple[dict[str, Any], ...]:
    """``count`` dicts keyed by ``names``, each value through ``read`` (which raises
    ValueError on a value of another kind)."""
    if not isinstance(value, list):
        raise ProtocolError(f"{field} is {kind(value)}, not a list")
    if len(value) != count:
        raise ProtocolError(f"{field} holds {len(value)} entries, not {count}")
    out = []
    for i, step in enumerate(value):
        if not isinstance(step, dict):
            raise ProtocolError(f"{field}[{i}] is {kind(step)}, not a dict")
        if problem := keys_problem(step, names, "the model's parameters"):
            raise ProtocolError(f"{field}[{i}] {problem}")
        try:
            out.append({name: read(v) for name, v in step.items()})
        except ValueError as err:
            raise ProtocolError(f"{field}[{i}] holds {err}") from None
    return tuple(out)


def keys_problem(tree: dict[str, Any], names: Collection[str], what: str) -> str:
    """What is wrong with ``tree``'s keys, which must be ``names`` ("": nothing); the
    rank's own keys are counted, never quoted."""
    missing = sorted(set(names) - set(tree))
    if missing:
        return f"lacks {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
    extra = len(set(tree) - set(names))
    return f"holds {extra} key(s) that are not {what}" if extra else ""


def read_tensor_or_none(value: Any) -> Tensor | None:
    """``value`` if a tensor or None; ValueError otherwise."""
    if value is not None and not isinstance(value, Tensor):
        raise ValueError(f"{kind(value)} where a tensor or None is due")
    return value


def read_shape(value: Any) -> tuple[int, ...]:
    """``value`` as a shape (a sequence of sizes); ValueError otherwise."""
    if not isinstance(value, list | tuple) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value
    ):
        raise ValueError(f"{kind(value)} where a shape is due")
    return tuple(value)


def kind(value: Any) -> str:
    """The type of a decoded value with its article, for a message ("an int", "a str"): a
    wire type's name, never the rank's text."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


# -- readers composed into a record: each raises ValueError naming what it found, the path of
# lists ("[i]") prefixed on the way out; read_field turns it into the record's ProtocolError.


def read_fields(tree: Any, names: Collection[str]) -> dict[str, Any]:
    """``tree``, a dict whose keys are exactly ``names``; ProtocolError otherwise."""
    if not isinstance(tree, dict):
        raise ProtocolError(f"{kind(tree)}, not a dict of {', '.join(names)}")
    if problem := keys_problem(tree, names, "fields"):
        raise ProtocolError(problem)
    return tree


def read_field(tree: dict[str, Any], name: str, read: Callable[[Any], T]) -> T:
    """``tree[name]`` through ``read`` (:func:`read_value`)."""
    return read_value(tree[name], name, read)


def read_record(tree: Any, fields: Mapping[str, Callable[[Any], Any]]) -> dict[str, Any]:
    """``tree``, a dict of exactly the keys of ``fields``, each value through its reader;
    ProtocolError otherwise."""
    read_fields(tree, fields)
    return {name: read_field(tree, name, read) for name, read in fields.items()}


def read_value(value: Any, name: str, read: Callable[[Any], T]) -> T:
    """``value``, called ``name``, through ``read``; a ProtocolError naming it and where in it."""
    try:
        return read(value)
    except ValueError as err:
        raise ProtocolError(_at(name, err)) from None


def _at(where: str, err: ValueError) -> str:
    """``err``'s words placed at ``where``: ``grads[1] holds a str where a tensor is due``."""
    said = str(err)
    return where + (said if said.startswith("[") else f" holds {said}")


def list_of(read: Callable[[Any], T], count: int | None = None) -> Callable[[Any], tuple[T, ...]]:
    """A reader of a list (of ``count`` items, if given), each item through ``read``."""

    def read_list(value: Any) -> tuple[T, ...]:
        if not isinstance(value, list | tuple):
            raise ValueError(f"{kind(value)} where a list is due")
        if count is not None and len(value) != count:
            raise ValueError(f"{len(value)} entries, not {count}")
        out = []
        for i, item in enumerate(value):
            try:
                out.append(read(item))
            except ValueError as err:
                raise ValueError(_at(f"[{i}]", err)) from None
        return tuple(out)

    return read_list


def dict_of(read: Callable[[Any], T]) -> Callable[[Any], dict[str, T]]:
    """A reader of a dict of any names (never quoted: the test says which are missing), each
    value through ``read``."""

    def read_dict(value: Any) -> dict[str, T]:
        if not isinstance(value, dict):
            raise ValueError(f"{kind(value)} where a dict is due")
        return {str(name): read(v) for name, v in value.items()}

    return read_dict


def read_tensor(value: Any) -> Tensor:
    """``value`` if a tensor; ValueError otherwise."""
    if not isinstance(value, Tensor):
        raise ValueError(f"{kind(value)} where a tensor is due")
    return value


def read_bool(value: Any) -> bool:
    """``value`` if a bool; ValueError otherwise."""
    if not isinstance(value, bool):
        raise ValueError(f"{kind(value)} where a bool is due")
    return value


def read_index(value: Any) -> int:
    """``value`` if an int of at least 0 (not a bool); ValueError otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{kind(value)} where an index is due")
    return value


def read_text(value: Any) -> str:
    """``value`` if a str, made safe to show on one line (:func:`~grader.protocol.clean`, its
    whitespace one space); else ValueError."""
    if not isinstance(value, str):
        raise ValueError(f"{kind(value)} where a str is due")
    return " ".join(clean(value, 200).split())


def or_none(read: Callable[[Any], T]) -> Callable[[Any], T | None]:
    """A reader that also takes None."""
    return lambda value: None if value is None else read(value)


def read_type_name(value: Any) -> str:
    """The name of the type a student's function returned, as the scenario reports it (an
    identifier, which a message may quote); ValueError otherwise."""
    if not isinstance(value, str) or not value.isidentifier() or len(value) > 64:
        raise ValueError(f"{kind(value)} where a type's name is due")
    return value
