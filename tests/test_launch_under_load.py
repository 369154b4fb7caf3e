"""The caller of a launch killed on a machine whose CPUs are all busy: its ranks, forkserver and multiprocessing's
resource tracker must be gone within 2 s of the caller's death, whatever the launch was doing. The clock starts
when the caller is dead, not when the signal is sent: the caller's own exit (the kernel unmapping its torch) is
not the launcher's to speed up. The callers die by the signal's default action, whatever the test was started
under (`nohup` leaves SIGHUP ignored in every child, and the caller would never die).

Before the fix, a caller killed while its forkserver was still importing torch (the first seconds of the first
launch; 10 to 40 s at load 10-20 on 2 cores) left the forkserver importing on, and the resource tracker waiting
for it, for as long as that import took: 1 or 2 processes still alive 5 s later at load 11-13.

The load: CPU-bound processes on the same 2 CPUs as the launch, enough for a load of ``LOAD`` on them with what the
machine already runs (a shared machine may need none). They are paused while each caller sets up (a full preload
at that load takes ~30 s) and resumed just before it is killed, so the whole teardown runs under load. Beyond
that load the teardown's bound grows with it: every dying process waits its turn for a CPU.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from course_lib.runtime.launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"),
                                                   reason="the 2 s bound relies on Linux's parent-death signal")]
REPO = Path(__file__).resolve().parents[1]
LOAD = 12
DEADLINE_S = 2.0
KILLS_PER_SIGNAL = 10
# Where the caller is when it dies, in turn: its forkserver just started (Python starting up), importing torch,
# its ranks running the user's code.
PHASES = ("starting", "importing", "running")

# Imports course_lib.runtime.launch once, then forks one caller per line read (a folder), so that no caller pays for
# importing torch again: each caller launches 2 ranks that write their pids into the folder and spin.
ZYGOTE = """
import os, signal, sys
os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(",")])
from course_lib.runtime.launch import launch

def spin(rank, world_size, where):
    open(os.path.join(where, f"rank{rank}.pid"), "w").write(str(os.getpid()))
    while True:
        pass

signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the callers
for sig in (signal.SIGHUP, signal.SIGTERM):  # a caller's usual disposition (`nohup` would have SIGHUP ignored)
    signal.signal(sig, signal.SIG_DFL)
for folder in iter(sys.stdin.readline, ""):
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        launch(spin, 2, folder.strip(), timeout=600)
        os._exit(0)
    print(pid, flush=True)
"""
SPINNER = """
import os, sys, time
os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(",")])
end = time.monotonic() + 600  # bounded, should the test itself be killed
while time.monotonic() < end:
    pass
"""


def _noop(rank: int, world_size: int) -> int:
    return rank


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _family(roots: list[psutil.Process]) -> dict[int, psutil.Process]:
    """``roots`` and all their descendants still running."""
    found = {}
    for root in roots:
        try:
            found[root.pid] = root
            found.update({p.pid: p for p in root.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    return {pid: p for pid, p in found.items() if _running(p)}


def _forkserver(caller: psutil.Process) -> psutil.Process | None:
    for p in _family([caller]).values():
        try:
            if "multiprocessing.forkserver" in " ".join(p.cmdline()):
                return p
        except psutil.NoSuchProcess:
            pass
    return None


def _imports_torch(proc: psutil.Process) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()
    except OSError:
        return False


def _reached(phase: str, caller: psutil.Process, folder: Path) -> bool:
    server = _forkserver(caller)
    if phase == "starting":
        return server is not None
    if phase == "importing":
        return server is not None and _imports_torch(server)
    return len(list(folder.glob("rank*.pid"))) == 2


def _kill_and_time(zygote: subprocess.Popen, spinners: list[subprocess.Popen], how: str, phase: str,
                   folder: Path) -> tuple[float, list[str], list[Path]]:
    """Fork a caller, wait for ``phase``, resume the load, kill the caller: seconds until its family is gone,
    what is left after ``DEADLINE_S``, its launch folders."""
    zygote.stdin.write(f"{folder}\n")
    zygote.stdin.flush()
    caller = psutil.Process(int(zygote.stdout.readline()))
    start = time.monotonic()
    while not _reached(phase, caller, folder):
        assert _running(caller), "the caller failed"
        assert time.monotonic() - start < 120, f"the caller never reached {phase!r}"
        time.sleep(0.005)
    for s in spinners:
        s.send_signal(signal.SIGCONT)
    time.sleep(0.1)  # the CPUs are busy before the caller dies
    family = _family([caller])
    launch_dirs = list(Path(tempfile.gettempdir()).glob(f"course_launch_{caller.pid}_*"))
    os.kill(caller.pid, getattr(signal, how))
    sent = time.monotonic()
    while _running(caller):  # its own exit (unmapping torch) is the kernel's, at the pace of a saturated machine
        assert time.monotonic() - sent < 60, f"the caller outlived its {how} by 60 s"
        time.sleep(0.005)
    killed = time.monotonic()  # the caller is dead: from here on, nothing of it may stay
    family.pop(caller.pid, None)
    while True:
        family.update(_family(list(family.values())))  # a rank forked at that moment counts too
        family = {pid: p for pid, p in family.items() if _running(p)}
        elapsed = time.monotonic() - killed
        if not family or elapsed > DEADLINE_S:
            break
        time.sleep(0.005)
    left = []
    for p in family.values():  # still running after DEADLINE_S: name them, then stop them
        with contextlib.suppress(psutil.NoSuchProcess):
            left.append(f"{p.pid} {' '.join(p.cmdline())[-60:]!r}")
            p.kill()
    for s in spinners:
        s.send_signal(signal.SIGSTOP)
    return elapsed, left, launch_dirs


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL", "SIGHUP"])
def test_nothing_outlives_a_caller_killed_under_load(tmp_path, how):
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))[:2]))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    already = os.getloadavg()[0] * 2 / os.cpu_count()  # the machine's load, its share on 2 CPUs
    spinners = [subprocess.Popen([sys.executable, "-c", SPINNER, cpus]) for _ in range(max(0, LOAD - round(already)))]
    zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE, cpus], cwd=REPO, env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    times: list[tuple[str, float]] = []
    launch_dirs: list[Path] = []
    try:
        for s in spinners:
            s.send_signal(signal.SIGSTOP)
        for i in range(KILLS_PER_SIGNAL):
            phase = PHASES[i % len(PHASES)]
            folder = tmp_path / f"kill{i}"
            folder.mkdir()
            elapsed, left, dirs = _kill_and_time(zygote, spinners, how, phase, folder)
            launch_dirs += dirs
            assert not left, (f"kill {i + 1} ({phase}): still running {DEADLINE_S:g} s after the caller's {how}"
                              f" at load {already + len(spinners):.0f} on 2 CPUs: {left}")
            times.append((phase, round(elapsed, 2)))
        print(f"{how} at load {already + len(spinners):.0f} on 2 CPUs: seconds until the caller's ranks, forkserver"
              f" and resource tracker were gone: {times}")
    finally:
        for p in [*spinners, zygote]:
            p.kill()
            p.wait()
    # A killed caller can clean nothing up: the next launch, from any process, removes its folder.
    assert launch(_noop, 2) == [0, 1]
    left_behind = [d.name for d in launch_dirs if d.exists()]
    assert not left_behind, f"launch folders of killed callers outlived the next launch: {left_behind}"
