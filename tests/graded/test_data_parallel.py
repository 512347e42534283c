"""Graded tests of ``assignments/data_parallel.py``: DataParallel (DDP) and ShardedOptimizer.

The oracle is the same work done on one process, in float64 (any honest summation order
agrees to ~1e-15, so a tolerance of 1e-9 leaves no bug unseen).

- ``data_parallel_training``: a model with a tied weight (``embed.weight`` is also
  ``head.weight``), a frozen layer and a buffer, seeded differently on every rank, is wrapped
  and trained a few steps of SGD or AdamW, each rank on its slice of the batch. Right after
  wrapping every rank must hold rank 0's parameters and buffers; after each synchronization
  the gradients, and after each step the parameters, must equal those of the model trained
  on the full batch on one process. The message names the first step and parameter that
  diverge, by how much, and the usual mistake behind it: gradients summed, not averaged;
  never reduced; a tied weight counted twice; a frozen parameter given a gradient.
- ``overlap`` (schedule): observed, not assumed. Around backward + finish the all-reduces are
  recorded: the first must be called before ``backward()`` returns, and their number and
  bytes must match the bucketing.
- ``sharded_optimizer``: ZeRO-1 against the unsharded optimizer (SGD with momentum, AdamW):
  7 parameters (p divides none of 2, 3, 4) in two groups, the second added with
  ``add_param_group``; a step where one parameter has no gradient; ``zero_grad`` between.
- ``sharded_optimizer_state``: the bytes of the tensors in the ``state`` of the
  ShardedOptimizer and of any optimizer it holds, about 1/p of the unsharded optimizer's.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import time
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from grader.rank.context import TestContext
from grader.rank.p2p import PeerGone

DIM, ROWS, STEPS = 8, 12, 3  # ROWS: the full batch, split evenly over 1, 2, 3 or 4 ranks
TIED, TIED_ALIAS = "embed.weight", "head.weight"
# Trainable gradients in registration order: embed.weight 512 B, hidden.weight 512 B,
# hidden.bias 64 B, head.bias 64 B (float64). A 600-byte cap packs them greedily into 3
# buckets in reverse registration order ([head.bias, hidden.bias], [hidden.weight],
# [embed.weight]) and in forward order alike: exactly 3 all-reduces either way.
BUCKETS = {"per_parameter": (0.0, 4), "few_buckets": (600 / 2**20, 3), "one_bucket": (25.0, 1)}
RULES = {
    "per_parameter": "bucket_size_mb=0 means one bucket per trainable parameter",
    "few_buckets": "greedy packing of the 4 gradients (512, 512, 64, 64 bytes) into buckets "
    "of at most 600 bytes gives 3",
    "one_bucket": "all 1152 bytes of gradients fit in one bucket",
}
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1}), "adamw": (torch.optim.AdamW, {"lr": 0.01})}


class TiedNet(nn.Module):
    """embed and head share one weight; ``frozen`` is not trained; ``scale`` is a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM, bias=False)
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)
        self.hidden = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, DIM)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.rand(DIM) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.embed(x) * self.scale)
        return self.head(torch.tanh(self.hidden(self.frozen(h))))


def build_net(seed: int) -> TiedNet:
    torch.manual_seed(seed)
    return TiedNet().double()


def batch(step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(500 + step)
    x = torch.randn(ROWS, DIM, generator=generator, dtype=torch.float64)
    return x, torch.randn(ROWS, DIM, generator=generator, dtype=torch.float64)


def local(t: Tensor, rank: int, p: int) -> Tensor:
    return t.tensor_split(p)[rank]


def gather(ctx: TestContext, value: object) -> list[Any]:
    """Every rank's ``value``, through a group of the grader's own (no student message in it)."""
    timeout = datetime.timedelta(seconds=3 * ctx.test.op_timeout)
    group = dist.new_group(backend="gloo", timeout=timeout)
    values: list[Any] = [None] * ctx.world_size
    try:
        dist.all_gather_object(values, value, group=group)
    except RuntimeError as err:
        raise PeerGone("the grader's exchange of results", -1) from err
    return values


def close(got: Tensor, want: Tensor) -> bool:
    return got.shape == want.shape and bool(((got - want).abs() <= 1e-9 * (1 + want.abs())).all())


def difference(got: Tensor, want: Tensor) -> str:
    got, want = got.detach(), want.detach()
    error = (got - want).abs()
    at = tuple(int(i) for i in torch.unravel_index(error.argmax(), error.shape))
    return (
        f"differs by {float(error.max()):.3g} (max abs; at {list(at)}: expected "
        f"{float(want[at]):.6g}, got {float(got[at]):.6g})"
    )


def initial_mismatch(module: nn.Module, expected: nn.Module) -> str | None:
    """This rank's first parameter or buffer that differs from rank 0's initial one, if any."""
    want = dict(itertools.chain(expected.named_parameters(), expected.named_buffers()))
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        if name in want and not close(t.detach(), want[name].detach()):
            kind = "buffer" if name in dict(expected.named_buffers()) else "parameter"
            error = float((t.detach() - want[name]).abs().max())
            return f"{kind} {name} differs from rank 0's by {error:.3g} (max abs)"
    return None


def gradient_problem(model: nn.Module, oracle: nn.Module, single: nn.Module, p: int) -> str | None:
    """What is wrong with the gradients after synchronization, most telling mistake first.

    ``oracle`` holds the full batch's gradients, ``single`` this rank's own, unreduced ones."""
    want = {n: q.grad for n, q in oracle.named_parameters()}
    mine = {n: q.grad for n, q in single.named_parameters()}
    got = {n: q.grad for n, q in model.named_parameters()}
    for name, g in got.items():
        if want.get(name) is None and g is not None:
            return (
                f"frozen parameter {name} (requires_grad=False) has a gradient: leave frozen "
                "parameters out of the buckets and never give them a .grad"
            )
        if want.get(name) is not None and g is None:
            return f"parameter {name} has no gradient (.grad is None)"
    names = [n for n, g in want.items() if g is not None]
    wrong = [n for n in names if not close(got[n], want[n])]
    if not wrong:
        return None
    if p > 1 and all(close(got[n], p * want[n]) for n in names):
        return (
            f"every gradient is {p}x the one-process gradient: the gradients were summed over "
            f"the {p} ranks, not averaged (divide by the world size)"
        )
    if p > 1 and all(close(got[n], mine[n]) for n in wrong):
        return f"{wrong[0]}'s gradient is this rank's own: it was never all-reduced"
    if wrong == [TIED] and close(got[TIED], 2 * want[TIED]):
        return (
            f"the tied weight {TIED} (also {TIED_ALIAS}) has 2x its gradient while the others "
            "are right: a shared parameter's gradient was reduced (or added) twice; module."
            "parameters() lists it once: hook and bucket it once"
        )
    return f"parameter {wrong[0]}'s gradient {difference(got[wrong[0]], want[wrong[0]])}"


@pytest.mark.graded(target="data_parallel.DataParallel", kind="correctness")
@pytest.mark.parametrize("bucket", list(BUCKETS))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_data_parallel_training(
    ctx: TestContext, student: ModuleType, rank: int, world_size: int, optimizer: str, bucket: str
) -> None:
    p, (size_mb, _), (cls, kwargs) = world_size, BUCKETS[bucket], OPTIMIZERS[optimizer]
    what = f"DataParallel(bucket_size_mb={size_mb:g}) with {cls.__name__} on {p} ranks"
    oracle = build_net(seed=1000)  # rank 0's initial model, trained on the full batch
    dp = student.DataParallel(build_net(seed=1000 + rank), bucket_size_mb=size_mb)
    model = getattr(dp, "module", None)
    assert isinstance(model, nn.Module), f"{what}: keep the wrapped model as DataParallel.module"
    mismatches = gather(ctx, initial_mismatch(model, oracle))
    bad = next((r for r, m in enumerate(mismatches) if m), None)
    assert bad is None, (
        f"{what}: right after DataParallel(model), rank {bad}'s {mismatches[bad]}: __init__ "
        "must make every rank's parameters and buffers equal to rank 0's (broadcast them; the "
        "ranks were seeded differently)"
    )
    theirs, mine = cls(oracle.parameters(), **kwargs), cls(model.parameters(), **kwargs)
    for step in range(1, STEPS + 1):
        x, y = batch(step)
        single = copy.deepcopy(oracle)  # this rank's local gradient, to recognise "not reduced"
        F.mse_loss(single(local(x, rank, p)), local(y, rank, p)).backward()
        F.mse_loss(oracle(x), y).backward()
        F.mse_loss(dp(local(x, rank, p)), local(y, rank, p)).backward()
        dp.finish_gradient_synchronization()
        problem = gradient_problem(model, oracle, single, p)
        if problem and step > 1 and problem.startswith(("parameter", f"{TIED}'s")):
            problem += "; step 1 was right: is the per-iteration state reset after each step?"
        assert problem is None, f"{what}, step {step}, after synchronization: {problem}"
        theirs.step()
        mine.step()
        want = dict(oracle.named_parameters())
        for name, q in model.named_parameters():
            assert close(q.detach(), want[name].detach()), (
                f"{what}: after step {step}, parameter {name} {difference(q, want[name])}"
            )
        theirs.zero_grad()
        mine.zero_grad()


@pytest.mark.graded(target="data_parallel.DataParallel", kind="schedule")
@pytest.mark.parametrize("bucket", list(BUCKETS))
def test_overlap(
    ctx: TestContext, student: ModuleType, rank: int, world_size: int, bucket: str
) -> None:
    (size_mb, expected), p = BUCKETS[bucket], world_size
    dp = student.DataParallel(build_net(seed=1000), bucket_size_mb=size_mb)
    trainable = [q for q in dp.module.parameters() if q.requires_grad]
    grad_bytes = sum(q.numel() * q.element_size() for q in trainable)
    counts: list[int] = []
    for iteration in (1, 2):  # the second shows whether the per-iteration state is reset
        x, y = batch(iteration)
        loss = F.mse_loss(dp(local(x, rank, p)), local(y, rank, p))
        with ctx.recording() as log:
            loss.backward()
            returned = time.perf_counter()
            dp.finish_gradient_synchronization()
        reduces = log.collectives("all_reduce", "allreduce")
        counts.append(len(reduces))
        lead = returned - reduces[0].time if reduces else 0.0
        ctx.extra.update(
            all_reduces=counts,
            expected_all_reduces=expected,
            all_reduce_bytes=[e.nbytes for e in reduces],
            first_all_reduce_before_backward_returned_ms=round(1e3 * lead, 3),
        )
        where = f"DataParallel(bucket_size_mb={size_mb:g}) on {p} ranks, iteration {iteration}"
        again = f" (iteration 1 made {counts[0]}: reset the per-iteration state)" * (iteration > 1)
        assert reduces, f"{where}: no all-reduce was called during backward and finish{again}"
        assert lead > 0, (
            f"{where}: the first gradient all-reduce was called {-1e3 * lead:.2f} ms after "
            "loss.backward() returned, so no communication overlapped the backward pass: launch "
            "each bucket's all-reduce (async_op=True) from a gradient hook as soon as all its "
            "gradients are ready, and only wait for it in finish_gradient_synchronization()"
        )
        assert len(reduces) == expected, (
            f"{where}: {len(reduces)} gradient all-reduces in one step, expected {expected}: "
            f"{RULES[bucket]} (the tied weight counts once, the frozen layer not at all)"
        )
        total = sum(e.nbytes for e in reduces)
        assert total == grad_bytes, (
            f"{where}: the all-reduces carried {total} bytes, the trainable gradients hold "
            f"{grad_bytes}: reduce each gradient exactly once (none for frozen parameters)"
        )


SHAPES = [(4, 8), (8,), (6, 8), (20,), (6, 6), (24,), (5, 8)]  # 7 parameters, uneven sizes
SHARDED = {  # optimizer, its kwargs, the second param group's own hyperparameters
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9), dict(lr=0.05, weight_decay=0.1)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1), dict(lr=0.03, betas=(0.8, 0.9))),
}


def param_groups(second: dict[str, Any]) -> tuple[list[nn.Parameter], list[dict[str, Any]]]:
    generator = torch.Generator().manual_seed(77)
    params = [nn.Parameter(torch.randn(s, generator=generator).double()) for s in SHAPES]
    return params, [{"params": params[:4]}, {"params": params[4:], **second}]


def set_grads(params: list[nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(900 + step)
    for i, q in enumerate(params):
        g = torch.randn(q.shape, generator=generator, dtype=torch.float64)
        q.grad = None if (step == 2 and i == 3) else g  # at step 2, parameter 3 has no gradient


def state_bytes(optimizer: torch.optim.Optimizer) -> list[int]:
    """Bytes of state per entry of ``optimizer.state`` and of the state of every optimizer it
    holds as an attribute (alone, or in a list, tuple or dict)."""
    found = [optimizer]
    for value in vars(optimizer).values():
        items = list(value.values()) if isinstance(value, dict) else value
        for item in items if isinstance(items, (list, tuple)) else [items]:
            if isinstance(item, torch.optim.Optimizer) and item not in found:
                found.append(item)
    seen: set[int] = set()
    per_entry = [0]
    for o in found:
        for entry in o.state.values():
            fresh = [t for t in dict(entry).values() if isinstance(t, Tensor) and id(t) not in seen]
            seen.update(id(t) for t in fresh)
            per_entry.append(sum(t.nbytes for t in fresh))
    return per_entry


def run_sharded(student: ModuleType, name: str, p: int) -> tuple[Any, torch.optim.Optimizer]:
    """Four steps of the student's ShardedOptimizer and of the unsharded one; both returned."""
    cls, kwargs, second = SHARDED[name]
    what = f"ShardedOptimizer({cls.__name__}) on {p} ranks"
    (mine, groups), (theirs, full) = param_groups(second), param_groups(second)
    defaults, plain = param_groups({})  # to recognise the second group's settings ignored
    opt = student.ShardedOptimizer(groups[:1], cls, **kwargs)
    opt.add_param_group(groups[1])
    oracle = cls(full, **kwargs)
    ignoring = cls(plain, **kwargs)
    for step in range(1, 5):
        for params in (mine, theirs, defaults):
            set_grads(params, step)
        before = [q.detach().clone() for q in mine]
        for optimizer in (opt, oracle, ignoring):
            optimizer.step()
        for i, (q, want) in enumerate(zip(mine, theirs, strict=True)):
            if close(q.detach(), want.detach()):
                continue
            hint = ""
            if torch.equal(q.detach(), before[i]):
                hint = ": it was not updated on this rank (broadcast it from its owner)"
            elif close(q.detach(), defaults[i].detach()):
                hint = f": updated with {kwargs}, not its param group's own {second}"
            where = f"{what}: after step {step}, parameter {i} (group {int(i >= 4)})"
            raise AssertionError(f"{where} {difference(q, want)}{hint}")
        opt.zero_grad()
        kept = [i for i, q in enumerate(mine) if q.grad is not None and bool(q.grad.any())]
        assert not kept, (
            f"{what}: after zero_grad(), parameter {kept[0]} still has a gradient: "
            "zero_grad() must clear every parameter's gradient, not only this rank's shard"
        )
        oracle.zero_grad()
        ignoring.zero_grad()
    return opt, oracle


@pytest.mark.graded(target="data_parallel.ShardedOptimizer", kind="correctness")
@pytest.mark.parametrize("optimizer", list(SHARDED))
def test_sharded_optimizer(student: ModuleType, world_size: int, optimizer: str) -> None:
    run_sharded(student, optimizer, world_size)


@pytest.mark.graded(target="data_parallel.ShardedOptimizer", kind="correctness")
def test_sharded_optimizer_state(
    ctx: TestContext, student: ModuleType, rank: int, world_size: int
) -> None:
    opt, oracle = run_sharded(student, "adamw", world_size)
    per_param, mine = state_bytes(oracle), sum(state_bytes(opt))
    total, per_rank = sum(per_param), gather(ctx, mine)
    # Owners chosen greedily by size never exceed total/p + one parameter's state; 64 bytes
    # of slack for AdamW's scalar step counters (4 bytes a parameter), which ignore the size.
    allowed = total // world_size + max(per_param) + 64
    ctx.extra.update(state_bytes_per_rank=per_rank, unsharded_state_bytes=total)
    ctx.extra["allowed_bytes_per_rank"] = allowed
    what = f"ShardedOptimizer(AdamW) on {world_size} ranks"
    assert mine <= allowed, (
        f"{what}: rank {rank} holds {mine} bytes of optimizer state, the unsharded AdamW "
        f"{total}: each rank should keep state only for its own shard, about 1/{world_size} "
        f"(at most {allowed} bytes here)"
    )
    assert sum(per_rank) >= total, (
        f"{what}: found {sum(per_rank)} bytes of optimizer state over all ranks, the unsharded "
        f"AdamW holds {total}: keep the state in the .state of a torch.optim optimizer held as "
        "an attribute (e.g. self.local_optimizer)"
    )
