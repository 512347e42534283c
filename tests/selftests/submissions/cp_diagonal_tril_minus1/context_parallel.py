"""Ring attention whose diagonal mask is off by one: it masks the diagonal too (keeps
``tril(-1)``), so a query never sees its own key, and the first query of a block has no
key at all in it: exp of a row of -inf, 0/0, NaN.
"""

import torch

from reference.context_parallel import *  # noqa: F403


def _diagonal_mask(n, device):
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(0)  # the bug: triu(1)
