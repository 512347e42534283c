"""Backward's first unpack gathers every saved weight again at once, in FORWARD order.

Values and bytes are right; the backward's gathers run against the order backward needs them.
"""

from reference import fully_sharded as _reference
from reference.fully_sharded import *  # noqa: F403


class FullyShardedDataParallel(_reference.FullyShardedDataParallel):
    def _pack(self, tensor):
        packed = super()._pack(tensor)
        if not isinstance(packed, type(tensor)):
            self.__dict__.setdefault("_saved", []).append(packed[0])
        return packed

    def _unpack(self, packed):
        for sharded in self.__dict__.pop("_saved", []):  # the bug: all of them, forward order
            sharded.wait_gather()
        return super()._unpack(packed)
