"""What every parallel form needs of ``course_lib.runtime.mesh.Mesh``: the process group of some of its axes."""

from typing import Protocol

import torch.distributed as dist


class HasGroups(Protocol):
    def group(self, *axes: str) -> dist.ProcessGroup: ...
