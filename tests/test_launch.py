"""course_lib.runtime.launch: results, output, errors, hangs, crashes, scripts, torchrun, and cleanup."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from course_lib.runtime.launch import RankError, RankTimeout, launch
from tests.conftest import _rank_processes, define_in_cell

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")
REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def _sum_of_ranks(rank: int, world_size: int, offset: float = 0.0) -> tuple[int, float]:
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return rank, t.item() + offset


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_results_come_back_in_rank_order(world_size):
    out = launch(_sum_of_ranks, world_size, offset=0.5)
    total = world_size * (world_size + 1) / 2
    assert out == [(r, total + 0.5) for r in range(world_size)]


def test_world_size_one_runs_in_this_process():
    def where(rank, world_size):
        return os.getpid(), dist.get_world_size()

    assert launch(where, 1) == [(os.getpid(), 1)]
    assert not dist.is_initialized()


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2"])
def test_bad_world_size_is_refused(bad):
    with pytest.raises(ValueError, match="world_size"):
        launch(_sum_of_ranks, bad)


def test_functions_closures_and_classes_from_a_notebook_cell():
    cell = define_in_cell("""
        import torch
        import torch.distributed as dist

        class Scaler:
            def __init__(self, k):
                self.k = k

        def make(k):
            scaler = Scaler(k)
            def fn(rank, world_size):
                t = torch.tensor([float(rank)])
                dist.all_reduce(t)
                return scaler.k * t.item()
            return fn
    """)
    assert launch(cell["make"](10), 2) == [10.0, 10.0]


def test_output_is_replayed_in_rank_order_with_prefixes(capfd):
    def chatty(rank, world_size):
        time.sleep(0.05 * (world_size - rank))  # later ranks print first
        print(f"python says {rank}")
        print(f"warning from {rank}", file=sys.stderr)
        os.write(1, f"raw fd write {rank}\n".encode())  # what C++ code does
        return None

    launch(chatty, 3)
    out, err = capfd.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("[rank")]
    assert lines == [line for r in range(3) for line in (f"[rank {r}] python says {r}", f"[rank {r}] raw fd write {r}")]
    assert [line for line in err.splitlines() if "warning from" in line] == [f"[rank {r}] warning from {r}"
                                                                             for r in range(3)]


def _raise_on(rank, world_size, bad_rank, delay):
    if rank == bad_rank:
        time.sleep(delay)  # the others are already waiting in the collective
        raise ValueError(f"rank {rank} found a bad shape")
    t = torch.ones(4)
    dist.all_reduce(t)  # the neighbours fail here once the bad rank is gone
    return t.sum().item()


@pytest.mark.serial  # a time bound or a hang report (the serial lane, tests/conftest.py)
@pytest.mark.parametrize("bad_rank", [0, 2])
def test_the_rank_that_raised_first_is_reported_not_its_neighbours(bad_rank):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(_raise_on, 4, bad_rank, 0.3)
    err = info.value
    assert err.rank == bad_rank
    assert err.exc_type == "ValueError"
    assert isinstance(err.original, ValueError)
    assert f"rank {bad_rank} of 4 raised ValueError: rank {bad_rank} found a bad shape" in str(err)
    assert "_raise_on" in err.remote_traceback
    assert time.monotonic() - start < 10


def test_traceback_shows_the_notebook_cell_line():
    cell = define_in_cell("""
        def broken(rank, world_size):
            values = [1, 2, 3]
            return values[rank + 5]  # the line the learner must see
    """, cell="/tmp/ipykernel_0/cell_7.py")
    with pytest.raises(RankError) as info:
        launch(cell["broken"], 2)
    assert "cell_7.py" in info.value.remote_traceback
    assert "return values[rank + 5]  # the line the learner must see" in info.value.remote_traceback
    assert info.value.exc_type == "IndexError"


def test_an_exception_that_cannot_be_pickled_still_reports_its_text():
    cell = define_in_cell("""
        import threading
        class WithLock(Exception):
            def __init__(self):
                super().__init__("carrying a lock")
                self.lock = threading.Lock()
        def fn(rank, world_size):
            raise WithLock()
    """)
    with pytest.raises(RankError, match="carrying a lock") as info:
        launch(cell["fn"], 2)
    assert info.value.exc_type == "WithLock"


def _skip_collective(rank, world_size):
    if rank != 1:
        dist.all_reduce(torch.ones(2))
    return rank


@pytest.mark.serial  # a time bound or a hang report (the serial lane, tests/conftest.py)
def test_a_rank_waiting_in_a_collective_is_reported_with_its_stack():
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        launch(_skip_collective, 3, timeout=2)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.ranks == [0, 2]
    assert "finished: [1]" in str(err)
    for r in (0, 2):
        assert "all_reduce" in err.stacks[r] and "_skip_collective" in err.stacks[r]
    assert 2 <= elapsed < 8


def _spin(rank, world_size):
    if rank == 0:
        while True:  # a learner's infinite loop
            pass
    return rank


@pytest.mark.serial  # a time bound or a hang report (the serial lane, tests/conftest.py)
def test_a_busy_rank_is_stopped_at_the_timeout():
    with pytest.raises(RankTimeout) as info:
        launch(_spin, 2, timeout=1.5)
    assert info.value.ranks == [0]
    assert "_spin" in info.value.stacks[0]


def _die(rank, world_size, how):
    if rank == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), 9)
    dist.barrier()


@pytest.mark.serial  # a time bound or a hang report (the serial lane, tests/conftest.py)
@pytest.mark.parametrize("how, text", [("exit", "exited with code 3"), ("kill", "killed by signal SIGKILL")])
def test_a_rank_that_dies_without_raising_is_named(how, text):
    with pytest.raises(RankError, match=text) as info:
        launch(_die, 2, how, timeout=20)
    assert info.value.rank == 1


def _noop(rank, world_size):
    return rank


@pytest.mark.slow
def test_a_hundred_launches_leave_nothing_behind():
    launch(_noop, 2)  # starts the forkserver, which stays (as it should) for fast launches
    me = psutil.Process()
    listening = len([c for c in me.net_connections("tcp") if c.status == psutil.CONN_LISTEN])
    fds = me.num_fds()
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), f"course_launch_{os.getpid()}_*")))
    for _ in range(100):
        assert launch(_noop, 2) == [0, 1]
    assert not _rank_processes()
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), f"course_launch_{os.getpid()}_*"))) == before
    assert len([c for c in me.net_connections("tcp") if c.status == psutil.CONN_LISTEN]) == listening
    assert me.num_fds() <= fds + 2


def test_failed_launches_leave_nothing_behind():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), f"course_launch_{os.getpid()}_*")))
    with pytest.raises(RankTimeout):
        launch(_skip_collective, 2, timeout=1)
    with pytest.raises(RankError):
        launch(_raise_on, 2, 0, 0.0)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), f"course_launch_{os.getpid()}_*"))) == before


SCRIPT = """
import torch
import torch.distributed as dist
from course_lib.runtime.launch import launch

def work(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    print("rank", rank, "sees", t.item())
    return t.item()

{call}
"""


@pytest.mark.slow
@pytest.mark.parametrize("guarded", [True, False])
def test_a_plain_script_works_with_or_without_the_main_guard(tmp_path, guarded):
    call = "print('results', launch(work, 2))"
    if guarded:
        call = "if __name__ == '__main__':\n    " + call
    script = tmp_path / "learner.py"
    script.write_text(SCRIPT.format(call=call))
    out = subprocess.run([PYTHON, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("results [1.0, 1.0]") == 1  # the script body ran once, in the parent only
    assert "[rank 1] rank 1 sees 1.0" in out.stdout


@pytest.mark.slow
def test_under_torchrun_the_same_script_runs_in_process(tmp_path):
    script = tmp_path / "learner.py"
    call = ("if __name__ == '__main__':\n    import os\n    results = launch(work, 2)\n"
            "    open(f\"results{os.environ['RANK']}.txt\", 'w').write(repr((os.getpid(), results)))")
    script.write_text(SCRIPT.format(call=call))
    torchrun = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", str(script)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run(torchrun, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    pids = set()
    for rank in (0, 1):  # each torchrun rank gathers every rank's result
        pid, results = eval((tmp_path / f"results{rank}.txt").read_text())
        assert results == [1.0, 1.0]
        pids.add(pid)
    assert len(pids) == 2
    assert "[rank" not in out.stdout  # no child processes of ours: torchrun's own ranks ran the function


def test_torchrun_world_size_mismatch_is_explained(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="WORLD_SIZE=2"):
        launch(_noop, 4)


def test_the_module_docstring_example_holds():
    def hello(rank, world_size):
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        return t.item()

    assert launch(hello, 4) == [10.0] * 4


def test_launch_source_has_no_hard_coded_port():
    runtime = REPO / "course_lib" / "runtime"
    text = (runtime / "launch.py").read_text() + (runtime / "_worker.py").read_text()
    assert "29500" not in text and "MASTER_PORT" not in text
    assert textwrap.dedent("").strip() == ""


@pytest.mark.parametrize("env", ["unset", "own pid"])
def test_importing_the_forkserver_preload_outside_a_forkserver_does_nothing(env):
    """``course_lib.runtime._forkserver`` arms signals and may ``os._exit(0)``: in the forkserver only. Imported
    anywhere else -- the caller after a launch (which sets COURSE_LAUNCH_CALLER_PID to its own pid), or a tool importing
    every module -- it must leave the process alone (it once ended a whole pytest run early, exit status 0)."""
    script = textwrap.dedent("""
        import os, signal
        os.environ.pop("COURSE_LAUNCH_CALLER_PID", None)
        if MODE == "own pid":
            os.environ["COURSE_LAUNCH_CALLER_PID"] = str(os.getpid())
        import course_lib.runtime._forkserver as f
        assert not f.in_forkserver()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        print("still here")
    """).replace("MODE", repr(env))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "still here", proc.stderr[-2000:]
