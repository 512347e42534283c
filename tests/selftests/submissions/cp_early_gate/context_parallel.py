"""An attack on the gate that ends the forward: ``ring_attention`` passes the grader's gate
"backward" itself, before its forward sends anything, and hands the scenario the gradient it
got there when the scenario asks for it. Its results stay right. But the broker saw the gate
passed before every message of the forward: the forward, as the communication test reads
it, sent no K/V block, and the test fails.
"""

import grader.scenarios.context_parallel as scenario
from grader.scenarios import gate
from reference import context_parallel as honest
from reference.context_parallel import *  # noqa: F403


def ring_attention(q, k, v, causal=False, group=None):
    grad = gate("backward")  # the gradient, early
    scenario.gate = lambda label: grad  # the scenario's own pass is answered from it
    return honest.ring_attention(q, k, v, causal, group)
