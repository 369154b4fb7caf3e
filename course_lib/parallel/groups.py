"""What every parallel form needs of ``course_lib.runtime.mesh.Mesh``: some axes' process group."""

from typing import Protocol

import torch.distributed as dist


class HasGroups(Protocol):
    def group(self, *axes: str) -> dist.ProcessGroup: ...
