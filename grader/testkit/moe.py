"""The trusted oracle of the expert_parallel tests: the cases, their data, and what every
rank must get.

A :class:`Case` names one graded configuration; :func:`draw_layer` and :func:`draw_tokens`
make its layer and every rank's tokens from the secret seed; :func:`oracle` runs the
one-process :class:`~grader.scenarios.expert_parallel.MoE` on all ranks' tokens in float64,
with the loss ``(1/p) sum_r <y_r, g_r>``, and knows how many (token, expert) pairs each
rank keeps for each expert, from which the communication test derives the exact bytes
(``tests/graded/test_expert_parallel.py``). Routing is built in, not left to chance: token
i of rank r is moved until it prefers the (i + r)-th expert still in play (expert 0 is
starved where k < E), so every rank's experts get rows from several ranks whatever the seed.
What a rank's scenario returned is read into one checked record
(:class:`grader.testkit.moe_observed.Observed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from grader import wire
from grader.broker.traffic import Event
from grader.scenarios.expert_parallel import MoE, build_moe, identity_experts
from grader.testkit import rank_tensor
from grader.testkit.compare import carried

D, D_FF = 8, 16
TOKENS = (5, 1, 8, 3)  # T_r: different on every rank; rank 1 has a single token
MARGIN = 1e-3  # least gap between a token's k-th and (k+1)-th router probability
CAPACITY_FACTOR = 0.5


@dataclass(frozen=True)
class Case:
    p: int
    num_experts: int
    top_k: int
    capacity_factor: float | None = None
    identity: bool = False

    @property
    def key(self) -> str:
        return f"ep/{self.p}/{self.num_experts}/{self.top_k}/{self.capacity_factor}"

    @property
    def tokens(self) -> tuple[int, ...]:
        return TOKENS[: self.p]

    @property
    def capacity(self) -> int | None:
        if self.capacity_factor is None:
            return None
        total = sum(self.tokens)
        return math.ceil(self.capacity_factor * self.top_k * total / self.num_experts)

    def describe(self) -> str:
        cf = "" if self.capacity_factor is None else f", capacity_factor={self.capacity_factor}"
        return (
            f"ExpertParallelMoE of {self.num_experts} experts, top-{self.top_k}{cf}, on {self.p} "
            f"ranks with {', '.join(map(str, self.tokens))} tokens"
        )


def draw_layer(case: Case) -> dict[str, Tensor]:
    """The layer's state_dict; where k < E expert 0 is never chosen."""
    E, key = case.num_experts, case.key

    def draw(name: str, shape: tuple[int, ...], scale: float) -> Tensor:
        return rank_tensor(f"{key}/{name}", 0, shape, torch.float32) * scale

    # Orthogonal rows of norm 2 (E <= D): moving a token along row e raises logit e alone.
    assert E <= D, f"{E} experts need tokens of more than {D} features"
    rows, _ = torch.linalg.qr(draw("router.weight", (D, D), 1.0).double())
    state = {"router.weight": (2 * rows[:E]).float()}
    state["router.bias"] = draw("router.bias", (E,), 0.5)
    if case.top_k < E:
        state["router.bias"][0] = -30.0
    for e in range(E):
        state[f"experts.{e}.0.weight"] = draw(f"{e}.fc1", (D_FF, D), D**-0.5)
        state[f"experts.{e}.0.bias"] = draw(f"{e}.fc1.bias", (D_FF,), 0.5)
        state[f"experts.{e}.2.weight"] = draw(f"{e}.fc2", (D, D_FF), D_FF**-0.5)
        state[f"experts.{e}.2.bias"] = draw(f"{e}.fc2.bias", (D,), 0.5)
    return state


def draw_tokens(case: Case, moe: MoE) -> list[Tensor]:
    """Every rank's tokens: token i of rank r prefers the (i + r)-th expert still in play,
    so that every rank's experts get rows from several ranks, and rank 1's single token
    goes to an expert of rank 1's own where p = 2.

    A random row is moved along the chosen expert's router row, which raises that expert's
    logit alone (the rows are orthogonal), until it leads by one logit; the row is drawn
    again only where the k-th and (k+1)-th probabilities fall closer than ``MARGIN``."""
    E, k = case.num_experts, case.top_k
    in_play = list(range(1 if k < E else 0, E))
    weight = moe.router.weight.detach()
    xs = []
    for r, count in enumerate(case.tokens):
        rows = []
        for i in range(count):
            first = in_play[(i + r) % len(in_play)]
            for attempt in range(100):
                z = rank_tensor(f"{case.key}/x/{i}/{attempt}", r, (1, D), torch.float64)
                logits = moe.router(z)[0].detach()
                lead = (logits[in_play].max() - logits[first] + 1.0).clamp(min=0.0)
                along = weight[first] / weight[first].dot(weight[first])  # +1 logit, e only
                row = (z + lead * along).float()
                probs = moe.router(row.double()).softmax(-1)[0].detach()
                ranked = probs.sort(descending=True).values
                clear = k == E or float(ranked[k - 1] - ranked[k]) > MARGIN
                if clear and int(probs.argmax()) == first:
                    break
            else:  # the grader's own data, never the student's doing
                raise RuntimeError(f"no token routes to expert {first} with a clear margin")
            rows.append(row)
        xs.append(torch.cat(rows) if rows else torch.zeros(0, D))
    return xs


@dataclass
class Oracle:
    """What every rank must get, from the one-process layer in float64."""

    outputs: list[Tensor]
    input_grads: list[Tensor]
    grads: dict[str, Tensor]  # the gradient of (1/p) sum_r <y_r, g_r>
    local_router: list[dict[str, Tensor]]  # rank r's own loss alone: not all-reduced
    kept: Tensor  # [p, E]: pairs of rank i that expert e keeps
    state: dict[str, Tensor]  # the layer, as drawn here
    xs: list[Tensor]  # every rank's tokens, as drawn here
    upstream: list[Tensor]  # every rank's gradient of its outputs, as drawn here


def oracle(case: Case, state: dict[str, Tensor], xs: list[Tensor], gs: list[Tensor]) -> Oracle:
    moe = build_moe(state, case.num_experts, case.top_k).double()
    if case.identity:
        identity_experts(moe)
    x = torch.cat(xs).double().requires_grad_()
    y = moe(x, capacity=case.capacity)
    g = torch.cat(gs).double()
    (y * g).sum().backward()
    grads = {
        name: ((torch.zeros_like(param) if param.grad is None else param.grad) / case.p).float()
        for name, param in moe.named_parameters()
    }
    bounds = [0, *torch.tensor(case.tokens).cumsum(0).tolist()]
    rows = [slice(bounds[r], bounds[r + 1]) for r in range(case.p)]
    local_router = []
    router = list(moe.router.parameters())
    for r in range(case.p):
        mine = (moe(x, capacity=case.capacity)[rows[r]] * g[rows[r]]).sum()
        found = torch.autograd.grad(mine, router, allow_unused=True)
        names = ("router.weight", "router.bias")
        local_router.append(
            {
                n: (torch.zeros_like(w) if f is None else f).float()
                for n, w, f in zip(names, router, found, strict=True)
            }
        )
    return Oracle(
        [y.detach()[s].float() for s in rows],
        [x.grad[s].float() for s in rows],
        grads,
        local_router,
        kept_pairs(case, moe, xs),
        state,
        xs,
        gs,
    )


def kept_pairs(case: Case, moe: MoE, xs: list[Tensor]) -> Tensor:
    """``[p, E]``: how many of rank i's (token, expert) pairs expert e keeps."""
    with torch.no_grad():
        counts = torch.stack(
            [
                torch.bincount(moe.route(x.double())[0].reshape(-1), minlength=case.num_experts)
                for x in xs
            ]
        )
    if case.capacity is None:
        return counts
    before = counts.cumsum(0) - counts
    return (case.capacity - before).clamp(0).minimum(counts)


def rank_major_taken_as_expert_major(case: Case, want: Oracle) -> list[Tensor]:
    """Every rank's output if each expert's rank ran, on the rows in arrival order, expert
    l on the l-th block of ``sum over ranks of kept[:, l]`` rows."""
    moe = build_moe(want.state, case.num_experts, case.top_k).double()
    xs = [x.double() for x in want.xs]
    n, kept = case.num_experts // case.p, want.kept
    outputs = [torch.zeros_like(x) for x in xs]
    with torch.no_grad():
        pairs = {}  # (rank, expert) -> the kept (token, gate) pairs, in token order
        for i, x in enumerate(xs):
            experts, gates = moe.route(x)
            for e in range(case.num_experts):
                tokens, slots = (experts == e).nonzero(as_tuple=True)
                pairs[i, e] = list(zip(tokens, gates[tokens, slots], strict=True))[: kept[i, e]]
        for owner in range(case.p):
            mine = range(owner * n, (owner + 1) * n)
            arrived = [(i, t, g) for i in range(case.p) for e in mine for t, g in pairs[i, e]]
            blocks = [int(kept[:, e].sum()) for e in mine]
            runs = [e for e, size in zip(mine, blocks, strict=True) for _ in range(size)]
            for (i, t, g), e in zip(arrived, runs, strict=True):
                outputs[i][t] += g * moe.experts[e](xs[i][t])
    return [y.float() for y in outputs]


ROW_PASSES = ("dispatch", "combine", "backward's dispatch", "backward's combine")


def rows_carried(case: Case, want: Oracle) -> list[list[list[Tensor]]]:
    """``[r][k][j]``: the values rank r's k-th all-to-all of token rows must carry to rank j
    (:data:`ROW_PASSES`), flat in float64, in any order: the dispatch sends each kept pair's
    token row to its expert's rank, the combine returns the expert's output for it, and
    backward mirrors both: the gradient of that output (the gate times the token's upstream
    gradient) goes to the expert's rank, the gradient of the token row comes back."""
    moe = build_moe(want.state, case.num_experts, case.top_k).double()
    if case.identity:
        identity_experts(moe)
    n, p = case.num_experts // case.p, case.p
    out = [[[[] for _ in range(p)] for _ in ROW_PASSES] for _ in range(p)]
    for i, (x, g) in enumerate(zip(want.xs, want.upstream, strict=True)):
        x, g = x.double(), g.double()
        with torch.no_grad():
            experts, gates = moe.route(x)
        for e in range(case.num_experts):
            tokens, slots = (experts == e).nonzero(as_tuple=True)
            tokens, slots = tokens[: int(want.kept[i, e])], slots[: int(want.kept[i, e])]
            if not len(tokens):
                continue
            rows = x[tokens].clone().requires_grad_()
            y = moe.experts[e](rows)
            grad_y = gates[tokens, slots, None] * g[tokens]
            (grad_x,) = torch.autograd.grad(y, rows, grad_y)
            owner = e // n
            for k, (sender, to, values) in enumerate(
                [(i, owner, rows), (owner, i, y), (i, owner, grad_y), (owner, i, grad_x)]
            ):
                out[sender][k][to].append(values.detach().reshape(-1))
    return [
        [[torch.cat(v) if v else torch.zeros(0, dtype=torch.float64) for v in to] for to in passes]
        for passes in out
    ]


WHAT_ROWS = (
    "the token rows of its kept pairs routed to that rank's experts",
    "its experts' outputs for the rows that rank dispatched to them (the gate is applied "
    "where the token lives)",
    "the gradients of the outputs that rank's experts computed for this rank's tokens (the "
    "gate times the token's upstream gradient)",
    "the gradients of the rows that rank dispatched to its experts",
)


def rows_problem(case: Case, events: list[Event], expected: list[list[Tensor]]) -> str | None:
    """Why a rank's all-to-alls of token rows (dispatch, combine, then their mirrors in
    backward) do not carry, to each rank, the rows :func:`rows_carried` computed, as multisets
    of rows (:func:`same_rows`: the order of the rows within a piece is the rank's choice); or
    None. A piece of the right size holding anything else is a wrong message."""
    for k, (event, to_each) in enumerate(zip(events, expected, strict=True)):
        values, start = carried(event), 0
        itemsize = wire.DTYPES[event.dtype or "float32"].itemsize
        for j, (size, want) in enumerate(zip(event.pieces, to_each, strict=True)):
            got, start = values[start : start + size // itemsize], start + size // itemsize
            if same_rows(got, want):
                continue
            return (
                f"its {ROW_PASSES[k]} all-to-all sent rank {j} {got.numel()} values that are "
                f"not {WHAT_ROWS[k]} (the broker's record of what it carried, compared as a "
                "multiset of rows)"
            )
    return None


def messages_problem(sends: list[Event], expected: list[list[Tensor]], peer: int) -> str | None:
    """Why the token rows a rank sent rank ``peer`` as messages (its own all-to-all from
    ``send``/``recv``: ``sends``, its messages of floating-point data to that rank, in the order
    it posted them) do not carry, pass by pass (:data:`ROW_PASSES`, one after the other),
    the rows :func:`rows_carried` computed for that rank, each pass as a multiset of rows
    (:func:`same_rows`); or None."""
    values = [carried(e) for e in sends]
    stream = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
    start = 0
    for k, to_each in enumerate(expected):
        want = to_each[peer]
        got, start = stream[start : start + want.numel()], start + want.numel()
        if not same_rows(got, want):
            return (
                f"its {ROW_PASSES[k]} messages to rank {peer} carried {got.numel()} values "
                f"that are not {WHAT_ROWS[k]} (the broker's record of what its messages "
                "carried, in the order it sent them, compared as a multiset of rows)"
            )
    if start < len(stream):
        return f"it sent rank {peer} {len(stream) - start} values more than the four passes owe it"
    return None


def same_rows(got: Tensor, want: Tensor) -> bool:
    """``got`` holds ``want``'s rows (``D`` values each), in any order, each within float32's
    rounding: a row is the unit that travels (a token, an expert's output for it, or their
    gradient), so values regrouped across rows are not the same rows. Each wanted row takes
    the nearest row of ``got`` not yet taken (two different rows lie far apart)."""
    if got.numel() != want.numel() or got.numel() % D:
        return False
    if not got.numel():
        return True
    got, want = got.view(-1, D), want.view(-1, D)
    tolerance = 1e-5 * max(1.0, float(want.abs().max()))
    distance = torch.cdist(want, got, p=float("inf"))
    taken = torch.zeros(len(got), dtype=torch.bool)
    for i, row in enumerate(want):
        j = int(distance[i].masked_fill(taken, float("inf")).argmin())
        if taken[j] or not torch.allclose(got[j], row, rtol=1e-4, atol=tolerance):
            return False
        taken[j] = True
    return True


def token_order_taken_as_grouped(case: Case, want: Oracle) -> list[Tensor]:
    """Every rank's output if its kept pairs' rows were sent in token order under the split
    sizes of the grouped order: the m-th row sent is run by the expert of the m-th pair
    sorted by expert, and comes home to its own token with its own gate."""
    moe = build_moe(want.state, case.num_experts, case.top_k).double()
    outputs = []
    with torch.no_grad():
        for i, x in enumerate(want.xs):
            x = x.double()
            experts, gates = moe.route(x)
            expert, gate = experts.reshape(-1), gates.reshape(-1)
            token = torch.arange(len(x)).repeat_interleave(case.top_k)
            grouped = _first_pairs(expert, want.kept[i])
            y = torch.zeros_like(x)
            for m, j in enumerate(grouped.sort().values.tolist()):
                run = moe.experts[int(expert[grouped[m]])]
                y[token[j]] += gate[j] * run(x[token[j]])
            outputs.append(y.float())
    return outputs


def _first_pairs(expert: Tensor, kept: Tensor) -> Tensor:
    """The kept pairs sorted by expert (token order inside): of expert e's, the first kept[e]."""
    order = torch.sort(expert, stable=True).indices
    counts = torch.bincount(expert, minlength=len(kept))
    place = torch.arange(len(order)) - (counts.cumsum(0) - counts)[expert[order]]
    return order[place < kept[expert[order]]]


def no_rows_hint(case: Case, kept: Tensor) -> str:
    """Why ranks may disagree on a collective in this case: a rank with no rows for one of
    its all-to-alls (``kept``: the case's kept pairs), which it must take part in all the
    same ("" where every rank has rows both ways)."""
    n, idle = case.num_experts // case.p, {}
    for r in range(case.p):
        if not kept[:, n * r : n * (r + 1)].any():
            idle[r] = "receives no rows for its experts"
        elif not kept[r].any():
            idle[r] = "sends no rows"
    if case.p == 1 or not idle:
        return ""
    rank, what = min(idle.items())
    return (
        f"in this case rank {rank} {what}: a rank that skips an all-to-all the others post (in "
        "its backward, say, because no rows arrived) meets them with its next collective "
        "instead; every rank must take part in every all-to-all, forward and backward, even "
        "with zero-sized splits"
    )
