"""A flood of the grader's memory that each rank's own limits allow: with one bucket, every
rank all-reduces 31 tensors of 32 MiB in a group of its own (completed at once, each kept in
the call's record), 992 MiB a rank, under the 1 GiB a rank may have recorded: at 4 ranks,
nearly 4 GB of the grader's memory in one call. The call's budget for every rank together
stops it: the rank that passes it is blamed, its test fails, and the grader goes on to the
next test. Every other bucket size is the reference's, and earns its points.
"""

import torch
import torch.distributed as dist

from reference.data_parallel import *  # noqa: F403
from reference.data_parallel import DataParallel as ReferenceDataParallel

FLOODS, MIB = 31, 1 << 20


class DataParallel(ReferenceDataParallel):
    def __init__(self, module, bucket_size_mb=25.0):
        super().__init__(module, bucket_size_mb)
        if bucket_size_mb == 25.0:
            groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
            alone = groups[dist.get_rank()]
            flood = torch.ones(32 * MIB // 4)
            for _ in range(FLOODS):
                dist.all_reduce(flood, group=alone)
