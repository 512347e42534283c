"""The gathered weight is the LAST n of the p*s gathered elements: the padding leaks in.

Where p divides a parameter's size nothing changes; elsewhere the weight is shifted by the
padding, so training diverges from the one-process model. The communication is right.
"""

from reference.fully_sharded import *  # noqa: F403
from reference.fully_sharded import _Sharded


def _wait_gather(self):
    if self.full is None:
        self.start_gather()
        self.gather_work.wait()
        self.full = self.flat[self.flat.numel() - self.numel :].view(self.shape)  # the bug
        self.gather_work = self.flat = None
    return self.full


_Sharded.wait_gather = _wait_gather
