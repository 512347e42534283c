"""An attack on what the grader's scenario reports: the reference's layer, and at import the
scenario's ``forward_backward`` replaced in the rank's process by one that drops the tokens'
gradient from its return. The trusted side reads what a rank returned into one checked
record: a malformed one is the rank's broken protocol, never a KeyError of the grader's.
"""

import grader.scenarios.expert_parallel as _scenario
from reference.expert_parallel import *  # noqa: F403

_forward_backward = _scenario.forward_backward


def _forged(*args, **kwargs):
    seen = _forward_backward(*args, **kwargs)
    seen.pop("input_grad", None)  # idempotent: the module may be imported again
    return seen


_scenario.forward_backward = _forged
