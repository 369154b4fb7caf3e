"""Imported only inside the launcher's forkserver (it is in ``course_lib.launch``'s preload list), never by the
caller. The forkserver exits as soon as its caller has gone, however the caller died; on the way out it removes
the caller's launch folders (pickled payload, captured output) and then leaves at once.

The caller removes each folder itself after a launch; this covers a caller killed mid-launch (SIGKILL, SIGTERM,
SIGHUP, an immediate kernel restart), when no code of the caller runs any more. Leaving at once: the forkserver
holds nothing worth saving, and tearing down the torch it preloaded takes seconds on a busy machine.
"""

from __future__ import annotations

import atexit
import os

from course_lib import _worker


def _on_exit(caller_pid: int) -> None:
    _worker.remove_launch_dirs(caller_pid)
    os._exit(0)


atexit.register(_on_exit, os.getppid())  # registered after torch's handlers, so it runs before them
