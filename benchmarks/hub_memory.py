"""Memory of one learner on a shared JupyterHub: one kernel running a chapter, and the ranks it launches.

Runs a notebook top to bottom in a fresh kernel (nbclient, as JupyterLab's Run All does) while a thread samples,
every 50 ms with psutil, the kernel process and all its descendants (the launcher's forkserver and the rank
processes it forks). Reports the peaks of:

* the kernel alone (RSS);
* the whole tree, summed RSS: an upper bound (pages shared by the forked ranks, torch's libraries among them, are
  counted once per process);
* the whole tree, summed USS (pages private to each process): what the machine really loses per learner; the
  shared libraries come on top once per machine, not per learner.

Run: ``python benchmarks/hub_memory.py [notebooks/02_data_parallel.ipynb ...]`` (about the notebooks' Run All time).
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from pathlib import Path

import psutil

from course_lib.grading.timings import execute

MiB = 2**20
DEFAULT = ["notebooks/02_data_parallel.ipynb"]


@dataclass
class Peaks:
    kernel_rss: int = 0
    tree_rss: int = 0
    tree_uss: int = 0
    most_processes: int = 0


def _sample(pid: int, peaks: Peaks) -> None:
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    rss = uss = 0
    for p in procs:
        try:
            info = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss, uss = rss + info.rss, uss + info.uss
        if p.pid == pid:
            peaks.kernel_rss = max(peaks.kernel_rss, info.rss)
    peaks.tree_rss, peaks.tree_uss = max(peaks.tree_rss, rss), max(peaks.tree_uss, uss)
    peaks.most_processes = max(peaks.most_processes, len(procs))


def measure(path: Path, interval: float = 0.05) -> tuple[Peaks, float]:
    """The peaks while ``path`` runs as Run All does (``course_lib.grading.timings.execute``), and its seconds."""
    peaks = Peaks()

    def sample(pid: int) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            _sample(pid, peaks)

    _, seconds = execute(path, sample, interval)
    return peaks, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path, default=[Path(p) for p in DEFAULT])
    args = parser.parse_args()
    print(f"{'notebook':36s} {'Run All':>8s} {'kernel RSS':>11s} {'tree RSS':>9s} {'tree USS':>9s} {'procs':>5s}")
    for path in args.notebooks:
        p, seconds = measure(path)
        print(f"{path.name:36s} {seconds:7.1f}s {p.kernel_rss / MiB:8.0f} MiB {p.tree_rss / MiB:5.0f} MiB "
              f"{p.tree_uss / MiB:5.0f} MiB {p.most_processes:5d}")


if __name__ == "__main__":
    main()
