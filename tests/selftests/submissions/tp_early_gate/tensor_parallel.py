"""An attack on the gate that ends the MLP's forward: ``ParallelMLP.forward`` passes the
grader's gate "backward" itself, before its all-reduce, and hands the scenario the gradient
it got there when the scenario asks for it. Its results stay right. But the broker saw the
gate passed before the forward's all-reduce: the forward, as the communication test reads
it, made no communication and the backward two all-reduces, and the test fails.
"""

import grader.scenarios.tensor_parallel as scenario
from grader.scenarios import gate
from reference.tensor_parallel import *  # noqa: F403
from reference.tensor_parallel import ParallelMLP as ReferenceMLP


class ParallelMLP(ReferenceMLP):
    def forward(self, x):
        grad = gate("backward")  # the output's gradient, early

        def answered(label):  # the scenario's own pass, answered from it once
            scenario.gate = gate
            return grad

        scenario.gate = answered
        return super().forward(x)
