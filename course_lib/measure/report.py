"""The honest run record: what a scaling result must state before anyone can believe or reproduce it.

Viacheslav Dubrov's "measure honestly" checklist (after the Ultra-Scale Playbook) asks every reported run for:
the model and the code version; the topology (ranks, mesh, backend, device); global and local batch in sequences
and tokens; peak memory by category; tokens per second and MFU computed one consistent way; the time spent in each
kind of collective; scaling efficiency with its kind (strong or weak) and its baseline named; and loss parity
with a single-device baseline. For a long run the same checklist adds input stalls, the checkpoint's time, the
behaviour after a restart and the distribution of stragglers (chapter 10). ``RunRecord`` holds exactly that;
``record_run`` fills it from what the course's training helpers already return (per-step losses, parameters and
``step_comm``) plus the step times the caller measured.

Conventions, stated once:

* tokens/s = global batch x sequence length / median step time (over the measured steps);
* MFU = model FLOPs per token (``cost.training_flops_per_token``: 6N + 12 L h s, no recomputation) x tokens/s
  / (world size x peak FLOPs of one device) -- only when a peak is given (a CPU has none worth quoting);
* time in a collective = the seconds the rank spent inside the call (issue to completion for async ones): it
  includes waiting for slower ranks, so it is an upper bound on the exposed communication;
* bytes are labelled ``measured`` (our own send/recv) or ``modelled`` (a backend collective's ring formula);
* checkpoint time = the seconds a save blocks training (all of a synchronous save; an asynchronous save's copy to
  host memory), with the bytes one save writes over all ranks;
* restarts = how many times the group was started again, and whether the resumed run matched the uninterrupted
  one; stragglers = the detector's verdict (``stragglers.find_straggler``) on per-rank step times.
"""

from __future__ import annotations

import statistics
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from course_lib import comm
from course_lib.estimates import cost
from course_lib.estimates.memory_budget import format_bytes
from course_lib.model_config import GPTConfig, param_count


def code_version() -> str:
    """``git describe --always --dirty`` of the course's checkout, or "unknown" outside one."""
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True, text=True,
                             timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


@dataclass(frozen=True)
class Scaling:
    """A scaling efficiency with what it means: ``kind`` strong (fixed global batch: efficiency = N0 T0 / (N T)) or
    weak (batch grows with N: efficiency = T0 / T), measured against ``baseline_ranks`` at ``baseline_step_s``."""

    kind: Literal["strong", "weak"]
    baseline_ranks: int
    baseline_step_s: float
    ranks: int
    step_s: float

    @property
    def efficiency(self) -> float:
        if self.kind == "strong":
            return self.baseline_ranks * self.baseline_step_s / (self.ranks * self.step_s)
        return self.baseline_step_s / self.step_s

    def __str__(self) -> str:
        return (f"{self.kind} scaling {self.efficiency:.0%} of linear, {self.ranks} ranks against a "
                f"{self.baseline_ranks}-rank baseline")


@dataclass
class RunRecord:
    """One run, reported the way the checklist asks. ``comm`` maps "op@group" to calls, bytes sent per rank per
    step, their kind and seconds per step."""

    model: str
    params: int
    code_version: str
    backend: str
    device: str
    world_size: int
    mesh: dict[str, int]
    global_batch: int
    local_batch: int
    seq_len: int
    steps: int
    step_s: float
    tokens_per_s: float
    mfu: float | None
    comm: dict[str, dict[str, object]] = field(default_factory=dict)
    peak_memory: dict[str, int] | None = None
    scaling: Scaling | None = None
    parity: str | None = None
    checkpoint_s: float | None = None
    checkpoint_bytes: int | None = None
    restarts: int | None = None
    restart_parity: str | None = None
    stragglers: str | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def rows(self) -> list[tuple[str, str]]:
        """(what, value) lines in the checklist's order."""
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1) or "one rank"
        out = [("model", f"{self.model} ({self.params:,} parameters)"), ("code version", self.code_version),
               ("topology", f"{self.world_size} ranks, {mesh}, {self.backend} on {self.device}"),
               ("batch", f"global {self.global_batch} sequences = {self.tokens_per_step:,} tokens/step; "
                         f"local {self.local_batch} sequences of {self.seq_len}"),
               ("steps", str(self.steps)),
               ("throughput", f"{self.tokens_per_s:,.0f} tokens/s (median step {self.step_s * 1e3:.1f} ms)"),
               ("MFU", f"{self.mfu:.1%}" if self.mfu is not None else "not computed (no device peak given)")]
        if self.peak_memory:
            out.append(("peak memory", ", ".join(f"{k} {format_bytes(v)}" for k, v in self.peak_memory.items())))
        for key, c in self.comm.items():
            out.append((f"comm {key}", f"{c['calls']} calls/step, {format_bytes(c['sent_bytes'])} sent/step "
                                       f"({c['bytes_kind']}), {c['seconds'] * 1e3:.2f} ms/step inside the calls"))
        out.append(("scaling", str(self.scaling) if self.scaling else "not measured"))
        out.append(("loss parity", self.parity or "not checked"))
        if self.checkpoint_s is not None:
            size = f", {format_bytes(self.checkpoint_bytes)} per save" if self.checkpoint_bytes is not None else ""
            out.append(("checkpoint", f"{self.checkpoint_s * 1e3:.0f} ms blocking training{size}"))
        if self.restarts is not None:
            out.append(("restarts", f"{self.restarts}" + (f"; {self.restart_parity}" if self.restart_parity else "")))
        if self.stragglers is not None:
            out.append(("stragglers", self.stragglers))
        return out

    def table(self) -> str:
        width = max(len(k) for k, _ in self.rows())
        return "\n".join(f"{k:<{width}}  {v}" for k, v in self.rows())


def comm_summary(step_comm: Sequence[Sequence[comm.CommRecord]]) -> dict[str, dict[str, object]]:
    """Per "op@group": calls, sent bytes and seconds per step (averaged over the steps), and the bytes' kind."""
    n = max(len(step_comm), 1)
    out: dict[str, dict[str, object]] = {}
    for records in step_comm:
        for r in records:
            c = out.setdefault(f"{r.op}@{r.group}", {"calls": 0, "sent_bytes": 0, "bytes_kind": r.bytes_kind,
                                                   "seconds": 0.0})
            c["calls"] += 1
            c["sent_bytes"] += r.sent_bytes
            c["seconds"] += r.seconds or 0.0
            if c["bytes_kind"] != r.bytes_kind:
                c["bytes_kind"] = "mixed"
    for c in out.values():
        c["calls"] //= n
        c["sent_bytes"] //= n
        c["seconds"] /= n
    return out


def record_run(cfg: GPTConfig, *, world_size: int, mesh: Mapping[str, int], global_batch: int, local_batch: int,
               step_seconds: Sequence[float], step_comm: Sequence[Sequence[comm.CommRecord]] = (),
               backend: str = "gloo", device: str = "cpu", peak_flops: float | None = None,
               peak_memory: Mapping[str, int] | None = None, scaling: Scaling | None = None,
               parity: str | None = None, checkpoint_s: float | None = None, checkpoint_bytes: int | None = None,
               restarts: int | None = None, restart_parity: str | None = None,
               stragglers: str | None = None) -> RunRecord:
    """Fill a ``RunRecord`` from a training helper's outputs and the step times the caller measured; a long run
    adds its checkpoint's blocking time and bytes, its restarts and the straggler detector's verdict."""
    if not step_seconds or any(t <= 0 for t in step_seconds):
        raise ValueError("step_seconds must hold at least one positive step time")
    for name, value in (("world_size", world_size), ("global_batch", global_batch), ("local_batch", local_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    for name, value in (("checkpoint_bytes", checkpoint_bytes), ("restarts", restarts)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be an int >= 0 (or None: not recorded), got {value!r}")
    if checkpoint_s is not None and not checkpoint_s >= 0:
        raise ValueError(f"checkpoint_s must be the seconds a save blocks training (>= 0), got {checkpoint_s!r}")
    step_s = statistics.median(step_seconds)
    tokens_per_s = global_batch * cfg.seq_len / step_s
    n = param_count(cfg)
    mfu = None
    if peak_flops is not None:
        mfu = cost.mfu(tokens_per_s, n, peak_flops, world_size, cfg.n_layer, cfg.d_model, cfg.seq_len)
    return RunRecord(cfg.name, n, code_version(), backend, device, world_size, dict(mesh), global_batch,
                     local_batch, cfg.seq_len, len(step_seconds), step_s, tokens_per_s, mfu, comm_summary(step_comm),
                     dict(peak_memory) if peak_memory else None, scaling, parity, checkpoint_s, checkpoint_bytes,
                     restarts, restart_parity, stragglers)
