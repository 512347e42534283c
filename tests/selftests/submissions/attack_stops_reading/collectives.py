"""A rank that stops reading what the grader sends it, then has it sent 64 MB.

Rank 1 replaces the function its reader thread reads the broker's frames with, so that
it sleeps at its next frame; then rank 0 sends it more than its shared ring holds, which
the broker must write into rank 1's socket. Until now the broker wrote under its one
lock: the write blocked for good once the socket's buffer was full, and with it every
other rank's frames, the call's timeout and the grader's own Ctrl-C. Now only rank 1's
writer waits: rank 0 finishes, and the call's timeout stops rank 1.
"""

import sys
import time

import torch
import torch.distributed as dist


def broadcast(tensor, src, group=None):
    wire = sys.modules["grader.wire"]
    if dist.get_rank() == 1:
        wire.recv_frame = lambda *args, **kwargs: time.sleep(3600)
    small, big = torch.zeros(1), torch.zeros(16 << 20)  # 64 MB: more than the ring holds
    if dist.get_rank() == 0:
        dist.send(small, 1)
        dist.send(big, 1)
    else:
        dist.recv(small, 0)  # the reader reads the answer to this, then sleeps
        dist.recv(big, 0)
