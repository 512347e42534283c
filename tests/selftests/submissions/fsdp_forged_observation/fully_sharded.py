"""An attack on what the grader's scenario reports: the reference's wrapper, and at import the
scenario's ``train`` replaced in the rank's process by one that puts a string where step 1's
gradient of fc1.weight is due. The trusted side reads what a rank returned into one checked
record: a malformed one is the rank's broken protocol, never a KeyError of the grader's.
"""

import grader.scenarios.fully_sharded as _scenario
from reference.fully_sharded import *  # noqa: F403

_train = _scenario.train


def _forged(*args, **kwargs):
    seen = _train(*args, **kwargs)
    seen["grads"][0]["fc1.weight"] = "a forged gradient"
    return seen


_scenario.train = _forged
