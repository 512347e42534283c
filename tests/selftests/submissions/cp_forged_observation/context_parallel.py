"""An attack on what the grader's scenario reports: the reference's attention, and at import
the scenario's ``attention`` replaced in the rank's process by one that puts a string where
dq is due. The trusted side reads what a rank returned into one checked record: a malformed
one is the rank's broken protocol, never a KeyError or TypeError of the grader's.
"""

import grader.scenarios.context_parallel as _scenario
from reference.context_parallel import *  # noqa: F403

_attention = _scenario.attention


def _forged(*args, **kwargs):
    seen = _attention(*args, **kwargs)
    seen["dq"] = "a forged gradient"
    return seen


_scenario.attention = _forged
