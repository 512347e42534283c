"""Graded tests of ``FullyShardedDataParallel`` (ZeRO-3 / FSDP) in ``assignments/fully_sharded.py``.

The ranks run :func:`grader.scenarios.fully_sharded.train`: a small model (an Embedding, two
norms, three Linear layers; no parameter size divides by every p, so the padding matters) is
built on every rank from a state made here, whose sharded parameters hold the model's values
only in the rank's own shard (the rest drawn for the rank alone: the model reaches it only
from the other ranks, :func:`~grader.testkit.fully_sharded.rank_state`), wrapped, and trained
3 steps on the rank's slice of the batch, which it gets only through the broker's gates (the
tokens as the embedding starts, a factor on each later sharded layer's input as it starts, the
targets at the loss, the learning rate at the optimizer's step): the gates place every
all-gather and reduce-scatter of every step, and no mark is read; only collectives of every
rank count (one of a group of one never left its rank), and every step is judged, the later
ones against the shards and gradients of the one-process training (a step needs the other
ranks' updated shards). The oracle is the same module, from the whole initial state, trained
here on one process on the whole batch, with the compute dtype's
casts where FSDP makes them (weights and the sharded layers' floating inputs cast to it, the
loss in float32) and the same factors.

- ``training``: SGD and AdamW, float32 and ``compute_dtype`` float16 and bfloat16: the gathered
  parameters after 3 steps against the oracle's, within ``tolerance`` of grading.yaml (relative
  to the parameter's largest magnitude). Float32 differs by rounding only: the ranks sum
  their own rows and the ranks' sums are then added, and even at p = 1 a rank's matrix
  products split their sums over another number of threads than the grader's; AdamW (eps
  1e-3) passes such differences on. The reference: at most 5.1e-7 at p = 1-4, hence 1e-5.
  16-bit errors depend on the drawn data: up to 1.8e-3 (float16) and 6.3e-3 (bfloat16) seen.
- ``gradient_shards``: after each synchronization, every sharded parameter's ``.grad`` is this
  rank's ``[s]`` shard of the mean gradient in the padded layout (padding zero), float32 even
  with a float16 compute dtype; every replicated ``.grad`` the mean, the same on every rank.
- ``memory_at_rest`` (schedule): the broker's record shows every all-gather carrying exactly one
  shard of one sharded parameter, this rank's, compared with the shard computed here (never a
  full weight, never everything at once), each layer's forward preceded by the gather of its
  parameters, and each Linear's backward by a gather again;
  the rank-side view of the module (the parameters' shapes after forward and between steps) can
  fail this test, never pass it alone. Then the kernel's count of each rank's memory
  (:mod:`grader.testkit.resident`): a larger model (8 Linear layers, 32 MiB of float32 weights)
  trained 2 steps, the broker reading the rank's resident memory at gates before the model
  exists, once built, once wrapped, after each forward, synchronization and optimizer step:
  above the shards (and their gradients) allow, half a full copy in the compute dtype fails.
- ``communication``: from the broker's record: the forward's gathers in forward order, at most
  two layers ahead of the layer computing; the backward's in reverse order; one float32
  reduce-scatter of ``p*s`` elements per sharded parameter, carrying this rank's own gradient of
  it (against the gradient of its rows computed here), each posted during the backward: before
  the next layer's backward has computed its input's gradient (a gate there hands the factor
  on that gradient; the first layer, with none after it, is not judged so); the replicated
  gradients all-reduced;
  the bytes moved within ``max_bytes_ratio`` of the bound (all-gather, all-gather of the Linear
  weights, reduce-scatter: about 3(p-1)/p of the sharded bytes, the gathers in the compute
  dtype, plus 2(p-1)/p of the replicated bytes).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from grader.scenarios.fully_sharded import DTYPES
from grader.testkit import CallResult, TestOptions, TestRecord, World, resident
from grader.testkit.compare import on_every_rank, require
from grader.testkit.fsdp_record import (
    bytes_bound,
    check_record,
    late_scatter,
    step_messages,
    step_of,
)
from grader.testkit.fully_sharded import (
    NUMEL,
    REPLICATED,
    ROWS,
    SHARDED_PARAMS,
    STEPS,
    expected,
    gates,
    local_grads,
    mean_factor,
    observations,
    padded_shard,
    rank_state,
    shard_size,
    within,
)
from grader.testkit.patterns import Expected, Region, explain_within

PADDING_HINT = (
    "; the padding of the last shard must never reach the gathered weight (take the first n "
    "elements of the gathered p*s), and every gradient must be the mean over ranks"
)
REPLICA_HINT = (
    ": it is what one-process training gives from rank 0's module as handed, so the ranks "
    "trained on rank 0's values outside its own shard (a broadcast of the module, or a copy "
    "kept of it); only rank r's shard of each sharded parameter holds the model's values: "
    "keep that shard and gather the others from their ranks"
)
PADDING = (
    "only the padding is wrong: the elements past the parameter's end in the last shards; "
    "pad the flat gradient with zeros (torch.zeros, not torch.empty) before the reduce-scatter"
)
CASES = [f"{opt}-{dtype}" for opt in ("sgd", "adamw") for dtype in DTYPES]
HOLD_MOMENTS = ("forward", "synchronized", "rest")


def train_call(world: World, optimizer_name: str, dtype: str, case: str) -> CallResult:
    """Every rank trains its rows from its shard of the initial state; its tokens, targets,
    factors and learning rate come through its gates."""
    p = world.size
    args = [(rank_state(p, r), ROWS // p, optimizer_name, dtype, STEPS) for r in range(p)]
    return world.call(
        scenario="fully_sharded.train",
        args=args,
        case=case,
        gates=[gates(p, r, optimizer_name) for r in range(p)],
    )


def hold_call(world: World, dtype: str) -> CallResult:
    """Every rank trains a larger model (:func:`grader.scenarios.fully_sharded.hold`) while the
    broker reads its memory at the gates; what it carried is not kept."""
    p, sizes = world.size, (resident.WIDTH, resident.DEPTH, resident.ROWS)
    return world.call(
        scenario="fully_sharded.hold",
        args=[(*sizes, dtype, resident.STEPS)] * p,
        case=f"a larger model, compute_dtype={dtype}",
        gates=[resident.gates(p, r, HOLD_MOMENTS, inputs=True) for r in range(p)],
        keep_payloads=False,
    )


@pytest.mark.graded(target="fully_sharded.FullyShardedDataParallel", kind="correctness")
@pytest.mark.parametrize("case", CASES)
def test_training(world: World, options: TestOptions, record: TestRecord, case: str) -> None:
    p, (opt, dtype) = world.size, case.split("-")
    seen = observations(train_call(world, opt, dtype, case).returned, case)
    tol = options.tolerance_for(dtype)
    want = expected(opt, dtype, p)["full"]
    what = f"{STEPS} steps of {opt} with compute_dtype={dtype} on {p} ranks"

    def check(r: int) -> None:
        full = seen[r].full
        require(full is not None, f"{what}: gather_full_params() returned no dict")
        missing = sorted(set(want) - set(full))
        require(not missing, f"{what}: gather_full_params() lacks {', '.join(missing)}")
        for name, value in want.items():
            got = full[name]
            require(
                got.shape == value.shape,
                f"{what}: gather_full_params()[{name!r}] has shape {tuple(got.shape)}, "
                f"expected {tuple(value.shape)}",
            )
            require(got.dtype == torch.float32, f"{what}: {name} is {got.dtype}, not float32")
            ok, rel = within(got, value, tol)
            worst = record.details.setdefault("relative_error", {})
            worst[r] = max(worst.get(r, 0.0), rel)
            hint = (
                ""
                if ok or p == 1 or name not in SHARDED_PARAMS
                else why_differs(case, p, got, name, tol)
            )
            require(
                ok,
                f"{what}: {name} differs from one-process training on the whole batch by "
                f"{rel:.2g} of its largest magnitude (tolerance {tol:g}){hint}",
            )

    on_every_rank(p, check)


def why_differs(case: str, p: int, got: Tensor, name: str, tol: float) -> str:
    """Why a sharded parameter's gathered value differs: trained from rank 0's module as
    handed, if it matches that; else the usual layout mistakes."""
    from_rank0 = expected(*case.split("-"), p, start=0)["full"][name]
    return REPLICA_HINT if within(got, from_rank0, tol)[0] else PADDING_HINT


@pytest.mark.graded(target="fully_sharded.FullyShardedDataParallel", kind="correctness")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gradient_shards(world: World, options: TestOptions, dtype: str) -> None:
    p = world.size
    case = f"sgd-{dtype}"
    observed = observations(train_call(world, "sgd", dtype, case).returned, case)
    tol = options.tolerance_for(dtype)
    grads = expected("sgd", dtype, p)["grads"]
    what = f"compute_dtype={dtype} on {p} ranks"

    def check(r: int) -> None:
        for step, seen in enumerate(observed[r].grads):
            at = f"{what}, step {step + 1}"
            for name in SHARDED_PARAMS:
                got, s = seen[name], shard_size(name, p)
                require(got is not None, f"{at}: {name}.grad is None after synchronization")
                require(
                    tuple(got.shape) == (s,),
                    f"{at}: {name}.grad has shape {tuple(got.shape)}, expected this rank's flat "
                    f"shard ({s},) = ceil({NUMEL[name]}/{p})"
                    + (" (the full gradient: reduce-scatter it)" if got.numel() == NUMEL[name]
                       and p > 1 else ""),
                )  # fmt: skip
                require(
                    got.dtype == torch.float32,
                    f"{at}: {name}.grad is {got.dtype}: gradients are reduce-scattered in "
                    "float32 into the float32 shard, whatever the compute dtype",
                )
                want = padded_shard(grads[step][name], p, r)
                ok, rel = within(got, want, tol)
                factor = mean_factor(got, want)
                why = f" (it is {factor:g}x the mean: divide the sum by p)" if factor else ""
                if not ok and not factor:
                    why = padding_wrong(got, want, tol, r * s, name)
                require(ok, f"{at}: {name}.grad is off the mean gradient by {rel:.2g}{why}")
            for name in REPLICATED:
                got = seen[name]
                require(got is not None, f"{at}: {name}.grad (replicated) is None")
                ok, rel = within(got, grads[step][name], tol)
                require(ok, f"{at}: {name}.grad (replicated) is off the mean by {rel:.2g}")
                same = observed[0].grads[step][name]
                require(torch.equal(got, same), f"{at}: {name}.grad differs from rank 0's")

    on_every_rank(p, check)


def padding_wrong(got: Tensor, want: Tensor, tol: float, start: int, name: str) -> str:
    """ " (why)" when a pattern accounts for the wrong elements of a gradient shard that
    starts at element ``start`` of the flat parameter: only its padding wrong, most often."""
    padding = torch.arange(len(want)) + start >= NUMEL[name]
    scale = max(float(want.double().abs().max()) if want.numel() else 0.0, 1e-3)
    reason = explain_within(got, want, tol * scale, Expected(regions=[Region(padding, PADDING)]))
    return f" ({reason})" if reason else ""


@pytest.mark.graded(target="fully_sharded.FullyShardedDataParallel", kind="schedule")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_memory_at_rest(world: World, options: TestOptions, record: TestRecord, dtype: str) -> None:
    p, case = world.size, f"sgd-{dtype}"
    out = train_call(world, "sgd", dtype, case)
    observed = observations(out.returned, case)
    held = hold_call(world, dtype)

    def check(r: int) -> None:
        seen = observed[r]
        for when, shapes_list in (("between steps", seen.at_rest),
                                  ("after forward returned", seen.after_forward)):  # fmt: skip
            for shapes in shapes_list:
                for name in SHARDED_PARAMS:
                    numel = math.prod(shapes[name])
                    require(
                        numel <= shard_size(name, p),
                        f"{when}, {name} holds {numel} elements, more than its shard of "
                        f"{shard_size(name, p)}: between uses a rank keeps only its shard",
                    )
        if p > 1:
            tolerance = options.tolerance_for(dtype)
            record.details[f"rank {r}"] = check_record(out, r, p, dtype, "memory", tolerance)
        passes = held.traffic.gates[r]
        record.details[f"resident rank {r}"] = {g.label: g.resident for g in passes if g.resident}
        problem = resident.broken(passes, resident.fsdp(p, dtype))
        require(problem is None, f"{resident.MODEL}, compute_dtype={dtype}: {problem}")

    on_every_rank(p, check)


@pytest.mark.graded(target="fully_sharded.FullyShardedDataParallel", kind="communication")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_communication(world: World, options: TestOptions, record: TestRecord, dtype: str) -> None:
    p = world.size
    out = train_call(world, "sgd", dtype, f"sgd-{dtype}")
    bound, ratio = bytes_bound(p, dtype), options.bytes_ratio("FullyShardedDataParallel")
    tolerance = options.tolerance_for(dtype)
    record.details["bound"] = bound

    def check(r: int) -> None:
        check_record(out, r, p, dtype, "communication", tolerance)
        for number in range(1, STEPS + 1):  # each step needs the last one's updates
            where = f"step {number}: " if number > 1 else ""
            local = local_grads(dtype, p, r, number)  # this rank's own gradients, once
            try:
                total = step_messages(step_of(out.traffic, r, number), p, local, tolerance)
                late = late_scatter(out.traffic, r, number, p)
                require(late is None, str(late))
            except AssertionError as err:
                raise AssertionError(f"{where}{err}") from None
            most = record.details.setdefault("bytes", {})
            most[r] = max(most.get(r, 0.0), total)
            require(
                total <= ratio * bound + 1e-9,
                f"{where}one step moves {total:.0f} bytes on rank {r}, {total / bound:.2f}x the "
                f"bound of {bound:.0f} (gather, gather again for the Linear layers, "
                "reduce-scatter in float32, all-reduce of the replicated parameters); allowed "
                f"{ratio}x",
            )

    on_every_rank(p, check)
