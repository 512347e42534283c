"""An attack on what the grader's scenarios report: the reference's DataParallel and
ShardedOptimizer, and at import the scenarios replaced in the rank's process by ones that
return malformed observations: a string where a gradient is due (``train``), where an
iteration's gradients are due (``overlap``) and where the kept parameters are due
(``sharded``). The trusted side reads each into one checked record: a malformed one is the
rank's broken protocol, never a KeyError or TypeError of the grader's.
"""

import grader.scenarios.data_parallel as _scenario
from reference.data_parallel import *  # noqa: F403

_train, _overlap, _sharded = _scenario.train, _scenario.overlap, _scenario.sharded


def _forged_train(*args, **kwargs):
    seen = _train(*args, **kwargs)
    seen["grads"][0]["embed.weight"] = "a forged gradient"
    return seen


def _forged_overlap(*args, **kwargs):
    seen = _overlap(*args, **kwargs)
    seen[0] = "a forged iteration"
    return seen


def _forged_sharded(*args, **kwargs):
    seen = _sharded(*args, **kwargs)
    seen["kept"][1] = "nothing kept"
    return seen


_scenario.train, _scenario.overlap = _forged_train, _forged_overlap
_scenario.sharded = _forged_sharded
