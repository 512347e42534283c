"""Inputs that differ per rank and per test, made on the trusted side from a secret seed.

The ranks receive their inputs and nothing else: they cannot recompute
another rank's data (and so skip the communication), because the seed comes
from a secret that only the grader's process reads. The seed is also salted
with the submission's digest, so a rerun of the same submission sees the
same inputs and reproduces the same failure. Values are chosen so that
mistakes show: every rank's data differs, and for bfloat16 they are small
integers, whose sums are exact in any order.
"""

from __future__ import annotations

import hashlib
import hmac

import torch

_key: bytes | None = None


def configure(secret: bytes, salt: str) -> None:
    """Seed every later input from ``secret`` and ``salt`` (the submission's digest)."""
    global _key
    _key = hmac.new(secret, salt.encode(), hashlib.sha256).digest()


def seed_for(key: str, rank: int) -> int:
    if _key is None:
        raise RuntimeError("inputs are made only by `grader run`, which holds the secret")
    digest = hmac.new(_key, f"{key}/rank{rank}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator(key: str, rank: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed_for(key, rank))


def rank_tensor(
    key: str,
    rank: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    contiguous: bool = True,
) -> torch.Tensor:
    """Rank ``rank``'s input for the case ``key``; non-contiguous if asked (every other column)."""
    gen = generator(key, rank)
    full_shape = shape if contiguous else (*shape[:-1], 2 * shape[-1]) if shape else (2,)
    if dtype in (torch.float32, torch.float64, torch.float16):
        # Drawn in float32 unless float64 is wanted: 4 MB of inputs then take 4 ms, not 28.
        drawn = torch.float64 if dtype == torch.float64 else torch.float32
        values = torch.randn(full_shape, generator=gen, dtype=drawn)
    elif dtype == torch.bfloat16:
        values = torch.randint(-32, 33, full_shape, generator=gen).double()
    else:
        values = torch.randint(-1000, 1001, full_shape, generator=gen).double()
    tensor = values.to(dtype=dtype)
    if not contiguous:
        tensor = tensor[..., ::2]
        assert not tensor.is_contiguous() or tensor.numel() <= 1
    return tensor
