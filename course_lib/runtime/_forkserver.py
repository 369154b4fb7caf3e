"""The launcher's forkserver preload: imported only inside the forkserver (``course_lib.runtime.launch`` names this
module as its only preload), never by the caller. It makes the forkserver leave as soon as its caller has gone, however
the caller died (SIGKILL, SIGTERM, SIGHUP, a kernel restart), even on a machine whose CPUs are all busy, and then
preloads torch and the caller's library modules for the ranks.

Linux tells a process when its parent dies (``prctl(PR_SET_PDEATHSIG)``): the kernel sends a chosen signal, with
no help from the dying caller. The signal is **SIGKILL**, armed before anything is imported and kept for the
forkserver's whole life. The kernel then does all the work, whatever the CPUs are doing: no Python code of ours
has to be scheduled, which on a machine at load 12 took over 2 s once in 30 kills (a SIGTERM handler that
stopped the ranks itself). The ranks follow at once: each arms its own SIGKILL against the forkserver
(``course_lib.runtime._worker``). What the dead caller leaves is its launch folder (pickled payload, captured output):
the next launch, from any process, removes the folders of callers that no longer exist
(``_worker.remove_stale_launch_dirs``). When multiprocessing's own "alive" pipe closes instead (the caller
exits normally), the forkserver's main loop ends and ``_leave`` (an ``atexit`` handler) stops the ranks and
removes the folders before the interpreter's slow teardown.

The kernel sends the signal when the *thread* that started the forkserver ends, so the caller starts it from a
thread that lives as long as the caller (``course_lib.runtime.launch._ensure_forkserver``). A caller that died before
the signal was armed is found by its pid (``COURSE_LAUNCH_CALLER_PID``, set by the caller): we are no longer its
child. Elsewhere (macOS) the forkserver leaves when its preload is done and the pipe is closed.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import signal
from pathlib import Path

from course_lib.runtime._parent_death import CALLER_MODULES_ENV, CALLER_PID_ENV, arm_parent_death_signal

PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "cloudpickle", "course_lib.runtime._worker")
"""What the ranks find already imported, imported once the signal is armed (nothing else is imported before).
torch._dynamo: every torch.optim optimizer imports it lazily, ~3.7 s per fresh rank without the preload."""


def _children() -> list[int]:
    """This process's children, the ranks. Linux lists them in one small file: no scan of every process, which
    costs a busy machine's CPUs a second; psutil elsewhere."""
    try:
        return [int(pid) for pid in Path(f"/proc/self/task/{os.getpid()}/children").read_text().split()]
    except OSError:
        import psutil

        return [p.pid for p in psutil.Process().children()]


def _leave(caller_pid: int) -> None:
    """Stop the ranks, remove the caller's launch folders, exit now (no interpreter teardown)."""
    from course_lib.runtime import _worker  # preloaded by then

    for pid in _children():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    _worker.remove_launch_dirs(caller_pid)
    os._exit(0)


def in_forkserver() -> bool:
    """Whether this process is a launcher's forkserver: its caller set ``COURSE_LAUNCH_CALLER_PID`` and it is not
    that caller. Anywhere else (the caller itself after a launch, a tool that imports every module) importing this
    module does nothing: its signal handlers and ``os._exit`` belong to the forkserver only."""
    caller = os.environ.get(CALLER_PID_ENV)
    return caller is not None and caller.isdigit() and int(caller) != os.getpid()


def _prepare() -> None:
    """Arm SIGKILL against the caller's death, check the caller is still our parent, preload (module docstring)."""
    caller_pid = int(os.environ[CALLER_PID_ENV])
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a SIGTERM sent to us still ends us
    arm_parent_death_signal(signal.SIGKILL)
    if os.getppid() != caller_pid:  # the caller died before the signal was armed: we were handed to another parent
        os._exit(0)
    for name in PRELOAD:
        importlib.import_module(name)
    for name in filter(None, os.environ.get(CALLER_MODULES_ENV, "").split(",")):
        # The caller's library modules (``launch._rank_modules``): saves each rank their import (0.1-0.3 s). One
        # that fails here is only not preloaded: the rank that needs it imports it and reports what went wrong.
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    atexit.register(_leave, caller_pid)  # registered after torch's handlers, so it runs before them


if in_forkserver():
    _prepare()
