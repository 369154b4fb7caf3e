"""One value for a composed run: its mesh (a ``MeshShape``) and every option of ``parallelize``.

torchtitan describes a job's parallelism by one object of degrees (``ParallelDims``) next to its
options; ``ParallelConfig`` *contains* the ``MeshShape`` (degrees, their order, HSDP's
``dp_replicate``) and holds the options beside it: a run is one value that can be printed,
compared, stored and handed to ``launch``::

    launch(train_parallel, 8, cfg, tc,
           ParallelConfig(MeshShape(dp=2, tp=2, pp=2), schedule="zb_h1"))

``validate(cfg, global_batch)`` (``check_composable``) names every divisibility the mesh breaks
(``MeshShape.validate``), then every combination the composition does not build, with reason and
fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from course_lib.model_config import GPTConfig
from course_lib.parallel.cp_attention import Layout
from course_lib.parallel.schedules import Schedule
from course_lib.parallel.zero import check_stage
from course_lib.runtime.mesh import Mesh, MeshShape

ALGORITHMS = ("ring", "allgather", "ulysses")
"""Context parallelism's attention: ring (K,V passed around), all-gather (K,V gathered), Ulysses
(all-to-all)."""

ZERO_WITH_PIPELINE = ("ZeRO-2 with pipeline parallelism is refused: a stage's gradients are "
                      "complete only after its last micro-batch, so they accumulate unsharded on "
                      "the stage (torch.distributed.pipelining's FSDP rule), which leaves ZeRO-2 "
                      "nothing to save over ZeRO-1; sharding them after every micro-batch would "
                      "reduce-scatter m times per step (why DeepSpeed's PipelineEngine refuses "
                      "ZeRO >= 2); use zero_stage=1 (the optimizer state sharded over dp+cp) or "
                      "zero_stage=3 (FSDP2: the weights sharded too, gathered per stage by the "
                      "schedule)")

HSDP_NEEDS_FSDP = ("dp_replicate={replicate} is hybrid sharding (HSDP): FSDP2's shards "
                   "(zero_stage=3) over dp_shard, replicated over dp_replicate; with "
                   "zero_stage={stage} nothing is sharded that could be replicated: use "
                   "zero_stage=3, or dp_replicate=1")

EP_REFUSALS = {
    "zero": ("ep > 1 with ZeRO-{stage}: the flat (ZeRO-2) and per-parameter (ZeRO-3) shards are "
             "built over one data group per unit, and an expert's data group (edp) differs from "
             "its block's dense parameters' (dp x cp), so a unit would need two groups; Megatron "
             "shards the experts' state over edp in buffers of their own: use zero_stage=1 (the "
             "experts' optimizer state partitioned over edp, the dense one over dp x cp)"),
    "sp": ("ep > 1 with sequence_parallel: the MoE layers would see s/tp tokens per tp rank "
           "(another token order for the capacity queues, partial router gradients over tp); use "
           "sequence_parallel=False with ep"),
}


def routing_refusal(dp_cp: int, pp: int, capacity: bool, load_balancing: bool,
                    scope: str = "global") -> str:
    """Why an MoE with ``capacity`` or the ``load_balancing`` loss cannot be pipelined over ``pp``
    stages with ``dp_cp`` = dp x cp ("" when it can): under the global ``scope`` its micro-batches
    would be no micro-batch of one process; the local scope (each rank's own micro-batch, as
    Megatron-LM) composes."""
    if pp == 1 or dp_cp == 1 or not (capacity or load_balancing) or scope == "local":
        return ""
    return (f"an MoE with capacity or the load-balancing loss cannot run with dp x cp = {dp_cp} "
            f"and pp = {pp}: the pipeline cuts each data-parallel rank's rows into its own "
            "micro-batches, and their union over the dp ranks is no micro-batch of one process, so "
            "capacity and f_i would differ from train_baseline's. Use capacity_scope='local' (each "
            "rank's own capacity and balance loss, as Megatron-LM computes them), dp = 1 with the "
            "pipeline (so ep = 1), or capacity_factor=None and aux_loss_coef=0 (the z-loss "
            "composes)")


def policy_refusal(dp_cp: int, cfg: GPTConfig) -> str:
    """Why ``cfg.drop_policy`` cannot run over ``dp_cp`` = dp x cp ranks ("" when it can): the
    global queues run in the single process's token order; production's policies are each rank's
    (the local scope)."""
    if (dp_cp == 1 or cfg.capacity_factor is None or cfg.drop_policy == "position"
            or cfg.capacity_scope == "local"):
        return ""
    return (f"drop_policy={cfg.drop_policy!r} with capacity_scope='global' over dp x cp = {dp_cp}: "
            "the global capacity queues every rank's assignments in the token order of one "
            "process; Megatron-LM, DeepSpeed and Tutel apply their policies to each rank's own "
            "tokens: use capacity_scope='local'")


def check_composable(shape: MeshShape, cfg: GPTConfig, *, sequence_parallel: bool = False,
                     global_batch: int | None = None, microbatches: int = 1, v: int = 1,
                     zero_stage: int = 0) -> None:
    """``MeshError`` for every divisibility the mesh breaks (``MeshShape.validate``), then
    ``ValueError`` for every combination the composition does not build (ZeRO-2 with a pipeline,
    HSDP without ZeRO-3, with ep > 1 ZeRO-2/3 and SP, an MoE's global routing under a pipeline with
    dp x cp > 1 or with a drop policy other than "position" over dp x cp > 1)."""
    micro = global_batch // (shape.dp * microbatches) if global_batch and shape.pp > 1 else 1
    shape.validate(cfg, global_batch=global_batch, micro_batch=max(micro, 1), seq_len=cfg.seq_len,
                   v=v, sp=sequence_parallel)
    unsupported = []
    if shape.pp > 1 and zero_stage == 2:
        unsupported.append(ZERO_WITH_PIPELINE)
    if shape.dp_replicate > 1 and zero_stage != 3:
        unsupported.append(HSDP_NEEDS_FSDP.format(replicate=shape.dp_replicate, stage=zero_stage))
    if shape.ep > 1:
        if zero_stage >= 2:
            unsupported.append(EP_REFUSALS["zero"].format(stage=zero_stage))
        if sequence_parallel:
            unsupported.append(EP_REFUSALS["sp"])
    routing = routing_refusal(shape.dp * shape.cp, shape.pp, cfg.capacity_factor is not None,
                              bool(cfg.aux_loss_coef), cfg.capacity_scope)
    policy = policy_refusal(shape.dp * shape.cp, cfg)
    unsupported += [why for why in (routing, policy) if why and cfg.n_expert]
    if unsupported:
        raise ValueError("cannot compose this mesh: " + "; ".join(unsupported))


@dataclass(frozen=True)
class ParallelConfig:
    """The mesh ``shape`` and the options of ``compose.parallelize``:

    * ``zero_stage`` 0 (the optimizer replicated), 1 (its state partitioned over the data ranks:
      ZeRO-1), 2 (and the gradients: the flat ``ZeroDataParallel``), 3 (and the parameters: FSDP2,
      per stage under a pipeline); HSDP is ``shape.dp_replicate`` > 1 with ``zero_stage=3``;
    * ``sequence_parallel`` (with tp), ``cp_layout`` / ``cp_algorithm`` (with cp), ``schedule``,
      ``microbatches`` and ``v`` (with pp), ``bias_update_rate`` (MoE loss-free balancing);
    * ``accumulation``: micro-batches per step of each data-parallel rank (without a pipeline)."""

    shape: MeshShape = field(default_factory=MeshShape)
    zero_stage: int = 0
    sequence_parallel: bool = False
    cp_layout: Layout = "zigzag"
    cp_algorithm: str = "ring"
    schedule: str | Schedule = "1f1b"
    microbatches: int = 2
    v: int = 1
    accumulation: int = 1
    bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.shape, MeshShape):
            raise TypeError("ParallelConfig's first field is the mesh: "
                            f"ParallelConfig(MeshShape(dp=2, tp=2), ...), got {self.shape!r}")
        check_stage(self.zero_stage)
        if self.cp_algorithm not in ALGORITHMS:
            raise ValueError(f"unknown cp_algorithm {self.cp_algorithm!r}: use one of {ALGORITHMS}")
        if self.accumulation < 1:
            raise ValueError(f"accumulation must be >= 1, got {self.accumulation}")

    @property
    def world_size(self) -> int:
        """The ranks the run needs: tp x cp x dp x pp."""
        return self.shape.world_size

    def mesh(self) -> Mesh:
        """The ``Mesh`` of this shape on the running ranks (a collective: every rank builds it)."""
        return Mesh(**dataclasses.asdict(self.shape))

    def validate(self, cfg: GPTConfig, global_batch: int | None = None) -> None:
        """``check_composable`` for this mesh, model and global batch."""
        check_composable(self.shape, cfg, sequence_parallel=self.sequence_parallel,
                         global_batch=global_batch, microbatches=self.microbatches, v=self.v,
                         zero_stage=self.zero_stage)
