"""An attack on what the grader's scenario reports: the reference's schedules, and at import
the scenario's ``step`` replaced in the rank's process by one that returns a string where
the stage's gradients by name are due. The trusted side reads what a rank returned
into one checked record: a malformed one is the rank's broken protocol, never a KeyError or
AttributeError of the grader's.
"""

import grader.scenarios.pipeline_parallel as _scenario
from reference.pipeline_parallel import *  # noqa: F403

_step = _scenario.step


def _forged(*args, **kwargs):
    seen = _step(*args, **kwargs)
    seen["grads"] = "forged gradients"
    return seen


_scenario.step = _forged
