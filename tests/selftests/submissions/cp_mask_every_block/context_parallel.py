"""Causal ring attention with the triangular mask on every block it computes, not only on the
diagonal one: a query then misses the keys of earlier ranks that sit later in their block.

Blocks of one position have no triangle to mask, and Ulysses masks the whole sequence once:
both are unaffected.
"""

from reference.context_parallel import *  # noqa: F403


def _work_on(owner, rank, causal):
    if not causal:
        return True, False
    return owner <= rank, True  # the bug: the diagonal mask on earlier blocks too
