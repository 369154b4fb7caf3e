"""A pytest plugin for nbval (``make test-notebooks`` and ``make test``'s parallel lane load it): each notebook's
kernel talks to pytest over Unix sockets in Jupyter's runtime folder instead of five TCP ports of 127.0.0.1.

Why: jupyter_client picks a kernel's ports by binding port 0 and closing the socket; the kernel binds them a second
or more later. Beside the library's tests, thousands of gloo connections take ephemeral ports of the same range in
that moment: a kernel that finds its port taken dies before replying to ``kernel_info`` (the likely cause of the
one such death seen in CI; not reproduced). A socket file named after a fresh UUID cannot be taken by anyone else."""

from __future__ import annotations

import os
import uuid

import nbval.kernel
from jupyter_client.manager import KernelManager
from jupyter_core.paths import jupyter_runtime_dir
from traitlets import default


class IpcKernelManager(KernelManager):
    """nbval's ``KernelManager`` with the ``ipc`` transport and a connection file of its own (the socket files are
    named after it, and removed with it when the kernel shuts down)."""

    @default("transport")
    def _transport_default(self) -> str:
        return "ipc"

    @default("connection_file")
    def _connection_file_default(self) -> str:
        folder = jupyter_runtime_dir()
        os.makedirs(folder, exist_ok=True)
        return os.path.join(folder, f"kernel-nbval-{uuid.uuid4()}.json")


nbval.kernel.KernelManager = IpcKernelManager
