"""DataParallel puts a parameter larger than the bucket cap into the current bucket.

Its reasoning: such a parameter cannot fit anyway. With a cap smaller than every gradient
(and not 0, which is special-cased), all the gradients share one bucket instead of one each.
The gradients are right; only the number of all-reduces is wrong, and only for such a cap.
"""

from torch import nn

from reference import data_parallel as _reference
from reference.data_parallel import *  # noqa: F403


def _build_buckets(params: list[nn.Parameter], cap_bytes: float) -> list[_reference._Bucket]:
    """Replaces the reference's: DataParallel.__init__ looks this module's name up."""
    buckets: list[_reference._Bucket] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        fits = size + nbytes <= cap_bytes or nbytes > cap_bytes > 0  # the bug: the second clause
        if not buckets or not fits or buckets[-1].params[0].dtype != p.dtype:
            buckets.append(_reference._Bucket(params=[]))
            size = 0
        buckets[-1].params.append(p)
        size += nbytes
    return buckets

