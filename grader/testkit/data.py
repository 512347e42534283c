"""Seeded inputs that differ per rank and per test, and that every rank can recompute.

Each rank can build any other rank's input from the same seed, so the
expected result is computed locally, without trusting any communication.
Values are chosen so that mistakes show: every rank's data differs, and for
bfloat16 they are small integers, whose sums are exact in any order.
"""

from __future__ import annotations

import zlib

import torch


def seed_for(key: str, rank: int) -> int:
    return zlib.crc32(f"{key}/rank{rank}".encode())


def rank_tensor(
    key: str,
    rank: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    contiguous: bool = True,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Rank ``rank``'s input for the case ``key``; non-contiguous if asked (every other column)."""
    generator = torch.Generator().manual_seed(seed_for(key, rank))
    full_shape = shape if contiguous else (*shape[:-1], 2 * shape[-1]) if shape else (2,)
    if dtype in (torch.float32, torch.float64, torch.float16):
        values = torch.randn(full_shape, generator=generator, dtype=torch.float64)
    elif dtype == torch.bfloat16:
        values = torch.randint(-32, 33, full_shape, generator=generator).double()
    else:
        values = torch.randint(-1000, 1001, full_shape, generator=generator).double()
    tensor = values.to(dtype=dtype, device=device)
    if not contiguous:
        tensor = tensor[..., ::2]
        assert not tensor.is_contiguous() or tensor.numel() <= 1
    return tensor
