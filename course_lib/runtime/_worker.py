"""What runs inside each rank process started by ``course_lib.runtime.launch`` (kept apart so the forkserver can
preload it together with torch).

A rank: sends its stdout/stderr (Python and C++) to per-rank files, arms ``faulthandler`` so the parent can ask
it where it is stuck (SIGUSR1), joins a gloo process group through the parent's TCPStore, runs the user's
function and writes its return value -- or its exception with the formatted traceback and a timestamp -- to a
file the parent reads. It always leaves with ``os._exit`` so no atexit handler or helper thread can hang it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import glob
import linecache
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import cloudpickle
import torch
import torch.distributed as dist

from course_lib.runtime._parent_death import arm_parent_death_signal

_STACK_FILE = None  # kept open for faulthandler for the life of the process
DONE_KEY = "course_launch/done"


def launch_dir_prefix(caller_pid: int) -> str:
    """Every launch folder of the process ``caller_pid`` is ``<tmp>/<this prefix><random>``."""
    return os.path.join(tempfile.gettempdir(), f"course_launch_{caller_pid}_")


def remove_launch_dirs(caller_pid: int) -> None:
    """Remove every launch folder of ``caller_pid``."""
    for path in glob.glob(glob.escape(launch_dir_prefix(caller_pid)) + "*"):
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_launch_dirs() -> None:
    """Remove the launch folders of callers that no longer exist (killed along with their forkserver)."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "course_launch_*_*")):
        pid = os.path.basename(path).split("_")[2]
        if pid.isdigit() and not _exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def rank_file(tmpdir: str, rank: int, kind: str) -> Path:
    """Where rank ``rank`` writes ``kind`` (out, err, stack, result, error)."""
    return Path(tmpdir) / f"rank{rank}.{kind}"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _capture_output(tmpdir: str, rank: int) -> None:
    global _STACK_FILE
    for fd, kind in ((1, "out"), (2, "err")):
        target = os.open(rank_file(tmpdir, rank, kind), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    _STACK_FILE = open(rank_file(tmpdir, rank, "stack"), "w")
    faulthandler.enable(file=sys.stderr)
    faulthandler.register(signal.SIGUSR1, file=_STACK_FILE, all_threads=True)


def _die_with_the_caller() -> None:
    """Leave within moments of the caller's death, however it dies (SIGKILL, SIGTERM, SIGHUP, a kernel restart).

    The chain: caller dies -> the kernel kills the forkserver (its child, see ``course_lib.runtime._forkserver``) ->
    every rank gets SIGKILL from the kernel, armed here against the forkserver (Linux ``PR_SET_PDEATHSIG``). The
    caller's launch folder is left to the next launch (``remove_stale_launch_dirs``).
    A caller that died before that signal was armed is seen at once: the end of its pipe that multiprocessing
    keeps open for exactly this (``mp.parent_process().sentinel``) is then readable; a thread keeps watching it
    where there is no parent-death signal (macOS).

    The rank also drops its copy of the forkserver's "alive" pipe, which multiprocessing hands to each child it
    forks: the forkserver's main loop leaves only once every holder has gone.
    """
    from multiprocessing import forkserver

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the forkserver's handler came with the fork: not ours
    arm_parent_death_signal(signal.SIGKILL)
    server = forkserver._forkserver  # the module's singleton; _serve_one stored this child's copy in it
    if server._forkserver_alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None  # a learner's own forkserver use inside a rank starts a fresh one
    caller = mp.parent_process()
    if caller is not None:
        if mp.connection.wait([caller.sentinel], timeout=0):  # gone before the signal was armed
            os._exit(1)
        threading.Thread(target=_exit_when_gone, args=(caller.sentinel,), name="course-caller-watch",
                         daemon=True).start()


def _exit_when_gone(sentinel: int) -> None:
    mp.connection.wait([sentinel])
    os._exit(1)


def is_peer_failure(exc: BaseException) -> bool:
    """True for an error that says another rank went away rather than what went wrong: gloo's transport errors
    ("Connection closed by peer", "Connection reset by peer"...) and c10d's typed errors (store, network)."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo/transport/" in str(exc))


def run_rank(rank: int, world_size: int, port: int, prefix: str, tmpdir: str, pg_timeout_s: float,
             wake: mp.connection.Connection) -> None:
    """Entry point of one rank (target of the multiprocessing Process); ``wake``: where it tells the parent that
    its result is written."""
    _die_with_the_caller()
    _capture_output(tmpdir, rank)
    code = 0
    try:
        payload = cloudpickle.loads(Path(tmpdir, "payload.pkl").read_bytes())
        for filename, lines in payload["linecache"].items():  # notebook cells, so tracebacks show their source
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        torch.set_num_threads(1)
        timeout = timedelta(seconds=pg_timeout_s)
        store = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        result = payload["fn"](rank, world_size, *payload["args"], **payload["kwargs"])
        _write_atomic(rank_file(tmpdir, rank, "result"), cloudpickle.dumps(result))
        with contextlib.suppress(OSError):  # the parent also looks at the files now and then
            wake.send_bytes(b"")
        # Stay in the group until every rank is done: a rank that left early would turn a peer's wait in a
        # collective it never joined into a confusing "connection closed"; this way the parent reports a hang.
        store.wait([DONE_KEY], timedelta(days=1))
        dist.destroy_process_group()
    except BaseException as exc:
        code = 1
        report = {
            "time": time.time(),
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc)),
            "peer_failure": is_peer_failure(exc),
        }
        try:
            report["exc"] = cloudpickle.dumps(exc)
        except Exception:
            report["exc"] = None
        _write_atomic(rank_file(tmpdir, rank, "error"), cloudpickle.dumps(report))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
