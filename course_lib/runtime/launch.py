"""Run a function on N real ``torch.distributed`` ranks -- from a notebook cell, a script or ``torchrun``.

    from course_lib.runtime.launch import launch

    def hello(rank, world_size):
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        return t.item()

    launch(hello, 4)   # -> [10.0, 10.0, 10.0, 10.0]

How it works (each choice was measured on a 2-core laptop):

* Processes come from a **forkserver** that has torch preloaded; ``fn`` and its arguments travel with
  **cloudpickle**, so functions and classes defined in notebook cells work (``spawn`` cannot pickle them,
  ``fork`` hangs once the kernel has used OpenMP). Ranks never re-import your ``__main__``: a script works with or
  without an ``if __name__ == "__main__":`` guard.
* The parent hosts the rendezvous ``TCPStore`` on a port the OS picks (port 0), created once per parent process
  (tearing one down costs 0.1 s) with a fresh key prefix per launch: no hard-coded port, so parallel notebooks
  and test runs never collide. It listens on 127.0.0.1 only, over IPv4 (nothing outside the machine can reach
  it, and no reverse DNS lookup of ``::ffff:127.0.0.1`` stalls a launch for 5 s).
* ``fn``, its signature and its arguments are checked before any rank starts (an argument that cannot be pickled
  is named); two threads may launch at once.
* Each rank's stdout/stderr (Python and C++) goes to a file that is replayed here in rank order, each line
  prefixed ``[rank r]`` (ipykernel does not show child output under nbval, and live output would interleave);
  more than ``MAX_OUTPUT_BYTES`` per rank and stream is cut in the middle, with a note.
* A rank that raises: the exception of the rank that failed **first** (by timestamp -- the root cause, not the
  neighbour whose collective broke because its peer died) is raised here as ``RankError`` with that rank's
  traceback, including lines of notebook cells; the other ranks are killed at once. A rank that dies without a
  word (a signal, ``os._exit``) is named ahead of the neighbours whose collectives lost it.
* A rank that hangs: after ``timeout`` seconds the parent asks every unfinished rank for its Python stack
  (``faulthandler`` on SIGUSR1), kills them and raises ``RankTimeout`` naming them and showing where they wait.
  No process, port or temporary file survives a launch -- nor the caller: however it dies (SIGKILL, SIGTERM,
  SIGHUP, a kernel restart), its ranks, forkserver and multiprocessing's resource tracker are gone within 2 s on
  Linux, even with every CPU busy (the kernel kills the forkserver, see ``course_lib.runtime._forkserver``); its launch
  folder is removed by the next launch, from any process.
* Under ``torchrun`` (RANK/WORLD_SIZE/LOCAL_RANK set) ``fn`` runs in this process on the already launched rank,
  with NCCL when CUDA is present (gloo otherwise); ``world_size=1`` also runs in-process, for debugging.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.machinery
import inspect
import io
import itertools
import linecache
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from course_lib.runtime import _worker
from course_lib.runtime._parent_death import CALLER_MODULES_ENV, CALLER_PID_ENV

DEFAULT_TIMEOUT = float(os.environ.get("COURSE_LAUNCH_TIMEOUT", 30))
"""Seconds a launch may take before its unfinished ranks are reported as hung (env COURSE_LAUNCH_TIMEOUT)."""

# The forkserver imports this module only: it arms the forkserver's death with ours, then imports torch & co.
_PRELOAD = ["course_lib.runtime._forkserver"]
_POLL_S = 0.5  # how often the parent looks at the ranks' files unwoken (a rank's word or exit wakes it at once)
_CAUSE_POLL_S = 0.005  # how often it looks for a failure's cause, in the moment after a rank failed
_EXIT_GRACE_S = 5.0  # how long a released rank may take to leave before it is killed
_CAUSE_WAIT_S = 1.0  # how long to wait for the cause when only "a peer went away" errors are in
MAX_OUTPUT_BYTES = 200_000
"""Per rank and stream, the most captured output replayed; the middle of a longer one is left out, with a note."""


class RankError(RuntimeError):
    """A rank raised (or died). ``rank``: which; ``exc_type``: the exception's class name; ``remote_traceback``:
    the traceback as the rank printed it; ``original``: the exception object itself when it could be pickled."""

    def __init__(self, rank: int, world_size: int, exc_type: str, message: str, remote_traceback: str,
                 original: BaseException | None = None, note: str = "") -> None:
        self.rank, self.world_size, self.exc_type = rank, world_size, exc_type
        self.remote_traceback, self.original = remote_traceback, original
        text = f"rank {rank} of {world_size} raised {exc_type}: {message}"
        if note:
            text += f"\n{note}"
        super().__init__(f"{text}\n\n--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}")


class RankTimeout(TimeoutError):  # noqa: N818 - reads better as `except RankTimeout`
    """Ranks did not finish within the launch timeout. ``ranks``: the unfinished ones; ``stacks``: where each
    was (Python stack, most recent call first)."""

    def __init__(self, ranks: list[int], world_size: int, timeout: float, stacks: dict[int, str]) -> None:
        self.ranks, self.world_size, self.timeout, self.stacks = ranks, world_size, timeout, stacks
        done = sorted(set(range(world_size)) - set(ranks))
        text = (f"rank(s) {ranks} of {world_size} did not finish within {timeout:g} s"
                f" (finished: {done or 'none'}); they were stopped. A rank waiting in a collective usually means"
                " another rank never called it (or called a different one).")
        where = "\n\n".join(f"--- rank {r} was here (most recent call first) ---\n{stacks[r]}" for r in ranks)
        super().__init__(f"{text}\n\n{where}")


# ----------------------------------------------------------------------------------------------------------------
# Public API


def in_torchrun() -> bool:
    """True inside a process started by ``torchrun`` (or any launcher that sets RANK/WORLD_SIZE/LOCAL_RANK)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def device() -> torch.device:
    """The device this rank computes on: its CUDA GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None,
           **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return their results in rank order.

    ``timeout`` (seconds, default ``DEFAULT_TIMEOUT``) bounds the whole launch. Raises ``RankError`` for the
    first rank that raised and ``RankTimeout`` for ranks still running at the deadline.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    _check_call(fn, world_size, args, kwargs)
    timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if in_torchrun():
        return _launch_torchrun(fn, world_size, args, kwargs)
    if world_size == 1:
        return _launch_inline(fn, args, kwargs, timeout)
    return _launch_processes(fn, world_size, args, kwargs, timeout)


def _check_call(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict) -> None:
    """Refuse, before any rank starts, a ``fn`` that is not callable or cannot take the call every rank makes."""
    if not callable(fn):
        raise TypeError(f"launch(fn, world_size, ...): fn must be a function, got {type(fn).__name__} {fn!r:.80}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: let the call itself decide
        return
    try:
        signature.bind(0, world_size, *args, **kwargs)
    except TypeError as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        empty = inspect.Parameter.empty
        signature = signature.replace(parameters=[p.replace(annotation=empty) for p in signature.parameters.values()],
                                      return_annotation=empty)
        extra = "".join(f", {a!r:.40}" for a in args) + "".join(f", {k}={v!r:.40}" for k, v in kwargs.items())
        raise TypeError(f"every rank calls fn(rank, world_size, *args, **kwargs), here {name}(rank, {world_size}"
                        f"{extra}), but {name}{signature} cannot take it: {exc}") from None


# ----------------------------------------------------------------------------------------------------------------
# In-process modes


def _launch_torchrun(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict) -> list[Any]:
    env_world = int(os.environ["WORLD_SIZE"])
    if world_size != env_world:
        raise ValueError(f"launch(world_size={world_size}) under torchrun with WORLD_SIZE={env_world}:"
                         f" pass world_size={env_world} or change --nproc-per-node")
    owned = not dist.is_initialized()  # a group we create we also destroy: left to interpreter exit, its
    if owned:                          # threads can abort the process ("terminate called without an active exception")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
    try:
        result = fn(dist.get_rank(), world_size, *args, **kwargs)
        results: list[Any] = [None] * world_size
        dist.all_gather_object(results, result)
        return results
    finally:
        if owned:
            dist.destroy_process_group()


def _launch_inline(fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float) -> list[Any]:
    if dist.is_initialized():
        raise RuntimeError("launch(world_size=1) needs this process to have no default process group; "
                           "call torch.distributed.destroy_process_group() first")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout))
    try:
        return [fn(0, 1, *args, **kwargs)]
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# Real processes


_STORE: dist.TCPStore | None = None
_LAUNCHES = itertools.count()
_START_LOCK = threading.Lock()  # one launch at a time creates the store and starts its ranks (see _no_main_reimport)


def _rendezvous() -> tuple[dist.TCPStore, str]:
    """This process's rendezvous store (started on first use) and a key prefix unique to this launch.

    The store gets a socket we made: IPv4, bound to 127.0.0.1 only. Left to itself TCPStore listens on every
    interface (``::``), unauthenticated, for the caller's whole life, and its server thread looks up the name of
    each peer, ``::ffff:127.0.0.1`` -- a reverse DNS query that stalls a launch for 5 s whenever the resolver has
    no answer. Runs over several machines use torchrun's own rendezvous instead (see the README).
    """
    global _STORE
    if _STORE is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # port 0: the OS picks a free one
        sock.listen(1024)
        port = sock.getsockname()[1]
        _STORE = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=60), master_listen_fd=sock.detach())
    return _STORE, f"launch{os.getpid()}_{next(_LAUNCHES)}/"


def _context() -> mp.context.ForkServerContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


_FORKSERVER_PARENT: tuple[int, queue.SimpleQueue] | None = None  # (our pid, requests) of the thread below


def _ensure_forkserver() -> None:
    """Start the forkserver if it is not running, from a thread of ours that lives as long as this process.

    The forkserver dies with its parent *thread* (Linux's parent-death signal, see ``course_lib.runtime._forkserver``):
    started from the thread that happens to launch first -- one that ends, in a script or a test -- it would die
    with that thread and take the ranks of every later launch with it. Hold ``_START_LOCK``.
    """
    global _FORKSERVER_PARENT
    if _FORKSERVER_PARENT is None or _FORKSERVER_PARENT[0] != os.getpid():  # none yet, or we are a forked copy
        requests: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_serve_forkserver_starts, args=(requests,), name="course-forkserver-parent",
                         daemon=True).start()
        _FORKSERVER_PARENT = (os.getpid(), requests)
    done: concurrent.futures.Future = concurrent.futures.Future()
    _FORKSERVER_PARENT[1].put(done)
    done.result()


def _serve_forkserver_starts(requests: queue.SimpleQueue) -> None:
    while True:
        done = requests.get()
        try:
            os.environ[CALLER_PID_ENV] = str(os.getpid())  # whose death the forkserver watches
            os.environ[CALLER_MODULES_ENV] = ",".join(_rank_modules())  # what it imports for the ranks
            multiprocessing.forkserver.ensure_running()
            done.set_result(None)
        except BaseException as exc:
            done.set_exception(exc)


def _rank_modules() -> list[str]:
    """The library's modules this process has imported (not the widgets and plots): what its ranks most likely
    import too (the checks, the parallel code), imported once in the forkserver rather than in every rank."""
    return sorted(m for m in list(sys.modules) if m.startswith("course_lib.")
                  and not m.startswith(("course_lib.viz", "course_lib.course", "course_lib.runtime._forkserver")))


@contextlib.contextmanager
def _no_main_reimport() -> Iterator[None]:
    """Ranks must not re-run the caller's script: multiprocessing imports ``__main__`` in every child unless its
    ``__spec__`` is named ``__main__``. cloudpickle already ships everything ``fn`` needs from ``__main__``.
    Hold ``_START_LOCK`` around it: two threads interleaving the swap would leave the stand-in behind."""
    main = sys.modules["__main__"]
    saved = getattr(main, "__spec__", None)
    main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)
    try:
        yield
    finally:
        main.__spec__ = saved


class _SourceKeepingPickler(cloudpickle.Pickler):
    """cloudpickle, but code objects keep their file name (cloudpickle writes "<dynamic-code>"), so a rank's
    traceback can point at the notebook cell and show its line."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType):
            ctor, args = self.dispatch_table[types.CodeType](obj)
            return ctor, tuple(obj.co_filename if a == "<dynamic-code>" else a for a in args)
        return super().reducer_override(obj)


def _write_payload(path: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """Pickle what every rank needs; if something cannot travel to another process, say which argument it is."""
    payload = {"fn": fn, "args": args, "kwargs": kwargs, "linecache": _cell_sources()}
    try:
        with open(path, "wb") as f:
            _SourceKeepingPickler(f).dump(payload)
    except Exception as exc:
        parts = [("fn", fn), *((f"argument {i} after world_size", a) for i, a in enumerate(args, 1)),
                 *((f"keyword argument {k!r}", v) for k, v in kwargs.items())]
        for what, obj in parts:
            try:
                _SourceKeepingPickler(io.BytesIO()).dump(obj)
            except Exception as part_exc:
                raise TypeError(
                    f"launch cannot send {what} ({type(obj).__name__}) to the ranks: {part_exc}. Each rank is a"
                    " separate process and gets a pickled copy of fn and its arguments: pass plain data, and create"
                    " locks, open files, sockets or generators inside fn.") from exc
        raise


def _cell_sources() -> dict[str, list[str]]:
    """Source lines of code that exists only in memory (notebook cells), so rank tracebacks can show it."""
    cells = {}
    for filename, entry in list(linecache.cache.items()):
        if len(entry) == 4 and entry[1] is None and not os.path.exists(filename):
            cells[filename] = entry[2]
    return cells


def _launch_processes(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict,
                      timeout: float) -> list[Any]:
    _worker.remove_stale_launch_dirs()
    ctx = _context()
    tmpdir = tempfile.mkdtemp(prefix=os.path.basename(_worker.launch_dir_prefix(os.getpid())))
    procs: list[mp.process.BaseProcess] = []
    released = False
    woken, wake = ctx.Pipe(duplex=False)  # each rank that has written its result says so: the parent wakes at once
    try:
        _write_payload(os.path.join(tmpdir, "payload.pkl"), fn, args, kwargs)
        # The process group's own timeout is longer than ours: our watchdog reports a hang with stacks first.
        pg_timeout = timeout + 30.0
        with _START_LOCK:
            store, prefix = _rendezvous()
            with _no_main_reimport():
                _ensure_forkserver()
                for rank in range(world_size):
                    rank_args = (rank, world_size, store.port, prefix, tmpdir, pg_timeout, wake)
                    p = ctx.Process(target=_worker.run_rank, args=rank_args, name=f"course-rank-{rank}", daemon=True)
                    p.start()
                    procs.append(p)
        wake.close()  # the ranks hold their copies
        results = _supervise(procs, world_size, tmpdir, timeout, dist.PrefixStore(prefix, store), woken)
        released = True
        return results
    finally:
        wake.close()
        woken.close()
        for p in procs:  # released ranks leave by themselves within a moment; anything else is killed now
            p.join(timeout=_EXIT_GRACE_S if released else 0)
            if p.is_alive():
                p.kill()
                p.join()
            p.close()
        _replay_output(tmpdir, len(procs))
        shutil.rmtree(tmpdir, ignore_errors=True)


def _supervise(procs: list[mp.process.BaseProcess], world_size: int, tmpdir: str, timeout: float,
               store: dist.TCPStore, woken: multiprocessing.connection.Connection) -> list[Any]:
    """Wait until every rank has written its result (then release them all), or one failed, or time is up: woken
    by a rank's word that its result is written, or by a rank's exit (the files say which)."""
    deadline = time.monotonic() + timeout
    pending = set(range(world_size))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _hang_report(procs, sorted(pending), world_size, tmpdir, timeout)
        ready = multiprocessing.connection.wait([woken, *(procs[r].sentinel for r in pending)],
                                                timeout=min(remaining, _POLL_S))
        with contextlib.suppress(EOFError, OSError):  # EOF: every rank has gone (their exits tell the rest)
            while woken in ready and woken.poll():
                woken.recv_bytes()
        for rank in sorted(pending):
            if _worker.rank_file(tmpdir, rank, "result").exists():
                pending.discard(rank)
            elif not procs[rank].is_alive():
                error = _first_failure(procs, world_size, tmpdir)
                for p in procs:  # stop the others
                    if p.is_alive():
                        p.kill()
                raise error
    store.set(_worker.DONE_KEY, "1")
    return [cloudpickle.loads(_worker.rank_file(tmpdir, r, "result").read_bytes()) for r in range(world_size)]


def _first_failure(procs: list[mp.process.BaseProcess], world_size: int, tmpdir: str) -> RankError:
    """The root cause, once some rank is found gone. In order of preference:

    1. of the ranks that raised an error of their own, the one that raised first (by timestamp);
    2. a rank that died without a word (killed by a signal, ``os._exit``, out of memory): its neighbours'
       collectives then fail with "Connection closed by peer", which is a consequence, not the cause;
    3. of the ranks whose collective failed because a peer went away, the first.

    When only (3) is known yet, the dead rank's exit may simply not have been seen: wait up to
    ``_CAUSE_WAIT_S`` for (1) or (2) to show up, or for every rank without a result to be gone.
    """
    give_up = time.monotonic() + _CAUSE_WAIT_S
    while True:
        # Who is gone is read *before* the reports: a rank writes its report before it exits, so a rank already
        # gone at this instant has its report on disk if it wrote one. Read the other way round, a rank that
        # wrote its report and exited between the two reads would look silent -- and be blamed.
        gone = {r for r in range(world_size) if not procs[r].is_alive()}
        done = {r for r in range(world_size) if _worker.rank_file(tmpdir, r, "result").exists()}
        reports = {r: cloudpickle.loads(path.read_bytes()) for r in range(world_size)
                   if (path := _worker.rank_file(tmpdir, r, "error")).exists()}
        silent = [r for r in sorted(gone) if r not in reports and r not in done]
        own = [r for r in reports if not reports[r].get("peer_failure")]
        running = [r for r in range(world_size) if r not in gone and r not in done and r not in reports]
        if own or silent or not running or time.monotonic() > give_up:
            break
        multiprocessing.connection.wait([procs[r].sentinel for r in running], timeout=_CAUSE_POLL_S)
    if own or not silent:
        rank = min(own or reports, key=lambda r: reports[r]["time"])
        rep = reports[rank]
        original = None
        if rep["exc"] is not None:
            with contextlib.suppress(Exception):
                original = cloudpickle.loads(rep["exc"])
        others = sorted(set(reports) - {rank})
        note = f"(ranks {others} failed after it, most likely as a consequence)" if others else ""
        return RankError(rank, world_size, rep["type"], rep["message"], rep["traceback"], original, note)
    dead = silent[0]
    code = procs[dead].exitcode or 0
    how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    tail = _read(_worker.rank_file(tmpdir, dead, "err"))[-3000:]
    others = sorted(set(reports) | set(silent[1:]))
    note = (f"(ranks {others} failed after it: their collectives lost their peer)" if others else "")
    return RankError(dead, world_size, "ProcessDied", f"the rank process {how} without raising an exception",
                     tail or "(the rank printed nothing to stderr)", note=note)


def _hang_report(procs: list[mp.process.BaseProcess], hung: list[int], world_size: int, tmpdir: str,
                 timeout: float) -> RankTimeout:
    for rank in hung:
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[rank].pid, signal.SIGUSR1)
    stacks = {}
    give_up = time.monotonic() + 2.0
    for rank in hung:
        path = _worker.rank_file(tmpdir, rank, "stack")
        while time.monotonic() < give_up and "in run_rank" not in _read(path):
            time.sleep(0.02)
        time.sleep(0.05)  # let the dump finish
        stacks[rank] = _main_thread_stack(_read(path))
        procs[rank].kill()
    return RankTimeout(hung, world_size, timeout, stacks)


def _read(path: os.PathLike, limit: int | None = None) -> str:
    """The file's text; with ``limit``, at most its first and last ``limit // 2`` bytes and a note between."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if limit is None or size <= limit:
                return f.read().decode(errors="replace")
            head = f.read(limit // 2).decode(errors="replace")
            f.seek(size - limit // 2)
            tail = f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    left_out = size - 2 * (limit // 2)
    return (f"{head}\n... {left_out:,} bytes of output left out here (each rank's output is capped at"
            f" {limit:,} bytes: print less often, or write to a file) ...\n{tail}")


def _main_thread_stack(dump: str) -> str:
    """From a faulthandler dump of all threads: the frames of the thread running the rank's code, down to the
    user's function (the launcher's own frames below it are dropped)."""
    for thread in dump.split("\n\n"):
        lines = thread.strip().splitlines()
        for i, line in enumerate(lines):
            if "_worker.py" in line and "in run_rank" in line:
                return "\n".join(lines[1:i]) or line
    return dump.strip() or "(no stack could be read)"


def _replay_output(tmpdir: str, world_size: int) -> None:
    """Print every rank's captured output, rank by rank, each line prefixed with its rank."""
    for rank in range(world_size):
        for kind, stream in (("out", sys.stdout), ("err", sys.stderr)):
            text = _read(_worker.rank_file(tmpdir, rank, kind), limit=MAX_OUTPUT_BYTES)
            if text:
                stream.write("".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").split("\n")))
        sys.stdout.flush()
        sys.stderr.flush()
