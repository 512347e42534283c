"""Every reduce-scatter deferred to finish_gradient_synchronization: the backward keeps each
full gradient and posts nothing, the values and the bytes are right, but no communication
overlaps the backward.
"""

from reference import fully_sharded as _reference
from reference.fully_sharded import *  # noqa: F403

_start_reduce_scatter = _Sharded.start_reduce_scatter  # noqa: F405


def _keep(self, full_grad):
    self.kept = full_grad  # the bug: nothing is posted during the backward


_Sharded.start_reduce_scatter = _keep  # noqa: F405


class FullyShardedDataParallel(_reference.FullyShardedDataParallel):
    def finish_gradient_synchronization(self):
        for _, shards in self._layers:
            for sharded in shards:
                if getattr(sharded, "kept", None) is not None:
                    _start_reduce_scatter(sharded, sharded.kept)
                    sharded.kept = None
        super().finish_gradient_synchronization()
