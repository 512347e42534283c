"""Graded tests of ``DataParallel`` (DDP) in ``assignments/data_parallel.py``.

The ranks run the scenarios of :mod:`grader.scenarios.data_parallel` on inputs made here
from a secret seed; the oracle is the same work done here on one process, in float64 (any
honest summation order agrees to ~1e-15, so a tolerance of 1e-9 leaves no bug unseen).
The ShardedOptimizer's tests are in ``test_sharded_optimizer.py``.

- ``data_parallel_training``: a model with a tied weight (``embed.weight`` is also
  ``head.weight``), a frozen layer and a buffer, initialised differently on every rank, is
  wrapped and trained a few steps of SGD or AdamW, each rank on its slice of the batch. Right
  after wrapping every rank must hold rank 0's parameters and buffers; after each
  synchronization the gradients, and after each step the parameters, must equal those of the
  model trained on the full batch on one process. The message names the rank, the first step
  and parameter that diverge, by how much, and the usual mistake behind it: gradients summed,
  not averaged, or scaled by any other uniform factor; never reduced; a tied weight counted
  twice; a frozen parameter given a gradient; a bucket in a lower precision than the gradients.
  The bucket caps include one (40 bytes) smaller than every parameter: each its own bucket.
- ``unused_parameter``: the same training with plain SGD, but in iteration 2 the model skips
  its ``hidden`` layer on every rank, so ``hidden.weight`` and ``hidden.bias`` get no gradient
  and their hooks never fire. Right DDP neither hangs nor reduces garbage: afterwards their
  gradients are None (as torch's DDP leaves them) or zero (as the assignment's hint gives;
  under plain SGD both give the one-process step), and every other gradient is right.
- ``overlap`` (schedule): observed, not assumed, from the broker's record of each rank's
  operations against the grader's gates: each iteration's batch handed over before its
  forward, and a secret factor where backward reaches the embedding. Each iteration's
  all-reduces (between two batches' gates) must match the bucketing in number, bytes and
  dtype, one carrying gradients already computed must have started before the embedding's
  gate (unless there is one bucket), and together they must carry the local gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch.nn.functional as F

from grader.scenarios.data_parallel import OPTIMIZERS, build
from grader.testkit import TestRecord, World, failures
from grader.testkit.data_parallel import (
    BUCKETS,
    TIED,
    all_reduces,
    batches,
    carried_problem,
    gate_problem,
    gates,
    gradient_problem,
    grads_of,
    initial_mismatch,
    initial_state,
    overlap_problem,
    overlapped,
    param_problem,
    slices,
    trained,
)
from grader.testkit.explain import blame

UNUSED_STEP, UNUSED = 2, ("hidden.weight", "hidden.bias")  # skipped in that iteration
UNUSED_HINT = (
    f"in iteration {UNUSED_STEP} the model skips its hidden layer on every rank: "
    f"{' and '.join(UNUSED)} get no gradient and their hooks never fire, so "
    "finish_gradient_synchronization() must launch every bucket still waiting (buckets go in "
    "order: the later ones wait too), with zeros for the missing gradients or without them, "
    "and leave those gradients None or zero"
)


# -- DataParallel ----------------------------------------------------------------------------


def check_training(world: World, optimizer: str, bucket: str, unused_step: int = 0) -> None:
    """Train on the ranks and compare every step with the one-process oracle.

    In iteration ``unused_step`` (0: none) the model skips its hidden layer, there and here.
    """
    p, (size_mb, _), (cls, kwargs) = world.size, BUCKETS[bucket], OPTIMIZERS[optimizer]
    what = f"DataParallel(bucket_size_mb={size_mb:g}) with {cls.__name__} on {p} ranks"
    states, full = [initial_state(r) for r in range(p)], batches()
    args = [(states[r], optimizer, size_mb, slices(full, r, p), unused_step) for r in range(p)]
    try:
        out = world.call(scenario="data_parallel.train", args=args, case=what)
    except failures.RankFailure as err:
        if not unused_step or isinstance(err, failures.NotImplementedYet):
            raise
        raise err.with_hint(UNUSED_HINT) from err
    seen = trained(out.returned, what)
    keep = "keep the wrapped model as DataParallel.module (found {})"
    blame(what, [s.module and keep.format(s.module) for s in seen])
    mismatches = [initial_mismatch(s.initial, states[0]) for s in seen]
    for bad, mismatch in enumerate(mismatches):
        if mismatch:
            raise AssertionError(
                f"{what}: right after DataParallel(model), rank {bad}'s {mismatch}: __init__ "
                "must make every rank's parameters and buffers equal to rank 0's (broadcast "
                "them; the ranks were seeded differently)"
            )
    oracle = build(states[0])  # rank 0's initial model, trained on the full batch
    optim = cls(oracle.parameters(), **kwargs)
    for step, (x, y) in enumerate(full, start=1):
        use_hidden = step != unused_step
        singles = []  # each rank's local gradient, to recognise "never reduced"
        for r in range(p):
            single = copy.deepcopy(oracle)
            ((x_r, y_r),) = slices([(x, y)], r, p)
            F.mse_loss(single(x_r, use_hidden), y_r).backward()
            singles.append(grads_of(single))
        F.mse_loss(oracle(x, use_hidden), y).backward()
        want = grads_of(oracle)
        unused = () if use_hidden else UNUSED
        problems = [
            gradient_problem(s.grads[step - 1], want, singles[r], p, unused)
            for r, s in enumerate(seen)
        ]
        if not use_hidden:
            problems = [m and f"{m} ({UNUSED_HINT})" for m in problems]
        elif step > 1:
            problems = [
                f"{m}; step {step - 1} was right: is the per-iteration state reset after each step?"
                if m and m.startswith(("parameter", f"{TIED}'s"))
                else m
                for m in problems
            ]
        blame(f"{what}, step {step}, after synchronization", problems)
        optim.step()
        params = {n: q.detach() for n, q in oracle.named_parameters()}
        blame(
            f"{what}, after step {step}",
            [param_problem(s.params[step - 1], params) for s in seen],
        )
        optim.zero_grad()


@pytest.mark.graded(target="data_parallel.DataParallel", kind="correctness")
@pytest.mark.parametrize("bucket", list(BUCKETS))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_data_parallel_training(world: World, optimizer: str, bucket: str) -> None:
    check_training(world, optimizer, bucket)


@pytest.mark.graded(target="data_parallel.DataParallel", kind="correctness")
@pytest.mark.parametrize("bucket", list(BUCKETS))
def test_unused_parameter(world: World, bucket: str) -> None:
    """Plain SGD: a step with a zero gradient and a step skipping a None one agree, so both
    answers of right DDP for a globally unused parameter pass; AdamW would tell them apart."""
    check_training(world, "sgd", bucket, unused_step=UNUSED_STEP)


@pytest.mark.graded(target="data_parallel.DataParallel", kind="schedule")
@pytest.mark.parametrize("bucket", list(BUCKETS))
def test_overlap(world: World, record: TestRecord, bucket: str) -> None:
    (size_mb, expected), p = BUCKETS[bucket], world.size
    full = batches()[:2]  # the second iteration shows whether the per-iteration state is reset
    rows = [[len(x) for x, _ in slices(full, r, p)] for r in range(p)]
    args = [(initial_state(0), size_mb, rows[r]) for r in range(p)]
    where = f"DataParallel(bucket_size_mb={size_mb:g}) on {p} ranks"
    out = world.call(
        scenario="data_parallel.overlap", args=args, case=where, gates=gates(full, p, bucket)
    )
    returned = overlapped(out.returned, len(full), where)
    seen = [all_reduces(out, r) for r in range(p)]
    blame(
        where,
        [None if len(s) == len(full) else "the grader's gates were not all passed" for s in seen],
    )
    record.details.update(
        all_reduces=[len(i["before"]) + len(i["after"]) for i in seen[0]],
        all_reduces_before_the_embedding=[len(i["before"]) for i in seen[0]],
        expected_all_reduces=expected,
        all_reduce_bytes=[e.nbytes for e in seen[0][-1]["before"] + seen[0][-1]["after"]],
        all_reduce_dtypes=sorted({e.dtype for i in seen[0] for e in i["before"] + i["after"]}),
    )
    for i in range(len(full)):
        blame(f"{where}, iteration {i + 1}", [overlap_problem(s, i, bucket) for s in seen])
    # Whether they started during backward: the broker's gate at the embedding.
    record.details["gates_opened"] = [[g.opened for g in out.traffic.gates[r]] for r in range(p)]
    blame(where, [gate_problem(out, r, full, bucket, returned[r]) for r in range(p)])
    # And what the all-reduces carried: the gradients themselves, not a decoy of their size.
    blame(where, [carried_problem(out, r, full) for r in range(p)])
