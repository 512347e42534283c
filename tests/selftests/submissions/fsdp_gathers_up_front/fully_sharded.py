"""The first layer's pre-forward hook gathers every layer at once ("prefetch everything"):
each gather carries one shard, the values are right, but the whole model is alive at once.
"""

from reference.fully_sharded import *  # noqa: F403

PREFETCH = 100  # the bug: the reference reads this global in its pre-forward hook
