"""Ring attention whose backward passes the dK/dV partials with their block at every step
but the last: the hop home is missing, so rank r returns the dK/dV of the block it held
last, rank r+1's. The forward and dq are right.
"""

import torch
import torch.distributed as dist

from reference import context_parallel as R
from reference.context_parallel import *  # noqa: F403


class _NoHomeHop(R._RingAttention):
    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        p, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        acc = R._accumulation_dtype(q.dtype)
        q_acc, d_out = q.to(acc), grad_out.to(acc)
        delta = (d_out * out).sum(dim=-1, keepdim=True)
        dq = torch.zeros_like(q_acc)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=acc)
        for step in range(p):
            owner = (r - step) % p
            if step < p - 1:
                next_kv, kv_works = R._pass_on(kv, ctx.group)
            compute, diagonal = R._work_on(owner, r, ctx.causal)
            if compute:
                k_block, v_block = kv[0].to(acc), kv[1].to(acc)
                grads = R._block_gradients(q_acc, k_block, v_block, d_out, lse, delta, diagonal)
                dq += grads[0]
                dkv = dkv + torch.stack(grads[1:])
            if step < p - 1:  # the bug: p - 1 hops, not p; the last one brings dK/dV home
                dkv, dkv_works = R._pass_on(dkv, ctx.group)
                R._wait(dkv_works)
                R._wait(kv_works)
                kv = next_kv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q, k, v, causal, group=None):
    return _NoHomeHop.apply(q, k, v, causal, group)
