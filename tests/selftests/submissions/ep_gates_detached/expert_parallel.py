"""The gates are detached from the graph before the combine.

The outputs and the experts' gradients are right, but no gradient reaches the router (it
stays zero), and the tokens' gradient misses the router's path.
"""

from reference import expert_parallel as _reference
from reference.expert_parallel import *  # noqa: F403


class ExpertParallelMoE(_reference.ExpertParallelMoE):
    def __init__(self, moe, group=None, capacity_factor=None):
        super().__init__(moe, group, capacity_factor)
        route = moe.route

        def detached(x):
            experts, gates = route(x)
            return experts, gates.detach()  # the bug

        moe.route = detached
