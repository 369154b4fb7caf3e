"""Shared fixtures: a function "defined in a notebook cell", and a check that tests leave no process behind."""

from __future__ import annotations

import linecache
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import psutil
import pytest


def define_in_cell(source: str, cell: str = "/tmp/ipykernel_0/cell_1.py") -> dict:
    """Execute ``source`` the way IPython runs a notebook cell: module ``__main__``, a file name that does not
    exist on disk, and the source registered in linecache. Returns the cell's namespace."""
    source = textwrap.dedent(source)
    lines = source.splitlines(keepends=True)
    linecache.cache[cell] = (len(source), None, lines, cell)
    namespace = {"__name__": "__main__"}
    exec(compile(source, cell, "exec"), namespace)
    return namespace


def venv_of_this_environment(where: Path) -> Path:
    """A virtual environment at ``where`` (its own ``sys.prefix``, so its own config folders) that imports this
    environment's packages through a ``.pth`` file; returns its python. Seconds, no download."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    Path(site, "course_env.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    return python


def _rank_processes() -> set[int]:
    """Children of this process that are not multiprocessing's long-lived helpers (forkserver, tracker)."""
    helpers = ("forkserver", "resource_tracker")
    kids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if not any(h in " ".join(p.cmdline()) for h in helpers):
                kids.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return kids


@pytest.fixture
def no_leftover_ranks():
    """Fails the test if rank processes survive it."""
    yield
    left = _rank_processes()
    assert not left, f"rank processes left running: {left}"


@pytest.fixture(scope="module")
def one_torch_thread():
    """Single-process training beside rank processes on 2 cores: one torch thread (OpenMP's spinning threads
    compete with the ranks and make a 0.1 s run take 10 s under load)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_sessionfinish(session, exitstatus):
    """Write the session's end to ``$COURSE_PYTEST_DONE`` (the Makefile checks it): a test that ends the process
    itself (``os._exit`` in imported code) would otherwise end a run early with exit status 0 and no summary."""
    done = os.environ.get("COURSE_PYTEST_DONE")
    if done:
        Path(done).write_text(f"{session.testscollected} collected, exit status {int(exitstatus)}\n")


def pytest_collection_modifyitems(items):
    """Ship test functions to ranks by value (as a notebook's are), so each rank does not re-import the test
    module and pytest with it (that would cost ~0.3 s per rank per launch)."""
    import cloudpickle

    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        cloudpickle.register_pickle_by_value(module)
