"""gloo's rules for a collective's arguments, which the broker applies to what each rank reports.

The broker computes a collective from bytes, so it could take arguments that gloo refuses
(an ``all_gather_into_tensor`` output of shape [p, n]) or that gloo gets wrong (an
all-reduce of a view with gaps): a submission would pass here and fail on a cluster. Each
rule reads one rank's description of its tensors (shape and strides, as the rank reports
the student's tensors) and says, in a student's words, why gloo refuses the call; where
NCCL's rule is stricter than gloo's the grader applies NCCL's (docs/conformance.md).
A rank can only lie itself into a refusal, or out of one for a call its own tensors
then carry: what the broker computes rests on the payloads alone.
"""

from __future__ import annotations

from collections.abc import Callable

from grader.broker.ops import CollectiveCall, TensorMeta
from grader.protocol import Form, OpName

Rule = Callable[[str, CollectiveCall, int], "str | None"]


def contiguous(meta: TensorMeta) -> bool:
    """Row-major with no gaps (dimensions of one element have any stride): what gloo takes."""
    if meta.shape is None or meta.strides is None or meta.numel == 0:
        return True
    expected = 1
    for size, stride in reversed(list(zip(meta.shape, meta.strides, strict=True))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def dense(meta: TensorMeta) -> bool:
    """Its elements fill one block of memory, in some order (a transpose is dense, every other
    element is not): gloo reduces the block, so a dense view comes out right."""
    if meta.shape is None or meta.strides is None or meta.numel == 0:
        return True
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(meta.shape, meta.strides, strict=True)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _shape(meta: TensorMeta) -> str:
    return "[" + ", ".join(map(str, meta.shape or (meta.numel,))) + "]"


def _dense(form: str, metas: tuple[TensorMeta, ...]) -> str | None:
    for meta in metas:
        if not dense(meta):
            return (
                f"{form} on a view with gaps between its elements ({meta.dtype}{_shape(meta)} "
                f"with strides {meta.strides}): gloo reads and writes its memory as if it were "
                f"contiguous and gives wrong results, NCCL refuses it; {form} a contiguous copy "
                "instead: buf = t.contiguous(), then t.copy_(buf)"
            )
    return None


def _dense_inputs(form: str, call: CollectiveCall, p: int) -> str | None:
    return _dense(form, call.inputs)


def _dense_outputs(form: str, call: CollectiveCall, p: int) -> str | None:
    return _dense(form, call.outputs)


def _like(form: str, what: str, metas: tuple[TensorMeta, ...], model: TensorMeta) -> str | None:
    """Every one of ``metas`` has ``model``'s dtype and shape, as gloo requires."""
    for index, meta in enumerate(metas):
        if meta.dtype != model.dtype or meta.shape != model.shape:
            return (
                f"{form}: {what} {index} is {meta.dtype}{_shape(meta)}, but gloo wants every "
                f"one of the same shape and dtype as {model.dtype}{_shape(model)}"
            )
    return None


def _outputs_like_input(form: str, call: CollectiveCall, p: int) -> str | None:
    return _like(form, "output", call.outputs, call.inputs[0]) if call.inputs else None


def _inputs_like_output(form: str, call: CollectiveCall, p: int) -> str | None:
    return _like(form, "input", call.inputs, call.outputs[0]) if call.outputs else None


def _one_per_rank(form: str, call: CollectiveCall, p: int) -> str | None:
    """A gather's root gives one output per rank, a scatter's root one input per rank."""
    tensors = call.outputs if form == OpName.GATHER else call.inputs
    if tensors and len(tensors) != p:
        return f"{form}: the root's list has {len(tensors)} tensors, gloo wants one per rank ({p})"
    return None


def _same_shapes(form: str, call: CollectiveCall, p: int) -> str | None:
    """The list all-to-all: every piece, sent or received, of the first input's shape (NCCL
    takes uneven pieces; gloo, the stricter, does not)."""
    if not call.inputs:
        return None
    return _like(form, "input", call.inputs, call.inputs[0]) or _like(
        form, "output", call.outputs, call.inputs[0]
    )


def _cut_whole(form: str, call: CollectiveCall, p: int) -> str | None:
    """``all_gather_into_tensor``'s output, ``reduce_scatter_tensor``'s input: gloo cuts it
    into ``p`` pieces along its first dimension, each of the other tensor's shape
    (``reduce_scatter_tensor`` checks the size and the first dimension only)."""
    gathers = form == Form.ALL_GATHER_INTO_TENSOR
    whole, names = call.whole, ("output", "input") if gathers else ("input", "output")
    part = (call.inputs if gathers else call.outputs)[0]
    if whole is None or whole.shape is None or not part.shape:
        return None  # not reported, or cut into 0-d pieces: their sizes decide
    if whole.dtype != part.dtype:
        return (
            f"{form}: the {names[0]} is {whole.dtype} but the {names[1]} {part.dtype}: gloo "
            "refuses tensors of different dtypes"
        )
    wanted = (p * part.shape[0], *part.shape[1:])
    if whole.shape == wanted or (
        not gathers and whole.shape[:1] == wanted[:1] and whole.numel == p * part.numel
    ):
        return None
    return (
        f"{form}: the {names[0]} must be [p*n] for an {names[1]} of n elements, [p*m, k] for "
        f"[m, k] (here {list(wanted)} for {_shape(part)}), not {_shape(whole)}: gloo refuses "
        f"any other shape (NCCL checks the size only); pass {names[0]}.view({list(wanted)})"
    )


def _contiguous_whole(form: str, call: CollectiveCall, p: int) -> str | None:
    """``all_to_all_single``'s input (the whole), and its output (cut into rows)."""
    whole = call.whole
    if whole is not None and not contiguous(whole):
        return (
            f"{form} on a non-contiguous tensor ({whole.dtype}{_shape(whole)} with strides "
            f"{whole.strides}): gloo refuses non-contiguous tensors (call .contiguous())"
        )
    if all(map(contiguous, call.outputs)):
        return None
    return (
        f"{form} into a non-contiguous output: gloo writes it as if it were contiguous (wrong "
        "results) and NCCL refuses it; receive into buf = torch.empty(...) (contiguous), then "
        "out.copy_(buf)"
    )


RULES: dict[str, tuple[Rule, ...]] = {
    OpName.ALL_REDUCE: (_dense_inputs,),
    OpName.BROADCAST: (_dense_inputs,),
    OpName.REDUCE: (_dense_inputs,),
    OpName.ALL_GATHER: (_outputs_like_input,),
    OpName.GATHER: (_one_per_rank, _outputs_like_input),
    Form.ALL_GATHER_INTO_TENSOR: (_cut_whole,),
    OpName.REDUCE_SCATTER: (_inputs_like_output,),
    OpName.SCATTER: (_one_per_rank, _inputs_like_output, _dense_outputs),
    Form.REDUCE_SCATTER_TENSOR: (_cut_whole,),
    OpName.ALL_TO_ALL: (_same_shapes,),
    Form.ALL_TO_ALL_SINGLE: (_contiguous_whole,),
}


def refusal(kind: str, call: CollectiveCall, p: int) -> str | None:
    """Why gloo refuses this rank's part in a collective ``kind`` of ``p`` ranks (None: it
    takes it)."""
    form = call.form or kind
    for rule in RULES.get(form, ()):
        message = rule(form, call, p)
        if message is not None:
            return message
    return None
