"""ShardedOptimizer's zero_grad clears only the gradients of this rank's own shard.

Every step is the reference's, and so is the optimizer state; only zero_grad is wrong.
"""

from reference import data_parallel as _reference
from reference.data_parallel import *  # noqa: F403


class ShardedOptimizer(_reference.ShardedOptimizer):
    def zero_grad(self, set_to_none: bool = True) -> None:
        self._local.zero_grad(set_to_none)  # the bug: the other ranks' shards keep theirs
