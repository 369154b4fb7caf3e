"""What runs inside each rank process started by ``course_lib.launch`` (kept apart so the forkserver can
preload it together with torch).

A rank: sends its stdout/stderr (Python and C++) to per-rank files, arms ``faulthandler`` so the parent can ask
it where it is stuck (SIGUSR1), joins a gloo process group through the parent's TCPStore, runs the user's
function and writes its return value -- or its exception with the formatted traceback and a timestamp -- to a
file the parent reads. It always leaves with ``os._exit`` so no atexit handler or helper thread can hang it.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import linecache
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import cloudpickle
import torch
import torch.distributed as dist

_STACK_FILE = None  # kept open for faulthandler for the life of the process
DONE_KEY = "course_launch/done"


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


def _die_with_parent() -> None:
    """Linux: get SIGKILL if our parent (the forkserver, which exits with the kernel) dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_rank(rank: int, world_size: int, port: int, prefix: str, tmpdir: str, pg_timeout_s: float) -> None:
    """Entry point of one rank (target of the multiprocessing Process)."""
    _die_with_parent()
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
