"""Grading untrusted work: one honest learner and hostile notebooks graded isolated in one class folder.

Each hostile notebook tries one thing: read the teacher's answer key (outside its own folder), write outside its
temporary folder (over another learner's submission and into a folder of the course machine), reach a non-loopback
address, fork without end, allocate without end, forge its score. Each is blocked or killed and scores only what it
earned honestly, with the reason; the honest learner is graded in full. Chapter 00 (no ranks) keeps it short. The
tests skip, with the kernel's own words, only where this machine refuses new namespaces.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import psutil
import pytest

from course_lib.grading import gradebook, grader, isolation

REPO = Path(__file__).resolve().parents[1]
SOLUTION = REPO / "solutions" / "00_budgets_exercises.ipynb"
EXERCISE = REPO / "exercises" / "00_budgets_exercises.ipynb"
MEMORY = 2 << 30
PROCESSES = 32

needs_namespaces = pytest.mark.skipif(isolation.available().flags is None, reason=isolation.available().reason)


def _outside_address() -> str | None:
    """An IPv4 address of this machine that is not loopback: what a sandbox with its own network cannot reach."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


class Listener:
    """A TCP server on the machine's outside address that records whatever reaches it."""

    def __init__(self, host: str) -> None:
        self.server = socket.create_server((host, 0))
        self.address = self.server.getsockname()
        self.received: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def close(self) -> None:
        """Stop listening (the module's fixture ends with it: no other test may see this server)."""
        self.server.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                self.received.append(conn.recv(100))


def _with_cell(base: Path, source: str) -> nbformat.NotebookNode:
    nb = nbformat.read(base, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(source))
    return nb


def _class(root: Path, listener: Listener | None) -> dict[str, Path]:
    """The class folder (the teacher's answer key lies in it too) and the paths the hostile notebooks aim at."""
    folder, outside = root / "class", root / "machine"
    folder.mkdir()
    outside.mkdir()
    key = folder / "answer_key.json"  # the teacher's: not a notebook, so not graded
    key.write_text(SOLUTION.read_text())
    honest = folder / "alice.ipynb"
    nbformat.write(nbformat.read(SOLUTION, as_version=4), honest)
    canary = outside / "written_by_a_submission.txt"
    notebooks = {
        # graded before alice (sorted): tries to blank her notebook and to write on the machine
        "aaron_writer": _with_cell(SOLUTION, f"""
for target in ({str(honest)!r}, {str(canary)!r}):
    try:
        open(target, "w").write("{{}}")
    except OSError as err:
        print("blocked:", err)"""),
        "bella_reader": _with_cell(EXERCISE, f"""
import json
key = json.load(open({str(key)!r}))
for cell in key["cells"]:
    if cell["cell_type"] == "code":
        get_ipython().run_cell("".join(cell["source"]))"""),
        "dora_fork_bomb": _with_cell(SOLUTION, """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass"""),
        "emil_memory_hog": _with_cell(SOLUTION, """
hog = []
try:
    while len(hog) < 1024:  # 64 GiB, more than the machine has
        hog.append(bytearray(1 << 26))
finally:
    print("allocated", len(hog) * 64, "MiB")
    hog.clear()"""),
        "fred_forger": _with_cell(EXERCISE, """
import json, os
from course_lib.grading import ch00
full = {ex.key: {"ok": True, "message": "all checks passed"} for ex in ch00.EXERCISES}
open("results.json", "w").write(json.dumps({"results": full, "mac": "0" * 64}))
os.kill(os.getpid(), 9)  # so that the grading cell never overwrites it"""),
    }
    if listener is not None:
        host, port = listener.address
        notebooks["carl_network"] = _with_cell(SOLUTION, f"""
import socket, os
loop = socket.create_server(("127.0.0.1", 0))  # loopback works (the ranks need it) or the kernel stops here
socket.create_connection(loop.getsockname(), timeout=5).close()
try:
    socket.create_connection(({host!r}, {port}), timeout=5).sendall(b"escaped")
except OSError as err:
    print("blocked:", err)""")
    for name, nb in notebooks.items():
        nbformat.write(nb, folder / f"{name}.ipynb")
    return {"folder": folder, "honest": honest, "canary": canary, "outside": outside}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    host = _outside_address()
    listener = Listener(host) if host else None
    paths = _class(root, listener)
    honest_before = paths["honest"].read_bytes()
    isolated = grader.isolation_for(True, [paths["folder"]], default=True)
    isolated = dataclasses.replace(isolated, memory_bytes=MEMORY, processes=PROCESSES)
    rows = gradebook.grade_class(paths["folder"], time_limit=240, cell_timeout=60, progress=False, jobs=2,
                                 isolated=isolated)
    by_learner: dict[str, list[gradebook.GradeRow]] = {}
    for r in rows:
        by_learner.setdefault(r.learner, []).append(r)
    yield by_learner, paths, honest_before, listener
    if listener is not None:
        listener.close()


def _points(rows: list[gradebook.GradeRow]) -> tuple[int, int]:
    return sum(r.points for r in rows), sum(r.max for r in rows)


def _scores_nothing_because(graded, learner: str, reason: str) -> None:
    """``learner`` scores 0 of 12 and every one of its rows gives ``reason``."""
    rows = graded[0][learner]
    assert _points(rows) == (0, 12), rows
    assert all(reason in r.reason for r in rows), rows


@needs_namespaces
@pytest.mark.slow
def test_the_honest_learner_is_graded_in_full(graded):
    by_learner, paths, honest_before, _ = graded
    assert _points(by_learner["alice"]) == (12, 12), by_learner["alice"]
    assert paths["honest"].read_bytes() == honest_before


@needs_namespaces
@pytest.mark.slow
def test_a_notebook_cannot_write_outside_its_folder(graded):
    by_learner, paths, _, _ = graded
    assert not paths["canary"].exists()
    assert _points(by_learner["aaron_writer"]) == (12, 12)  # what it earned honestly


@needs_namespaces
@pytest.mark.slow
def test_a_notebook_cannot_read_the_teachers_files(graded):
    """Without isolation this notebook runs the answer key's cells and scores 12/12."""
    _scores_nothing_because(graded, "bella_reader", "not implemented yet")


@needs_namespaces
@pytest.mark.slow
def test_a_notebook_reaches_loopback_but_nothing_outside(graded):
    by_learner, _, _, listener = graded
    if listener is None:
        pytest.skip("this machine has no non-loopback IPv4 address to aim at")
    assert listener.received == []
    assert _points(by_learner["carl_network"]) == (12, 12)  # the loopback check passed: the kernel went on


@needs_namespaces
@pytest.mark.slow
def test_a_fork_bomb_is_killed_with_the_reason(graded):
    _scores_nothing_because(graded, "dora_fork_bomb", f"killed: {PROCESSES} processes or more")


@needs_namespaces
@pytest.mark.slow
def test_a_memory_hog_is_stopped_at_the_limit(graded):
    """The allocation fails at the limit (MemoryError) instead of taking the machine's memory; the kernel lives on
    and the notebook keeps what it earned."""
    assert _points(graded[0]["emil_memory_hog"]) == (12, 12)


@needs_namespaces
@pytest.mark.slow
def test_a_forged_results_file_is_refused(graded):
    _scores_nothing_because(graded, "fred_forger", "not signed with this run's key")


def test_results_are_read_only_when_signed_with_the_runs_key(tmp_path):
    results = {"ex": {"ok": True, "message": "all 3 checks passed"}}
    key, other = "ab" * 32, "cd" * 32
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"results": results, "mac": grader.sign(results, key)}))
    assert grader.read_results(path, key) == (results, None)
    for wrong in (other,):
        got, why = grader.read_results(path, wrong)
        assert got == {} and "not signed with this run's key" in why
    path.write_text(json.dumps({"results": results}))
    assert "not signed" in grader.read_results(path, key)[1]
    assert grader.read_results(tmp_path / "missing.json", key) == ({}, None)


def test_without_namespaces_one_warning_line_and_no_isolation(monkeypatch, capsys):
    monkeypatch.setattr(isolation, "available", lambda: isolation.Availability(None, "the kernel says no"))
    assert grader.isolation_for(None, [], default=True) is None
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "WITHOUT isolation: the kernel says no" in err
    assert grader.isolation_for(False, [], default=True) is None and capsys.readouterr().err == ""


def test_the_course_and_python_are_never_hidden(tmp_path):
    if isolation.available().flags is None:
        pytest.skip(isolation.available().reason)
    isolated = grader.isolation_for(True, [REPO, REPO.parent, tmp_path], default=True)
    assert REPO not in isolated.hidden and REPO.parent not in isolated.hidden
    assert tmp_path.resolve() in isolated.hidden and REPO / "solutions" in isolated.hidden


def _family_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["--no-isolation", "--isolation"])
def test_killing_the_grader_kills_its_papermill_child_and_kernel(tmp_path, mode):
    """SIGKILL the gradebook while a cell sleeps: the papermill child and the kernel (and the sandbox) are gone
    within a few seconds, by the parent-death signal (nothing else is left to clean up after a SIGKILL)."""
    if mode == "--isolation" and isolation.available().flags is None:
        pytest.skip(isolation.available().reason)
    folder = tmp_path / "class"
    folder.mkdir()
    nbformat.write(_with_cell(EXERCISE, "import time\ntime.sleep(600)"), folder / "sleepy.ipynb")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "course_lib.grading.gradebook", str(folder), mode, "--out",
                             str(tmp_path / "book.csv")], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        family: list[psutil.Process] = []
        while time.monotonic() < deadline:
            family = psutil.Process(proc.pid).children(recursive=True)
            if any("ipykernel_launcher" in " ".join(p.cmdline()) for p in family if p.is_running()):
                break
            time.sleep(0.5)
        else:
            pytest.fail("the kernel never started")
        time.sleep(2)  # the kernel is running the notebook's cells
        pids = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while _family_alive(pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _family_alive(pids), [psutil.Process(p).cmdline()[:6] for p in _family_alive(pids)]
    finally:
        if proc.poll() is None:
            proc.kill()


@needs_namespaces
@pytest.mark.slow
def test_an_isolated_cell_past_its_time_limit_is_interrupted_and_grading_goes_on(tmp_path):
    """The cell time limit's SIGINT reaches the kernel inside its namespaces (the launcher signals the process
    group): the loop costs its cell only."""
    path = tmp_path / "00_loop.ipynb"
    nbformat.write(_with_cell(SOLUTION, "while True:\n    pass"), path)
    report = grader.grade_notebook(path, timeout=200, cell_timeout=10,  # 10 s: as test_grading.py's loop
                                   isolated=grader.isolation_for(True, [tmp_path], default=True))
    assert report.points == report.max_points == 12, report.table()
