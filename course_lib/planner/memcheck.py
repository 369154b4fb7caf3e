"""The planner's memory of a composed run next to what the run's ranks hold: model states, predicted vs measured.

``planner`` accepts or prunes a mesh by ``memory.training_memory`` of its ``ParallelLayout``. On a run of the
course's tiny GPT, each rank's ``memtrack.MemoryTracker`` measures the same categories, so the prediction can be
checked where it is exact by construction -- the **model states** of what this rank trains:

    parameters      = p x Psi_rank       gradients = g x Psi_rank       optimizer_state = K x Psi_rank

with Psi_rank = ``memory.params_per_rank(cfg, layout, stage)`` (TP splits the block matrices and the vocabulary,
PP the layers, EP the experts), ZeRO's sharding over dp x cp on top, and (p, g, K) = ``memory.bytes_per_param``:
(4, 4, 8) for the fp32 AdamW runs of the course. A pipeline rank holds the whole tiny model but trains only its
stage: ``train_tracked`` (a composed run, ``compose.parallelize``, under a tracker) tracks what the rank trains,
and ``check_run`` compares the stage the rank runs.

Tolerance: 2 % (``REL_TOL``), the one ``tests/test_memory.py`` states for model states. Parameters and gradients
agree to the byte; the optimizer's measured state has 4 more bytes per parameter *tensor* than K x Psi (PyTorch's
``step`` counter), which the estimator leaves out (~0.1 % for the tiny GPT, nothing at scale).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from course_lib.estimates.layout import ParallelLayout
from course_lib.estimates.memory import training_memory
from course_lib.estimates.model_states import OptimizerName
from course_lib.measure.memtrack import MemoryTracker
from course_lib.model_config import GPTConfig
from course_lib.parallel.compose import STEPS, Step, parallelize
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.loop import build_model, train_loop
from course_lib.parallel.runs import ComposedResult
from course_lib.runtime.mesh import Mesh
from course_lib.train import TrainConfig, make_optimizer

MODEL_STATES = ("parameters", "gradients", "optimizer_state")
REL_TOL = 0.02


@dataclass(frozen=True)
class StateCheck:
    """One category on one rank: bytes the estimator predicts and the tracker measured."""

    category: str
    predicted: float
    measured: float
    rel_tol: float = REL_TOL

    @property
    def rel_error(self) -> float:
        """|predicted - measured| / measured (0 when both are 0)."""
        if self.measured == 0:
            return 0.0 if self.predicted == 0 else float("inf")
        return abs(self.predicted - self.measured) / self.measured

    @property
    def ok(self) -> bool:
        return self.rel_error <= self.rel_tol


def model_state_check(cfg: GPTConfig, layout: ParallelLayout, measured: Mapping[str, float], *,
                      precision: str = "fp32", optimizer: OptimizerName = "adamw", stage: int | None = None,
                      rel_tol: float = REL_TOL) -> list[StateCheck]:
    """Predicted (``training_memory(cfg, layout=layout, ...)``, of pipeline ``stage`` when given) vs
    ``measured`` (a tracker's ``category_peaks`` on that rank), one ``StateCheck`` per model-state category."""
    missing = [c for c in MODEL_STATES if c not in measured]
    if missing:
        raise ValueError(f"measured lacks {missing}: pass a MemoryTracker's category_peaks")
    if stage is None and layout.pp > 1:
        raise ValueError("layout.pp > 1: say which pipeline stage this rank trains (stage=...)")
    predicted = training_memory(cfg, precision=precision, optimizer=optimizer, layout=layout, stage=stage)
    return [StateCheck(c, predicted[c], float(measured[c]), rel_tol) for c in MODEL_STATES]


def format_checks(checks: list[StateCheck]) -> str:
    """The checks as aligned text: category, predicted and measured bytes (exact integers), verdict."""
    lines = [f"{'category':<16}{'predicted B':>13}{'measured B':>13}  within {checks[0].rel_tol:.0%}"]
    lines += [f"{c.category:<16}{round(c.predicted):>13}{round(c.measured):>13}  {'PASS' if c.ok else 'FAIL'}"
              for c in checks]
    return "\n".join(lines)


def check_run(cfg: GPTConfig, run: TrackedRun, layout: ParallelLayout, **kwargs: Any) -> list[StateCheck]:
    """``model_state_check`` of one rank of a ``train_tracked`` run: its pipeline stage is its pp coordinate."""
    return model_state_check(cfg, layout, run.memory, stage=run.coords["pp"] if layout.pp > 1 else None, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# A composed run under a tracker


@dataclass
class TrackedRun(ComposedResult):
    """``ComposedResult`` plus ``memory``: the tracker's per-category peaks on this rank over the run (bytes)."""

    memory: dict[str, float] = field(default_factory=dict)


def train_tracked(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig,
                  parallel: ParallelConfig | None = None, *, steps: Sequence[Step] = STEPS,
                  mesh_fn: Callable[[ParallelConfig], Mesh] | None = None) -> TrackedRun:
    """``runs.train_parallel``'s run (replicated optimizer, no checkpoints) on the mesh of ``parallel`` with
    every step under a ``MemoryTracker`` of what this rank trains: its pipeline stages (the rank holds the whole
    model, it trains those) or its whole (TP-sharded) model. ``steps``: the composition (``compose.with_step``
    swaps one); ``mesh_fn``: how the mesh is built (a test's wrong mesh). A ``launch`` target."""
    parallel = parallel or ParallelConfig()
    if parallel.zero_stage:
        raise ValueError("train_tracked runs a replicated optimizer: zero_stage=0")
    mesh = (mesh_fn or ParallelConfig.mesh)(parallel)
    model = build_model(cfg, tc.seed)
    composed = parallelize(model, mesh, parallel, global_batch=tc.global_batch, steps=steps)
    optimizer = make_optimizer(list(composed.parameters()), tc)
    trained = list(composed.pipe.stages.values()) if composed.pipe is not None else [model]
    with MemoryTracker(trained, optimizer) as tracker:
        out = train_loop(composed, optimizer, cfg, tc, data_rank=mesh.coord("dp"), data_size=mesh.size("dp"),
                         accumulation=parallel.accumulation)
    return TrackedRun(out.losses, composed.full_parameters(), rank=rank, coords=mesh.shape.coords(rank),
                      step_comm=out.step_comm, timeline=out.timeline, memory=dict(tracker.category_peaks))
