"""The papermill child: the process the grader starts for each notebook (``python -m
course_lib.grading.papermill_child``), which runs the notebook's kernel and its cells with papermill.

It prints its progress (``STARTED``, then ``RUNNING`` before each cell: what tells the grader "the kernel never
started" from "it died in cell N"), puts the run's key into the grading cell only as that cell starts (the
notebook's own cells never see it), ends as soon as the kernel dies in a cell, and dies with the grader
(``prctl(PR_SET_PDEATHSIG)``). The kernel runs in the submission's sandbox when there is one.

It imports papermill, not torch or the checks: the kernel does the grading (``course_lib.grading.in_kernel``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from course_lib.grading import isolation
from course_lib.runtime._parent_death import arm_parent_death_signal

if TYPE_CHECKING:
    import nbformat

KEY_SLOT = "__GRADER_KEY__"
"""In the grading cell as written to disk; the papermill child puts the run's key there as the cell starts."""
STARTED = "course-grader: the kernel started"
RUNNING = "course-grader: running cell"
"""The papermill child's progress lines (its output comes back to the grader): what tells "never started" from
"died while running cell N"."""


def _kernel_manager(sandbox: isolation.Sandbox | None) -> type:
    """A ``KernelManager`` whose kernel dies with this process, in ``sandbox`` when given (then over Unix sockets
    in the submission's folder: the sandbox has its own loopback)."""
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    class GradedKernelManager(AsyncKernelManager):
        @default("transport")
        def _transport_default(self) -> str:
            return "ipc" if sandbox else "tcp"

        @default("connection_file")
        def _connection_file_default(self) -> str:
            return str(Path(sandbox.work) / "kernel.json") if sandbox else ""

        def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
            cmd = super().format_kernel_cmd(extra_arguments)
            return sandbox.wrap(cmd) if sandbox else [*isolation.parent_death(), *cmd]

    return GradedKernelManager


@dataclass
class KernelWatch:
    """Which cell the kernel is running (None between cells and after the last one), for the papermill child.

    nbclient may wait for a dead kernel's reply until the cell's time limit, so a thread ends the child as soon as
    the kernel's process has exited -- but only while a cell runs. After the last cell the kernel is shut down on
    purpose and is a zombie until it is reaped (jupyter_client polls every 0.1 s); papermill's synchronous
    ``setup_kernel`` calls no ``on_notebook_complete`` hook, so "after the last cell" must come from the cells."""

    cells: int = 0
    running: int | None = None

    def died(self, zombie_child: bool) -> str | None:
        """The line that ends the child when a zombie child means the kernel died in a cell, else None."""
        if zombie_child and self.running is not None:
            return f"DeadKernelError: Kernel died while running cell {self.running + 1} of {self.cells}"
        return None


def _end_with_the_kernel(watch: KernelWatch) -> None:
    me = psutil.Process()
    while True:
        time.sleep(0.5)
        zombie = False
        with contextlib.suppress(psutil.Error):
            zombie = any(p.status() == psutil.STATUS_ZOMBIE for p in me.children())
        line = watch.died(zombie)
        if line:
            print(line, flush=True)
            os._exit(3)


def main(src: str, dst: str, parameters_json: str, cell_timeout: str, sandbox_json: str) -> None:
    arm_parent_death_signal(signal.SIGKILL)  # the grader died: so do we (and our kernel, armed the same way)
    key = sys.stdin.readline().strip()
    import papermill

    limit = int(float(cell_timeout))
    sandbox = json.loads(sandbox_json)
    watch = KernelWatch()

    def started(notebook: nbformat.NotebookNode) -> None:  # the kernel answered; cells as executed (+ parameters)
        watch.cells = len(notebook.cells)
        print(STARTED, flush=True)

    def cell_starts(cell: nbformat.NotebookNode, cell_index: int) -> None:
        if cell_index == watch.cells - 1:  # the grading cell, only now: once every cell of the notebook has run
            cell.source = cell.source.replace(KEY_SLOT, repr(key))
        print(f"{RUNNING} {cell_index + 1} of {watch.cells}", flush=True)
        watch.running = cell_index

    def cell_done(cell: nbformat.NotebookNode, cell_index: int, execute_reply: dict) -> None:
        watch.running = None

    threading.Thread(target=_end_with_the_kernel, args=(watch,), daemon=True).start()
    papermill.execute_notebook(
        src, dst, parameters=json.loads(parameters_json), kernel_name="python3", progress_bar=False,
        execution_timeout=limit, interrupt_on_timeout=True, raise_on_iopub_timeout=False,
        error_on_timeout={"ename": "CellTimeout", "evalue": f"cell exceeded {limit} s", "traceback": []},
        kernel_manager_class=_kernel_manager(sandbox and isolation.Sandbox(**sandbox)),
        on_notebook_start=started, on_cell_execute=cell_starts, on_cell_executed=cell_done,
    )


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--execute":
        main(*sys.argv[2:])
    else:
        sys.exit("usage: the grader starts this process (course_lib.grading.grader); the command line is "
                 "python -m course_lib.grading")
