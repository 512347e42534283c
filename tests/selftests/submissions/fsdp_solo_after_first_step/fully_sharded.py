"""Graded as ``fsdp_solo_gathers+fsdp_solo_after_first_step``: the reference's gathers in the
first step, and from the second step on that attack's gathers of the rank's own shard in a
group of one (itself alone), dropped, the full weights taken from a copy the ranks bring up to
date by sends of their updated shards. The values are right at every step; only the first
step's gathers reached another rank.
"""

from reference.fully_sharded import *  # noqa: F403

HONEST_STEPS = 1
