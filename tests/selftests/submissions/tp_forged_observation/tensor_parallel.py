"""An attack on what the grader's scenarios report: the reference's layers, and at import
some scenarios replaced in the rank's process by ones that return malformed observations:
no output (``column_forward_backward``), a number for the output's type
(``region_forward_backward``), a string where a bool is due (``mlp_forward_backward``), a
number where the ValueError's message is due (``construct``). The trusted side reads each into
one checked record: a malformed one is the rank's broken protocol, never a KeyError or
TypeError of the grader's.
"""

import grader.scenarios.tensor_parallel as _scenario
from reference.tensor_parallel import *  # noqa: F403

_column = _scenario.column_forward_backward
_region = _scenario.region_forward_backward
_mlp = _scenario.mlp_forward_backward


def _forged_column(*args, **kwargs):
    seen = _column(*args, **kwargs)
    seen.pop("output", None)
    return seen


def _forged_region(*args, **kwargs):
    return {**_region(*args, **kwargs), "output_type": 1}


def _forged_mlp(*args, **kwargs):
    return {**_mlp(*args, **kwargs), "has_column": "yes"}


def _forged_construct(*args, **kwargs):
    return 3


_scenario.column_forward_backward = _forged_column
_scenario.region_forward_backward = _forged_region
_scenario.mlp_forward_backward = _forged_mlp
_scenario.construct = _forged_construct
