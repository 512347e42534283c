"""Ulysses calling the all-to-alls as plain functions, not through an autograd.Function:
dist.all_to_all has no backward, so the output has no grad_fn and no gradient reaches q, k,
v. The forward is right.
"""

import torch.distributed as dist

from reference.context_parallel import *  # noqa: F403


def ulysses_attention(q, k, v, causal, group=None):
    p, heads = dist.get_world_size(group), q.size(1)
    if heads % p != 0:
        raise ValueError(f"H={heads} heads are not divisible by the context-parallel size {p}")
    q, k, v = (_sequence_to_heads(x, group) for x in (q, k, v))  # noqa: F405  the bug
    acc = _accumulation_dtype(q.dtype)  # noqa: F405
    out, _ = _block_attention(q.to(acc), k.to(acc), v.to(acc), diagonal=causal)  # noqa: F405
    return _heads_to_sequence(out.to(q.dtype), group)  # noqa: F405  the bug: no backward
