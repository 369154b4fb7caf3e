"""Linux's parent-death signal, shared by the launcher's forkserver and its ranks (stdlib only: the forkserver
arms it before it imports torch).

``prctl(PR_SET_PDEATHSIG, sig)`` (man 2 prctl) asks the kernel to send ``sig`` to this process when its parent dies
-- precisely, when the *thread* that created it ends. The kernel sends it, so it works however the parent died
(SIGKILL included) and however busy the machine is. It is not inherited by children and not available outside
Linux.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
CALLER_PID_ENV = "COURSE_LAUNCH_CALLER_PID"
"""Set by the caller for its forkserver: whose death to watch for (``course_lib.runtime._forkserver``)."""
CALLER_MODULES_ENV = "COURSE_LAUNCH_CALLER_MODULES"
"""Set by the caller for its forkserver: the library modules to import for the ranks (comma-separated)."""


def arm_parent_death_signal(sig: signal.Signals) -> bool:
    """Have the kernel send ``sig`` to this process when its parent (thread) ends; replaces any signal armed before.
    Returns False where it cannot (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig)) == 0
    return False
