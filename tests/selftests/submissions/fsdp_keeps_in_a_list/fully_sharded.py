"""The wrapper keeps every layer's gathered full weight in a list of its own after the forward
(to "save the backward's gathers"): the parameters between steps are the shards, autograd
keeps only notes, the backward still gathers, the values are right. Only the process's memory
shows the full copy.
"""

from reference import fully_sharded as _reference
from reference.fully_sharded import *  # noqa: F403


class FullyShardedDataParallel(_reference.FullyShardedDataParallel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kept = []
        for index in range(len(self._layers)):
            self._layers[index][0].register_forward_hook(self._keep(index), prepend=True)

    def _keep(self, index):
        def hook(layer, args, output):
            for sharded in self._layers[index][1]:
                self._kept.append(sharded.full)  # the bug: a reference of the wrapper's own

        return hook
