"""The trusted side of the data_parallel graded tests (``tests/graded/test_data_parallel.py``).

What the tests compute here and never send to the ranks: the bucketing contract (the caps and
how many all-reduces each gives), every rank's initial model and the batches from the secret
seed, the words for a wrong gradient or parameter after a step, the broker's all-reduces of
each iteration read by the scenario's marks, the gates at the embedding that prove the
communication overlapped the backward pass, and what each rank's scenario returned, read into
one checked record (:class:`Trained`, :class:`Overlapped`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grader.broker.ops import Gate
from grader.broker.traffic import Event
from grader.judge.call import CallResult
from grader.protocol import OpName, ProtocolError
from grader.scenarios.data_parallel import DIM, TiedNet, build, tensors_of
from grader.testkit.compare import carried, nearest
from grader.testkit.data import generator
from grader.testkit.explain import close, close_in_float32, difference, uniform_factor
from grader.testkit.observed import (
    dict_of,
    list_of,
    or_none,
    read_every_rank,
    read_field,
    read_fields,
    read_tensor,
    read_text,
    read_value,
)
from grader.tolerances import FLOAT32

ROWS, STEPS = 12, 3  # ROWS: the full batch, split evenly over 1, 2, 3 or 4 ranks
TIED, TIED_ALIAS = "embed.weight", "head.weight"
# Trainable gradients in registration order: embed.weight 512 B, hidden.weight 512 B,
# hidden.bias 64 B, head.bias 64 B (float64). A 600-byte cap packs them greedily into 3
# buckets in reverse registration order ([head.bias, hidden.bias], [hidden.weight],
# [embed.weight]) and in forward order alike: exactly 3 all-reduces either way. A 40-byte cap
# is smaller than every gradient: a nonzero cap that no parameter fits in, one bucket each.
BUCKETS = {
    "per_parameter": (0.0, 4),
    "few_buckets": (600 / 2**20, 3),
    "one_bucket": (25.0, 1),
    "cap_below_parameter": (40 / 2**20, 4),
}
RULES = {
    "per_parameter": "bucket_size_mb=0 means one bucket per trainable parameter",
    "few_buckets": "greedy packing of the 4 gradients (512, 512, 64, 64 bytes) into buckets "
    "of at most 600 bytes gives 3",
    "one_bucket": "all 1152 bytes of gradients fit in one bucket",
    "cap_below_parameter": "a cap of 40 bytes is smaller than every gradient (the smallest "
    "holds 64 bytes), and a parameter larger than the cap gets a bucket of its own: 4",
}
GRAD_BYTES = sum(q.numel() * 8 for q in TiedNet().parameters() if q.requires_grad)  # float64


# -- inputs, made here from the secret seed ------------------------------------------------


def initial_state(rank: int) -> dict[str, Tensor]:
    """Rank ``rank``'s own initial TiedNet: every rank's differs, as if seeded differently."""
    gen = generator("data_parallel/initial", rank)
    state = {}
    for name, t in tensors_of(TiedNet()).items():
        if isinstance(t, nn.Parameter):
            state[name] = torch.randn(t.shape, generator=gen, dtype=torch.float64) / DIM**0.5
        else:
            state[name] = torch.rand(t.shape, generator=gen, dtype=torch.float64) + 0.5
    return state


def batches() -> list[tuple[Tensor, Tensor]]:
    """The full batch (inputs, targets) of each training step."""
    out = []
    for step in range(1, STEPS + 1):
        gen = generator(f"data_parallel/batch{step}")
        x = torch.randn(ROWS, DIM, generator=gen, dtype=torch.float64)
        out.append((x, torch.randn(ROWS, DIM, generator=gen, dtype=torch.float64)))
    return out


def slices(full: list[tuple[Tensor, Tensor]], rank: int, p: int) -> list[tuple[Tensor, Tensor]]:
    """Rank ``rank``'s slice of each batch: the ranks split every batch evenly."""
    return [(x.tensor_split(p)[rank].clone(), y.tensor_split(p)[rank].clone()) for x, y in full]


# -- comparing and explaining ----------------------------------------------------------------


def initial_mismatch(initial: dict[str, Any], expected: dict[str, Tensor]) -> str | None:
    """The first parameter or buffer that differs from rank 0's initial one, if any."""
    for name, want in expected.items():
        got, kind = initial.get(name), "buffer" if name == "scale" else "parameter"
        if close(got, want):
            continue
        if isinstance(got, Tensor) and got.shape == want.shape:
            error = float((got - want).abs().max())
            return f"{kind} {name} differs from rank 0's by {error:.3g} (max abs)"
        return f"{kind} {name} {difference(got, want)}"
    return None


def grads_of(model: nn.Module) -> dict[str, Tensor | None]:
    """A model's gradients by parameter name (None where a parameter has none)."""
    return {n: None if q.grad is None else q.grad.detach() for n, q in model.named_parameters()}


def gradient_problem(
    got: dict[str, Any],
    want: dict[str, Tensor | None],
    mine: dict[str, Tensor | None],
    p: int,
    unused: Sequence[str] = (),
) -> str | None:
    """What is wrong with a rank's gradients after synchronization, most telling mistake first.

    ``want`` holds the full batch's gradients, ``mine`` the rank's own, unreduced ones;
    ``unused`` names the parameters no rank used in this iteration (None or zero is right)."""
    problem = _missing_or_stray(got, want, unused)
    if problem is not None:
        return problem
    grads = {n: g for n, g in want.items() if g is not None and n not in unused}
    for name, w in grads.items():
        if isinstance(got[name], Tensor) and got[name].dtype != w.dtype:
            return (
                f"parameter {name}'s gradient has dtype {str(got[name].dtype)[6:]}, the "
                f"parameter {str(w.dtype)[6:]}: write the reduced values back into each .grad "
                "in its own dtype"
            )
    wrong = [n for n, w in grads.items() if not close(got[n], w)]
    if not wrong:
        return None
    factor = uniform_factor(got, grads)
    if factor is not None and p > 1 and abs(factor - p) < 1e-6:
        return (
            f"every gradient is {p}x the one-process gradient: the gradients were summed over "
            f"the {p} ranks, not averaged (divide by the world size)"
        )
    if factor is not None:
        return (
            f"every gradient is {factor:.6g}x the one-process gradient (the same factor for all): "
            f"the mean over the {p} rank{'s' * (p > 1)} is their sum divided by {p}, exactly once"
            + (f" (these were divided by {p / factor:.6g})" if factor > 0 else "")
        )
    if p > 1 and all(close(got[n], mine[n]) for n in wrong):  # type: ignore[arg-type]
        return f"{wrong[0]}'s gradient is this rank's own: it was never all-reduced"
    if wrong == [TIED] and close(got[TIED], 2 * grads[TIED]):
        return (
            f"the tied weight {TIED} (also {TIED_ALIAS}) has 2x its gradient while the others "
            "are right: a shared parameter's gradient was reduced (or added) twice; module."
            "parameters() lists it once: hook and bucket it once"
        )
    if all(close_in_float32(got[n], grads[n]) for n in wrong):
        return (
            f"parameter {wrong[0]}'s gradient {difference(got[wrong[0]], grads[wrong[0]])}, "
            "within float32 rounding: the bucket is in a lower precision than the gradients "
            "(float64): flatten each bucket in its gradients' dtype (torch.cat of the "
            "gradients keeps it; a buffer made with torch.zeros needs dtype=)"
        )
    return f"parameter {wrong[0]}'s gradient {difference(got[wrong[0]], grads[wrong[0]])}"


def _missing_or_stray(
    got: dict[str, Any], want: dict[str, Tensor | None], unused: Sequence[str]
) -> str | None:
    """A gradient where none belongs (an unused or frozen parameter's), or none where one does."""
    for name, w in want.items():
        g = got.get(name)
        if name in unused:
            if isinstance(g, Tensor) and bool(g.any()):
                return (
                    f"parameter {name} was unused in this iteration on every rank, yet its "
                    f"gradient after synchronization is nonzero (max abs {float(g.abs().max()):.3g}"
                    "): leave it None, or zero: no stale or uninitialised values in a bucket"
                )
            continue
        if w is None and g is not None:
            return (
                f"frozen parameter {name} (requires_grad=False) has a gradient: leave frozen "
                "parameters out of the buckets and never give them a .grad"
            )
        if w is not None and g is None:
            return f"parameter {name} has no gradient (.grad is None)"
    return None


def param_problem(got: dict[str, Any], want: dict[str, Tensor]) -> str | None:
    """The first of a rank's parameters that differs from the oracle's after a step."""
    name = next((n for n, w in want.items() if not close(got.get(n), w)), None)
    return name and f"parameter {name} {difference(got.get(name), want[name])}"


# -- the broker's record: the all-reduces of each iteration, and the gates ----------------


Window = dict[str, list[Event]]


def all_reduces(out: CallResult, rank: int) -> list[Window]:
    """Per iteration, the rank's all-reduces of every rank posted ``before`` backward reached
    the gate at the embedding and ``after`` it (until the next iteration's input was handed
    over), placed by the broker's record of the gates (the marks a rank posts are its own
    word, and never read); an all-reduce of a smaller group (of one: it never left the rank)
    is none. Only the iterations whose two gates were passed."""
    events, passed = out.traffic.per_rank[rank], {g.label: g.after for g in out.traffic.gates[rank]}
    iterations: list[Window] = []
    for i in itertools.count(1):
        start, middle = passed.get(f"iteration {i} input"), passed.get(f"iteration {i}")
        if start is None or middle is None:
            return iterations
        end = passed.get(f"iteration {i + 1} input", len(events))
        window: Window = {"before": [], "after": []}
        for at in range(start, end):
            e = events[at]
            if e.op == OpName.ALL_REDUCE and out.traffic.among_all(e):
                window["before" if at < middle else "after"].append(e)
        iterations.append(window)
    return iterations


def overlap_problem(iterations: list[Window], i: int, bucket: str) -> str | None:
    """The first thing wrong with iteration ``i``'s all-reduces on one rank."""
    reduces = iterations[i]["before"] + iterations[i]["after"]
    expected, carried = BUCKETS[bucket][1], sum(e.nbytes for e in reduces)
    if not reduces:
        made = len(iterations[0]["before"] + iterations[0]["after"])
        again = f" (iteration 1 made {made}: reset the per-iteration state)" * (i > 0)
        return (
            f"no all-reduce was called during backward and finish{again} (of every rank, the "
            "default group's: an all-reduce of a smaller group, of the rank alone, reaches no "
            "other rank)"
        )
    # A lower precision first: it also changes the bytes, and the count if buckets are packed
    # by the flattened size, and it is what the student must fix.
    lower = sorted({e.dtype for e in reduces} - {"float64", ""})
    if lower:
        return (
            f"the all-reduces carried {carried} bytes of {lower[0]}, the trainable gradients "
            f"hold {GRAD_BYTES} bytes of float64: the bucket is in a lower precision than the "
            "gradients: flatten each bucket in its gradients' dtype (torch.cat of the gradients "
            "keeps it; a buffer made with torch.zeros needs dtype=)"
        )
    if len(reduces) != expected:
        return (
            f"{len(reduces)} gradient all-reduces in one step, expected {expected}: "
            f"{RULES[bucket]} "
            "(the tied weight counts once, the frozen layer not at all)"
        )
    if carried != GRAD_BYTES:
        return (
            f"the all-reduces carried {carried} bytes, the trainable gradients hold "
            f"{GRAD_BYTES}: reduce each gradient exactly once (none for frozen parameters)"
        )
    return None


class Scaled(torch.autograd.Function):
    """The trusted twin of the scenario's gate: identity forward, gradient times ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


def gate_factor(rank: int, iteration: int) -> float:
    """The secret factor of rank ``rank``'s gate in ``iteration``, in [0.5, 1.5)."""
    gen = generator(f"data_parallel/gate{iteration}", rank)
    return 0.5 + float(torch.rand((), generator=gen, dtype=torch.float64))


def gated_grads(x: Tensor, y: Tensor, factor: float) -> dict[str, Tensor]:
    """One rank's local gradients in the overlap scenario: rank 0's model, the gate's factor on
    the embedding's output gradient."""
    net = build(initial_state(0))
    net.embed.register_forward_hook(lambda module, args, out: Scaled.apply(out, factor))
    F.mse_loss(net(x), y).backward()
    return {n: q.grad.detach().clone() for n, q in net.named_parameters() if q.grad is not None}


def gates(full: list[tuple[Tensor, Tensor]], p: int, bucket: str) -> list[list[Gate]]:
    """Rank r's gates in each iteration: its batch handed over before the forward, and the gate
    at the embedding: before it, backward has computed head.bias's gradient (and hidden's), so
    its bucket's all-reduce must have started, unless every gradient is in one bucket, which
    can only start once backward is done."""
    out = []
    for r in range(p):
        mine = []
        for i, (x, y) in enumerate(slices(full, r, p), start=1):
            factor = gate_factor(r, i)
            needs = () if bucket == "one_bucket" else gated_grads(x, y, factor)["head.bias"]
            secret = torch.tensor([factor], dtype=torch.float64).numpy().tobytes()
            mine.append(Gate.handing(f"iteration {i} input", torch.cat([x, y])))
            mine.append(Gate(f"iteration {i}", secret, tuple(map(float, needs))))
        out.append(mine)
    return out


def gate_problem(
    out: CallResult, rank: int, full: list, bucket: str, seen: Overlapped
) -> str | None:
    """What the broker's gates prove wrong on ``rank``: a gate never passed, or passed before
    any all-reduce of the gradients already computed had started; and gradients that did not
    go through the gate's secret factor (its point was not really passed inside backward), in
    ``seen``, what the rank's scenario returned."""
    passes = {g.label: g for g in out.traffic.gates[rank]}
    for i in range(1, len(full) + 1):
        if f"iteration {i}" not in passes:
            return f"iteration {i}: the grader's gate at the embedding was never passed"
        if bucket != "one_bucket" and not passes[f"iteration {i}"].opened:  # one: no needs
            return (
                f"iteration {i}: backward reached the first layer (the embedding) before any "
                "all-reduce of the gradients it had already computed (head.bias's, hidden's) "
                "had started, so no communication overlapped with backward (the broker's "
                "record of what each all-reduce carried): launch a bucket's all-reduce as soon "
                "as its gradients are ready, from a gradient hook"
            )
    p = len(out.traffic.gates)
    for i, grads in enumerate(seen.grads, start=1):
        locals_ = [gated_grads(*slices(full, r, p)[i - 1], gate_factor(r, i)) for r in range(p)]
        want = {TIED: sum(g[TIED] for g in locals_) / p}
        got = {TIED: grads.get(TIED)}
        if not (close_in_float32(got.get(TIED), want[TIED]) or uniform_factor(got, want)):
            return (
                f"iteration {i}: {TIED}'s gradient is not the mean of the ranks' gradients "
                "through the grader's gate at the embedding: the gate was bypassed"
            )
    return None


def carried_problem(out: CallResult, rank: int, full: list) -> str | None:
    """What the broker's record of the rank's gradient all-reduces of every rank (what the
    others received) proves wrong: together they must carry the gradients this rank's
    backward computed in each iteration (the trusted side's, through the gate's factor), each
    once. The order is the buckets' choice, so the values are compared sorted; an all-reduce
    of the right size holding anything else (zeros, with the real averaging done some other
    way) is a wrong message, and the message names the gradients that are not among what was
    carried."""
    p = len(out.traffic.gates)
    mine = slices(full, rank, p)
    local = [gated_grads(x, y, gate_factor(rank, i)) for i, (x, y) in enumerate(mine, start=1)]
    want = torch.cat([g.reshape(-1) for grads in local for g in grads.values()]).sort().values
    reduces = out.traffic.world_collectives(rank, OpName.ALL_REDUCE)  # what reached the others
    got = torch.cat([carried(e) for e in reduces] or [torch.zeros(0, dtype=torch.float64)])
    got = got.sort().values
    if got.shape == want.shape and close_in_float32(got, want):
        return None
    absent: dict[str, list[int]] = {}
    for i, grads in enumerate(local, start=1):
        for name, grad in grads.items():
            if not _among(grad.reshape(-1), got):
                absent.setdefault(name, []).append(i)
    which = "; ".join(
        f"{name}'s gradient in iteration{'s' * (len(its) > 1)} {', '.join(map(str, its))}"
        for name, its in absent.items()
    )
    which = f" ({which} not among them)" if which else ""
    return (
        f"its all-reduces carried {got.numel()} values, but not the {want.numel()} local "
        f"gradients its backward computed{which}, by the broker's record of what each "
        "all-reduce carried: all-reduce each bucket of this rank's own gradients, once, and "
        "nothing else; the all-reduce is what averages them"
    )


def _among(values: Tensor, pool: Tensor) -> bool:
    """Every one of ``values`` is within float32 rounding of some value in ``pool`` (sorted)."""
    if pool.numel() == 0:
        return values.numel() == 0
    found = pool[nearest(values, pool)]
    return bool(((found - values).abs() <= FLOAT32.bound(values)).all())


# -- what each rank's scenario returned, read into one checked record -------------------------

Grads = Mapping[str, Tensor | None]
_GRADS = dict_of(or_none(read_tensor))  # any names: the test says which are missing
_TRAINED = ("module", "initial", "grads", "params")


@dataclass(frozen=True)
class Trained:
    """What a rank's :func:`grader.scenarios.data_parallel.train` saw: the wrapped model's state
    right after wrapping, the gradients after each synchronization and the parameters after
    each step; or (``module`` not empty) the type the wrapper holds instead of a model, and
    nothing trained."""

    module: str
    initial: Mapping[str, Tensor]
    grads: tuple[Grads, ...]
    params: tuple[Mapping[str, Tensor], ...]

    @classmethod
    def read(cls, tree: Any, steps: int) -> Trained:
        """The record of ``tree``, a rank's return for ``steps`` steps; ProtocolError unless it
        has exactly that structure."""
        if isinstance(tree, dict) and set(tree) == {"module"}:
            module = read_field(tree, "module", read_text)
            if not module:
                raise ProtocolError("module is empty, and nothing was trained")
            return cls(module, {}, (), ())
        read_fields(tree, _TRAINED)
        if tree["module"] != "":
            raise ProtocolError("module names what the wrapper holds, yet a model was trained")
        return cls(
            "",
            read_field(tree, "initial", dict_of(read_tensor)),
            read_field(tree, "grads", list_of(_GRADS, steps)),
            read_field(tree, "params", list_of(dict_of(read_tensor), steps)),
        )


@dataclass(frozen=True)
class Overlapped:
    """What a rank's :func:`grader.scenarios.data_parallel.overlap` saw: the gradients after
    each iteration's synchronization."""

    grads: tuple[Grads, ...]

    @classmethod
    def read(cls, tree: Any, iterations: int) -> Overlapped:
        """The record of ``tree``; ProtocolError unless it has exactly that structure."""
        return cls(read_value(tree, "grads", list_of(_GRADS, iterations)))


def trained(returned: Sequence[Any], case: str) -> list[Trained]:
    """Every rank's :class:`Trained` (:func:`~grader.testkit.observed.read_every_rank`)."""
    return read_every_rank(
        returned, lambda tree: Trained.read(tree, STEPS), "data_parallel.train", case
    )


def overlapped(returned: Sequence[Any], iterations: int, case: str) -> list[Overlapped]:
    """Every rank's :class:`Overlapped`."""
    return read_every_rank(
        returned, lambda tree: Overlapped.read(tree, iterations), "data_parallel.overlap", case
    )
