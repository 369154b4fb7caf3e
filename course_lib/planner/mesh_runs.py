"""Meshes of published runs at toy scale, and the planner's pick, trained on real ranks next to its prediction.

Chapter 08 trains several ``ParallelConfig`` s in one launch (``train_measured``: each one ``compose.train_parallel``
with a ``memtrack.MemoryTracker`` over what the rank trains) and compares each with one process
(``train_baseline``) and with what the planner says of the same mesh:

* **model states per rank** -- ``planner_states``: the planner's own memory function
  (``planner_memory._stage_memory``, ``memory.training_memory`` of the ``Candidate`` 's layout) of the rank's
  pipeline stage. The planner prices mixed-precision AdamW (2 + 2 + 12 bytes per parameter); the toy run trains
  fp32 AdamW (4 + 4 + 8). The planner's bytes are turned into elements (its ``bytes_per_param`` per category)
  and back into bytes at the run's precision: the division by tp, pp and the ZeRO group is the planner's.
* **traffic per group** -- ``comm_rows``: the comm log of a step, per (collective, group), with its bytes
  *measured* for our own send/recv and *modelled* (the ring formula) for the backend's collectives
  (``comm.CommRecord.bytes_kind``).

``PRODUCTION_MESHES`` lists the meshes of published runs, each with the run it mirrors and what is scaled
down; a new entry is one ``MeshRun`` (the chapter prints every row from its fields).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from course_lib import comm
from course_lib.estimates.model_states import bytes_per_param
from course_lib.measure.memtrack import MemoryTracker
from course_lib.model_config import GPTConfig
from course_lib.parallel.compose import STEPS, Parallelized
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.runs import ComposedResult, train_parallel
from course_lib.planner.memory import _stage_memory
from course_lib.planner.model import Candidate
from course_lib.runtime.mesh import MeshShape
from course_lib.train import TrainConfig

MODEL_STATES = ("parameters", "gradients", "optimizer_state")
PLANNER_PRECISION = "mixed"
"""The precision ``planner_model`` prices (``_stage_memory`` calls ``training_memory`` with its default)."""


@dataclass(frozen=True)
class MeshRun:
    """A mesh of a published run at toy scale: ``label``, the ``parallel`` configuration trained here, the run
    it ``mirrors`` (paper, mesh), what is ``scaled`` down, and the ``model`` fields it changes in the chapter's
    tiny GPT (an MoE run's experts: ``cfg.with_(**model)``)."""

    label: str
    parallel: ParallelConfig
    mirrors: str
    scaled: str
    model: Mapping[str, Any] = field(default_factory=dict)

    def config(self, cfg: GPTConfig) -> GPTConfig:
        """The model this run trains: ``cfg`` with this run's ``model`` fields."""
        return cfg.with_(**self.model)


PRODUCTION_MESHES: tuple[MeshRun, ...] = (
    MeshRun("TP x CP x PP + SP", ParallelConfig(MeshShape(tp=2, cp=2, pp=2), sequence_parallel=True),
            "Llama 3 405B's 128K-context phase: TP 8 x CP 16 x PP 16 x DP 8 + SP (Llama Team, 'The Llama 3 Herd "
            "of Models', 2024, Sec. 3.3.2)",
            "every degree 2 and DP 1, on 8 ranks; the tiny GPT: 4 blocks, 16-token sequences"),
    MeshRun("FSDP2 x TP x CP + SP", ParallelConfig(MeshShape(dp=2, tp=2, cp=2), zero_stage=3, sequence_parallel=True),
            "torchtitan's long-context shape: FSDP2 (dp_shard) x TP x CP + SP (Liang et al., 'TorchTitan', "
            "2024, Sec. 3)",
            "every degree 2, on 8 ranks; the tiny GPT: 4 blocks, 16-token sequences"),
    MeshRun("FSDP2 x TP x PP", ParallelConfig(MeshShape(dp=2, tp=2, pp=2), zero_stage=3, sequence_parallel=True),
            "torchtitan's 3D: FSDP2 x TP 8 x PP 8 for Llama 3.1 405B on 512 H100s (Liang et al., 'TorchTitan', "
            "2024)",
            "every degree 2, on 8 ranks; the tiny GPT: 4 blocks, 16-token sequences; 2 micro-batches, 1F1B"),
    MeshRun("PP x EP x DP + ZeRO-1", ParallelConfig(MeshShape(dp=4, pp=2, ep=2), zero_stage=1),
            "DeepSeek-V3: PP 16 x EP 64 x ZeRO-1 DP on 2048 H800s, no TP (DeepSeek-AI, 'DeepSeek-V3 Technical "
            "Report', 2024, Sec. 3.2)",
            "DP 4 x PP 2 x EP 2 on 8 ranks; 4 experts, top-2, the z-loss only (capacity and the balance loss "
            "cannot be pipelined with dp > 1 here); the tiny GPT: 4 blocks, 16-token sequences",
            {"n_expert": 4, "top_k": 2, "z_loss_coef": 0.01}),
)
"""Meshes of published runs, trained in one 8-rank launch in chapter 08 (extend with one ``MeshRun`` each)."""


def describe(parallel: ParallelConfig) -> str:
    """The mesh in words: its degrees above 1, the ZeRO stage and SP ("tp 2 x cp 2 x pp 2 + SP")."""
    shape = parallel.shape
    axes = " x ".join(f"{a} {getattr(shape, a)}" for a in ("dp", "tp", "cp", "pp", "ep") if getattr(shape, a) > 1)
    return (axes or "one rank") + (f", ZeRO-{parallel.zero_stage}" if parallel.zero_stage else "") + (
        " + SP" if parallel.sequence_parallel else "")


def candidate_of(parallel: ParallelConfig, global_batch: int) -> Candidate:
    """The planner's ``Candidate`` for a ``ParallelConfig`` (no recomputation; SP is the planner's whenever
    tp > 1, so ``parallel`` must set it then)."""
    if parallel.shape.tp > 1 and not parallel.sequence_parallel:
        raise ValueError(f"{parallel}: the planner prices tp > 1 with sequence parallelism; set "
                         "sequence_parallel=True to compare with it")
    if not isinstance(parallel.schedule, str):
        raise ValueError("the planner knows the schedules by name: give ParallelConfig(schedule=...) a string")
    s = parallel.shape
    micro = global_batch // (s.dp * parallel.microbatches) if s.pp > 1 else global_batch // s.dp
    return Candidate(dp=s.dp, tp=s.tp, pp=s.pp, cp=s.cp, ep=s.ep,
                     zero_stage=parallel.zero_stage, micro_batch=max(micro, 1), recompute="none",
                     schedule=parallel.schedule, v=parallel.v)  # type: ignore[arg-type]


def config_of(cand: Candidate, global_batch: int) -> ParallelConfig:
    """The ``ParallelConfig`` that trains the planner's ``cand`` (its micro-batches per pipeline, SP with TP)."""
    return ParallelConfig(MeshShape(dp=cand.dp, tp=cand.tp, pp=cand.pp, cp=cand.cp, ep=cand.ep),
                          zero_stage=cand.zero_stage, sequence_parallel=cand.tp > 1, schedule=cand.schedule, v=cand.v,
                          microbatches=cand.microbatches(global_batch) if cand.pp > 1 else 2)


def planner_states(cfg: GPTConfig, cand: Candidate, global_batch: int, stage: int,
                   precision: str = "fp32") -> dict[str, float]:
    """The planner's model states (bytes) of pipeline ``stage`` of ``cand``, at the run's ``precision``
    (AdamW): its bytes per category at ``PLANNER_PRECISION`` divided by that precision's bytes per parameter,
    times ``precision`` 's."""
    budgets = dict(_stage_memory(cfg, cand.layout(global_batch, cfg.n_layer), cand.micro_batch, cfg.seq_len,
                                 cand.recompute, "flash"))
    if stage not in budgets:
        raise ValueError(f"stage {stage} of pp={cand.pp}: the planner prices its first two and last two stages "
                         f"only ({sorted(budgets)})")
    budget = budgets[stage]
    theirs, ours = bytes_per_param(PLANNER_PRECISION), bytes_per_param(precision)
    per = {"parameters": (theirs.params, ours.params), "gradients": (theirs.grads, ours.grads),
           "optimizer_state": (theirs.optimizer, ours.optimizer)}
    return {c: budget[c] / per[c][0] * per[c][1] for c in MODEL_STATES}


def track_memory(run: Parallelized, trackers: list[MemoryTracker]) -> None:
    """A last composition step: a ``MemoryTracker`` over what this rank trains (its pipeline stages or the
    whole sharded model), started once the model is built; ``train_measured`` stops it after the run. The
    optimizer's state is seen by the tracker's optimizer-step hooks (``ShardedOptimizer`` steps a local
    optimizer of its partition)."""
    trained = list(run.pipe.stages.values()) if run.pipe is not None else [run.module]
    trackers.append(MemoryTracker(trained).__enter__())


def train_measured(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig,
                   configs: Sequence[ParallelConfig | MeshRun]) -> list[tuple[ComposedResult, dict[str, float]]]:
    """Every configuration of ``configs`` in turn on the same ranks (one launch; each uses the first
    ``world_size`` of its own, all of them here): ``train_parallel``'s run and the tracker's peak bytes per
    model-state category on this rank. A ``MeshRun`` trains its own model (``MeshRun.config(cfg)``). A
    ``launch`` target."""
    out = []
    for item in configs:
        parallel, model = (item.parallel, item.config(cfg)) if isinstance(item, MeshRun) else (item, cfg)
        if parallel.world_size != world_size:
            raise ValueError(f"rank {rank}: {parallel} needs {parallel.world_size} ranks, the launch has "
                             f"{world_size}; launch each world size on its own")
        trackers: list[MemoryTracker] = []
        try:
            result = train_parallel(rank, world_size, model, tc, parallel,
                                    steps=(*STEPS, functools.partial(track_memory, trackers=trackers)))
        finally:
            for tracker in trackers:
                tracker.__exit__(None, None, None)
        tracker = trackers[0]
        out.append((result, {c: float(tracker.category_peaks[c]) for c in MODEL_STATES}))
    return out


def comm_rows(records: list[comm.CommRecord]) -> list[dict[str, object]]:
    """One step's records of a rank as rows per (op, group): calls, bytes sent and whether they are measured
    (our own send/recv) or modelled (the ring formula of a backend collective)."""
    return [{"op@group": f"{r['op']}@{r['group']}", "calls": r["calls"], "sent_bytes": r["sent_bytes"],
             "bytes": r["bytes_kind"]} for r in comm.CommLog(list(records)).summary()]
