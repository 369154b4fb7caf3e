"""Step timelines: where one data-parallel step spends its time on each rank, and which communication the
backward pass hides.

What is plotted is recorded on the ranks by ``course_lib.measure.instrument`` (:class:`Span`,
``RecordingDataParallel``, ``record_train_dp``, ``EmulatedDeviceGPT``: re-exported here for older imports);
this module is pure:

* **Arithmetic** (pure): :func:`breakdown` splits one rank's step into compute, communication in flight,
  communication **hidden** under compute (in flight while the rank computes), **exposed** communication (the
  rank waits), input stall, optimizer. :func:`spans_from_step_times` turns ``DPResult.timeline``
  (``StepTime``, recorded by every ``train_dp`` run) into coarse spans, when no recording was made.
* **Figure** (pure, data in, ``Figure`` out): :func:`plot_timeline` draws one panel per run, two lanes per rank
  (compute; communication in flight, green where it is hidden under compute and red where the rank waits for
  it), and a mandatory ``note`` saying how the times were produced ("gloo on CPU, 2 ranks on 2 cores,
  time-sliced", "emulated device", ...): a timeline without its mode is not evidence.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from course_lib.measure.instrument import (
    KINDS,
    EmulatedDeviceGPT,
    RecordedRun,
    RecordingDataParallel,
    Span,
    record_train_dp,
)

__all__ = [
    "COLORS",
    "COMPUTE_KINDS",
    "KINDS",
    "Breakdown",
    "EmulatedDeviceGPT",
    "RecordedRun",
    "RecordingDataParallel",
    "Span",
    "breakdown",
    "intersection_length",
    "plot_timeline",
    "record_train_dp",
    "spans_from_step_times",
    "typical_step",
    "union",
    "union_length",
]

COMPUTE_KINDS = ("forward", "backward")
COLORS = {"input": "#f0a030", "forward": "#9ecae1", "backward": "#3182bd", "wait": "#d62728",
          "optimizer": "#969696", "hidden": "#2ca02c", "exposed": "#d62728", "comm": "#7f7f7f"}


# ----------------------------------------------------------------------------------------------------------------
# Interval arithmetic


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge intervals into disjoint ones, sorted: [(0, 2), (1, 3), (5, 6)] -> [(0, 3), (5, 6)]."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total time covered by at least one interval."""
    return sum(b - a for a, b in union(intervals))


def intersection_length(xs: Iterable[tuple[float, float]], ys: Iterable[tuple[float, float]]) -> float:
    """Time covered by both an interval of ``xs`` and one of ``ys``."""
    ux, uy = union(xs), union(ys)
    total, i, j = 0.0, 0, 0
    while i < len(ux) and j < len(uy):
        lo, hi = max(ux[i][0], uy[j][0]), min(ux[i][1], uy[j][1])
        total += max(0.0, hi - lo)
        if ux[i][1] < uy[j][1]:
            i += 1
        else:
            j += 1
    return total


def _clip(intervals: Iterable[tuple[float, float]], keep: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of ``intervals`` that lie inside ``keep`` (both merged first)."""
    out = []
    for a, b in union(intervals):
        for c, d in union(keep):
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                out.append((lo, hi))
    return out


def _minus(intervals: Iterable[tuple[float, float]], cut: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of ``intervals`` outside every interval of ``cut``."""
    out = []
    cuts = union(cut)
    for a, b in union(intervals):
        pos = a
        for c, d in cuts:
            if d <= pos or c >= b:
                continue
            if c > pos:
                out.append((pos, c))
            pos = max(pos, d)
        if pos < b:
            out.append((pos, b))
    return out


# ----------------------------------------------------------------------------------------------------------------
# One rank's step, in numbers


@dataclass(frozen=True)
class Breakdown:
    """Where one rank's step went (seconds).

    ``compute``: forward + backward (union); ``comm``: time at least one collective was in flight; ``hidden``:
    the part of ``comm`` that ran while the rank computed; ``exposed``: time the rank waited for communication
    (``finish_gradient_sync``); ``input``: waiting for the batch; ``optimizer``; ``step``: first start to last
    end of the step on this rank.
    """

    rank: int
    step: int
    compute: float
    comm: float
    hidden: float
    exposed: float
    input: float
    optimizer: float
    total: float

    @property
    def hidden_fraction(self) -> float:
        """Share of the communication time hidden under compute (0 when there was none)."""
        return self.hidden / self.comm if self.comm > 0 else 0.0

    def __str__(self) -> str:
        ms = 1e3
        text = (f"rank {self.rank}: compute {self.compute * ms:.0f} ms, comm in flight {self.comm * ms:.0f} ms "
                f"({self.hidden * ms:.0f} hidden, {self.exposed * ms:.0f} exposed)")
        if self.input:
            text += f", input wait {self.input * ms:.0f} ms"
        return text + f", step {self.total * ms:.0f} ms"


def _of(spans: Iterable[Span], rank: int, step: int, kinds: Sequence[str]) -> list[tuple[float, float]]:
    return [(s.start, s.end) for s in spans if s.rank == rank and s.step == step and s.kind in kinds]


def breakdown(spans: Sequence[Span], rank: int, step: int) -> Breakdown:
    """Compute / communication / hidden / exposed time of ``rank`` in ``step`` (see :class:`Breakdown`)."""
    mine = [s for s in spans if s.rank == rank and s.step == step]
    if not mine:
        raise ValueError(f"no spans for rank {rank}, step {step}")
    compute = _of(mine, rank, step, COMPUTE_KINDS)
    comms = _of(mine, rank, step, ("comm",))
    return Breakdown(
        rank=rank, step=step, compute=union_length(compute), comm=union_length(comms),
        hidden=intersection_length(comms, compute), exposed=union_length(_of(mine, rank, step, ("wait",))),
        input=union_length(_of(mine, rank, step, ("input",))),
        optimizer=union_length(_of(mine, rank, step, ("optimizer",))),
        total=max(s.end for s in mine) - min(s.start for s in mine))


def typical_step(spans: Sequence[Span], skip_first: bool = True) -> int:
    """The step whose duration (first start to last end over all ranks) is the median one; step 0 (warm-up:
    allocations, first calls) is skipped when there are others."""
    steps = sorted({s.step for s in spans})
    if not steps:
        raise ValueError("no spans")
    if skip_first and len(steps) > 1:
        steps = steps[1:]
    length = {k: max(s.end for s in spans if s.step == k) - min(s.start for s in spans if s.step == k)
              for k in steps}
    med = statistics.median_low(length.values())
    return next(k for k in steps if length[k] == med)


def spans_from_step_times(step_times: Sequence[Any], rank: int = 0) -> list[Span]:
    """Coarse spans from ``DPResult.timeline`` (``StepTime``: compute, exposed wait, optimizer, one after the
    other, steps laid end to end). There is no per-bucket information: the communication lane stays empty."""
    spans, t = [], 0.0
    for st in step_times:
        for kind, seconds in (("backward", st.compute_s), ("wait", st.exposed_comm_s), ("optimizer", st.optimizer_s)):
            spans.append(Span(rank, kind, t, t + seconds, st.step))
            t += seconds
    return spans


# ----------------------------------------------------------------------------------------------------------------
# The figure


def plot_timeline(panels: Mapping[str, Sequence[Span]], *, note: str, step: int | None = None,
                  title: str | None = None, width: float = 9.0, xmax_ms: float | None = None) -> Figure:
    """One panel per run (``panels``: {label: spans of all ranks}), one step each (``step``, default
    :func:`typical_step` of that run), two lanes per rank: compute (input wait, forward, backward, exposed wait,
    optimizer) and communication in flight, green where the rank computes at the same time (hidden) and red
    where it does not (exposed). Times in ms from the step's first start over all ranks. ``note``: how the times
    were produced (required, shown under the title). ``xmax_ms``: a common time axis (default: each panel's own
    maximum, shared by all panels)."""
    if not panels:
        raise ValueError("nothing to plot: no panels")
    if not note:
        raise ValueError("say how the times were produced (note=...): a timeline without its mode is no evidence")
    chosen: dict[str, tuple[int, list[Span]]] = {}
    for label, spans in panels.items():
        if not spans:
            raise ValueError(f"panel {label!r} has no spans")
        k = typical_step(spans) if step is None else step
        sel = [s for s in spans if s.step == k]
        if not sel:
            raise ValueError(f"panel {label!r} has no spans in step {k}")
        chosen[label] = (k, sel)
    origin = {label: min(s.start for s in sel) for label, (_, sel) in chosen.items()}
    longest = max(max(s.end for s in sel) - origin[label] for label, (_, sel) in chosen.items()) * 1e3
    xmax = xmax_ms or longest * 1.02
    n_ranks = [len({s.rank for s in sel}) for _, sel in chosen.values()]
    fig = Figure(figsize=(width, sum(0.75 * n + 0.75 for n in n_ranks) + 0.9), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=[n + 1 for n in n_ranks])[:, 0]
    for ax, (label, (k, sel)) in zip(axes, chosen.items(), strict=True):
        t0 = origin[label]
        ranks = sorted({s.rank for s in sel})
        yticks, ylabels, texts = [], [], []
        for i, r in enumerate(ranks):
            base = (len(ranks) - 1 - i) * 2.2
            compute_iv = _of(sel, r, k, COMPUTE_KINDS)
            for s in (s for s in sel if s.rank == r and s.kind != "comm"):
                ax.broken_barh([((s.start - t0) * 1e3, s.seconds * 1e3)], (base + 1.1, 0.9),
                               facecolors=COLORS[s.kind], edgecolor="white", linewidth=0.3,
                               hatch="//" if s.kind == "wait" else None)
            comm_iv = _of(sel, r, k, ("comm",))
            for part, color in ((_clip(comm_iv, compute_iv), COLORS["hidden"]),
                                (_minus(comm_iv, compute_iv), COLORS["exposed"])):
                ax.broken_barh([((a - t0) * 1e3, (b - a) * 1e3) for a, b in part], (base + 0.1, 0.8),
                               facecolors=color, alpha=0.75)
            for s in (s for s in sel if s.rank == r and s.kind == "comm"):  # one tick per collective issued
                ax.plot([(s.start - t0) * 1e3], [base + 0.95], marker="v", ms=3, color="black", lw=0)
            yticks += [base + 1.55, base + 0.5]
            ylabels += [f"rank {r} compute", f"rank {r} comm"]
            texts.append(str(breakdown(sel, r, k)))
        ax.set_yticks(yticks, ylabels, fontsize=7)
        ax.set_xlim(0, xmax)
        ax.set_ylim(-0.2, len(ranks) * 2.2)
        ax.set_title(f"{label} (step {k})\n" + "\n".join(texts), fontsize=7.5, loc="left")
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(True, axis="x", lw=0.3, alpha=0.5)
    axes[-1].set_xlabel("ms since the step began (first rank to start)", fontsize=8)
    legend = [Patch(color=COLORS[k], label=t) for k, t in (
        ("input", "waiting for the batch"), ("forward", "forward"), ("backward", "backward"),
        ("optimizer", "optimizer step"), ("hidden", "comm in flight, hidden under compute"),
        ("exposed", "comm in flight / exposed wait"))]
    fig.legend(handles=legend, loc="outside lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle((title + "\n" if title else "") + note, fontsize=8.5)
    return fig
