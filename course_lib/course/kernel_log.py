"""The course kernel's start-up log without a notice a learner cannot act on.

ipykernel logs "Kernel is running over TCP without encryption ..." each time a kernel starts over TCP
(``ipykernel/kernelapp.py``, ``init_sockets``): five lines per kernel in the terminal of ``make lab``. The course's
kernels talk to JupyterLab over 127.0.0.1 only, every message signed with the connection's key, so there is
nothing to do about it. (Unix sockets, ``KernelManager.transport=ipc``, avoid the notice but fail where the
runtime folder's path is longer than a socket path may be, 107 bytes on Linux.)

    python -m course_lib.course.kernel_log      # make setup runs it: writes the config below into the environment

``install`` writes ``<sys.prefix>/etc/ipython/ipython_kernel_config.json``, which every kernel of this environment
reads (IPython's ``ENV_CONFIG_DIRS``): a logging filter on the kernel app's console handler that drops that one
message; every other log line, and everything a cell prints, is unchanged.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

UNENCRYPTED = "Kernel is running over TCP without encryption"
CONFIG: dict[str, Any] = {"IPKernelApp": {"logging_config": {
    "filters": {"course_tcp_notice": {"()": "course_lib.course.kernel_log.WithoutTcpNotice"}},
    "handlers": {"console": {"filters": ["course_tcp_notice"]}},
}}}


class WithoutTcpNotice(logging.Filter):
    """Drops the unencrypted-TCP notice, keeps every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(UNENCRYPTED)


def install(prefix: str = sys.prefix) -> Path:
    """Write the kernel config into the environment at ``prefix``, keeping any other setting already there."""
    path = Path(prefix) / "etc" / "ipython" / "ipython_kernel_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        config = {}
    config.setdefault("IPKernelApp", {})["logging_config"] = CONFIG["IPKernelApp"]["logging_config"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1) + "\n")
    return path


if __name__ == "__main__":
    print(f"the kernel's start-up log without the TCP notice: {install()}")
