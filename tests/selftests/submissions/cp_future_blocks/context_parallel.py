"""Causal ring attention that computes every block: the later ranks' blocks, whose keys are all
in the future, are not skipped (only the diagonal block is masked). Queries see the future.
"""

from reference.context_parallel import *  # noqa: F403


def _work_on(owner, rank, causal):
    return True, causal and owner == rank  # the bug: no block is ever skipped
