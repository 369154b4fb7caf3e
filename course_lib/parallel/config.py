"""One value for a composed run: the mesh's degrees and every option of ``parallelize`` (``ParallelConfig``).

torchtitan describes a job's parallelism by one object of degrees (``ParallelDims``: dp_replicate, dp_shard, cp,
tp, pp, ep) next to the options of its job config; here both are one frozen dataclass, so that a run is one value
that can be printed, compared, stored with its results and handed to ``launch``::

    launch(train_parallel, 8, cfg, tc, ParallelConfig(dp=2, tp=2, pp=2, schedule="zb_h1"))

Its constructor refuses a bad degree or axis order with ``MeshShape``'s own messages (each constraint with its
fix); ``validate(cfg, global_batch)`` then checks the model and the batch (``check_composable``): every
divisibility the mesh breaks (``MeshShape.validate``), then every combination the composition does not build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from course_lib.model_config import GPTConfig
from course_lib.parallel.cp import Algorithm
from course_lib.parallel.cp_attention import Layout
from course_lib.parallel.schedules import Schedule
from course_lib.runtime.mesh import DEFAULT_ORDER, Mesh, MeshShape

ZERO_WITH_PIPELINE = ("ZeRO-2 with pipeline parallelism is refused: a stage's gradients are complete only after its "
                      "last micro-batch, so they accumulate unsharded on the stage (torch.distributed.pipelining's "
                      "FSDP rule), which leaves ZeRO-2 nothing to save over ZeRO-1; sharding them after every "
                      "micro-batch would reduce-scatter m times per step (why DeepSpeed's PipelineEngine refuses "
                      "ZeRO >= 2); use zero_stage=1 (the optimizer state sharded over dp+cp) or zero_stage=3 "
                      "(FSDP2: the weights sharded too, gathered per stage by the schedule) with pp > 1")
"""Why ZeRO-2 and a pipeline do not compose here, and the source (``check_composable``, ``transforms``;
ZeRO-3 composes: ``pp_fsdp``)."""


HSDP_NEEDS_FSDP = ("dp_replicate={replicate} is hybrid sharding (HSDP): FSDP2's shards (zero_stage=3) over dp_shard, "
                   "replicated over dp_replicate; with zero_stage={stage} nothing is sharded that could be "
                   "replicated: use zero_stage=3, or dp_replicate=1")
"""Why ``dp_replicate`` > 1 needs ZeRO-3 (``check_composable``, ``transforms.apply_data_parallel``)."""

HSDP_WITH_PIPELINE = ("dp_replicate={replicate} (HSDP) with pipeline parallelism is not built here: a pipeline "
                      "stage's FSDP shards (pp_fsdp) live on the whole dp group, with no replica all-reduce; use "
                      "dp_replicate=1 (FSDP over dp) with pp > 1, or pp=1 for HSDP")
"""Why HSDP and a pipeline do not compose here (``check_composable``, ``transforms.apply_data_parallel``)."""

EP_REFUSALS = {
    "zero": ("ep > 1 with ZeRO-{stage}: the flat (ZeRO-2) or per-parameter (ZeRO-3) shards over dp x cp would "
             "mix the different experts the ep ranks hold in the same slot; Megatron shards the experts over the "
             "expert-data-parallel group instead: use zero_stage=1 (the experts' optimizer state partitioned over "
             "edp, the dense one over dp x cp)"),
    "sp": ("ep > 1 with sequence_parallel: the MoE layers would see s/tp tokens per tp rank (another token order "
           "for the capacity queues, partial router gradients over tp); use sequence_parallel=False with ep"),
}
"""The expert-parallel combinations ``check_composable`` refuses, each with its reason and fix (``ep_mesh``)."""


def routing_refusal(dp_cp: int, pp: int, capacity: bool, load_balancing: bool) -> str:
    """Why an MoE with ``capacity`` or the ``load_balancing`` loss cannot be pipelined over ``pp`` stages with
    ``dp_cp`` = dp x cp ("" when it can): both > 1 give no micro-batch of one process (``moe_mesh``'s
    docstring)."""
    if pp == 1 or dp_cp == 1 or not (capacity or load_balancing):
        return ""
    return (f"an MoE with capacity or the load-balancing loss cannot run with dp x cp = {dp_cp} and "
            f"pp = {pp}: the pipeline cuts each data-parallel rank's rows into its own micro-batches, and "
            f"their union over the dp ranks is no micro-batch of one process, so capacity and f_i would differ from "
            f"train_baseline's. Use dp = 1 with the pipeline (so ep = 1), or capacity_factor=None and "
            f"aux_loss_coef=0 (the z-loss composes)")


def check_composable(shape: MeshShape, cfg: GPTConfig, *, sequence_parallel: bool = False, global_batch: int | None
                     = None, microbatches: int = 1, v: int = 1, zero_stage: int = 0) -> None:
    """Raise ``MeshError`` for every divisibility the mesh breaks (``MeshShape.validate``), then ``ValueError``
    for a combination this composition does not build (see ``course_lib.parallel.compose``): ZeRO-2/3 with a
    pipeline; with ep > 1 the ``EP_REFUSALS`` and ``routing_refusal`` (expert parallelism itself composes with
    tp, pp and cp: ``parallel.ep_mesh``)."""
    micro = global_batch // (shape.dp * microbatches) if global_batch and shape.pp > 1 else 1
    shape.validate(cfg, global_batch=global_batch, micro_batch=max(micro, 1), seq_len=cfg.seq_len, v=v,
                   sp=sequence_parallel)
    unsupported = []
    if shape.pp > 1 and zero_stage == 2:
        unsupported.append(ZERO_WITH_PIPELINE)
    if shape.dp_replicate > 1 and zero_stage != 3:
        unsupported.append(HSDP_NEEDS_FSDP.format(replicate=shape.dp_replicate, stage=zero_stage))
    if shape.dp_replicate > 1 and shape.pp > 1:
        unsupported.append(HSDP_WITH_PIPELINE.format(replicate=shape.dp_replicate))
    if shape.ep > 1:
        if zero_stage >= 2:
            unsupported.append(EP_REFUSALS["zero"].format(stage=zero_stage))
        if sequence_parallel:
            unsupported.append(EP_REFUSALS["sp"])
        routing = routing_refusal(shape.dp * shape.cp, shape.pp, cfg.capacity_factor is not None,
                                  bool(cfg.aux_loss_coef))
        if routing:
            unsupported.append(routing)
    if unsupported:
        raise ValueError("cannot compose this mesh: " + "; ".join(unsupported))


@dataclass(frozen=True)
class ParallelConfig:
    """The mesh and its options for ``compose.train_parallel`` / ``parallelize``.

    * degrees ``dp``, ``cp``, ``tp``, ``pp``, ``ep`` and their ``order`` (fastest first, Megatron's
      ``tp-cp-ep-dp-pp`` by default): ``shape`` is their ``MeshShape``, ``mesh()`` builds the ``Mesh``;
    * ``dp_replicate`` (torchtitan's name): HSDP, dp = dp_replicate x dp_shard; with ``zero_stage=3`` FSDP2
      shards over dp_shard and replicates over dp_replicate (``course_lib.runtime.mesh``'s rank layout). 1: plain FSDP;
    * ``zero_stage``: 0, the optimizer is replicated (gradients averaged by the data-parallel step); 1, a
      ``ShardedOptimizer`` partitions its state over dp x cp (with ep > 1 the experts' over edp:
      ``ep_mesh.ExpertShardedOptimizer``); 2, gradients reduce-scattered too (the flat ``ZeroDataParallel``); 3,
      the parameters as well (FSDP2's per-parameter shards, on top of TP's; with a pipeline the schedule gathers
      them per stage, ``pp_fsdp``); 2 refuses a pipeline (``ZERO_WITH_PIPELINE``);
    * ``sequence_parallel`` (with tp), ``cp_layout`` / ``cp_algorithm`` (with cp), ``schedule``,
      ``microbatches`` and ``v`` (with pp): ``options()``, the keywords ``parallelize`` takes;
    * ``accumulation``: micro-batches per optimizer step of each data-parallel rank (without a pipeline).
    """

    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    order: str = DEFAULT_ORDER
    zero_stage: int = 0
    sequence_parallel: bool = False
    cp_layout: Layout = "zigzag"
    cp_algorithm: Algorithm = "ring"
    schedule: str | Schedule = "1f1b"
    microbatches: int = 2
    v: int = 1
    accumulation: int = 1
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        self.shape  # noqa: B018 -- MeshShape refuses a bad degree or order, with its messages
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage {self.zero_stage}: the ZeRO stages are 0 (replicated optimizer), 1 "
                             "(optimizer state sharded over dp x cp), 2 (and gradients), 3 (and parameters: FSDP2)")
        if self.accumulation < 1:
            raise ValueError(f"accumulation must be >= 1, got {self.accumulation}")

    @property
    def shape(self) -> MeshShape:
        """The degrees and their order as a ``MeshShape`` (rank <-> coordinates, groups, ``validate``)."""
        return MeshShape(dp=self.dp, cp=self.cp, tp=self.tp, pp=self.pp, ep=self.ep, order=self.order,
                         dp_replicate=self.dp_replicate)

    @property
    def world_size(self) -> int:
        """tp x cp x dp x pp: the ranks the run needs."""
        return self.shape.world_size

    def mesh(self, mesh_class: type[Mesh] = Mesh) -> Mesh:
        """The ``Mesh`` of these degrees on the running ranks (a collective: every rank builds it).
        ``mesh_class`` is a seam for tests (a mesh that builds its groups wrong)."""
        return mesh_class(dp=self.dp, cp=self.cp, tp=self.tp, pp=self.pp, ep=self.ep, order=self.order,
                          dp_replicate=self.dp_replicate)

    def options(self) -> dict[str, Any]:
        """The keywords of ``parallelize`` / ``Parallelized`` this configuration sets."""
        return {"sequence_parallel": self.sequence_parallel, "cp_layout": self.cp_layout,
                "cp_algorithm": self.cp_algorithm, "schedule": self.schedule, "microbatches": self.microbatches,
                "v": self.v, "zero_stage": self.zero_stage}

    def validate(self, cfg: GPTConfig, global_batch: int | None = None) -> None:
        """``check_composable`` for this mesh, model and global batch: ``MeshError`` naming every broken
        constraint and its fix, then ``ValueError`` for a combination the composition does not build."""
        check_composable(self.shape, cfg, sequence_parallel=self.sequence_parallel, global_batch=global_batch,
                         microbatches=self.microbatches, v=self.v, zero_stage=self.zero_stage)
