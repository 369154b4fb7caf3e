"""Composing the axes: ``parallelize(model, mesh)`` applies TP, CP, EP, PP and DP / ZeRO in one fixed order.

Each axis of a ``course_lib.runtime.mesh.Mesh`` is one in-place transform of the model (``course_lib.parallel.
transforms``); composing them is applying them one after the other to the *same* model, each on its own group
of the mesh, each recording where every parameter now lives (``placement``). The order is fixed, and it is the
one torchtitan's ``parallelize_llama`` applies and Megatron-LM builds its model in:

1. **TP (and SP)** over ``mesh.group("tp")`` first (``apply_tp``): it changes the modules themselves (sliced
   weights, the f / g operators in forward, a vocab-parallel loss). Everything after it sees the sharded layers:
   the pipeline cuts sharded blocks, ZeRO shards the shards again, CP's attention reads this rank's heads.
2. **CP** over ``mesh.group("cp")`` (``apply_cp``): inside the model, no wrapper -- each attention layer attends
   over the cp ring (a TP layer's ``context``, or a ``cp.CPAttention``) and the position embedding reads the
   tokens' global positions. The sequence is split, not the weights: every parameter ``Replicate()`` on cp.
3. **EP** over ``mesh.group("ep")`` (``apply_ep``): a mixture-of-experts model keeps E/ep experts per layer
   (``ExpertParallel``, which also averages the dense gradients over dp x cp and the experts' over ``edp``,
   with a pipeline for this rank's stages only; ZeRO-1 partitions the experts' state over ``edp``: ``ep_mesh``).
   Under TP the MoE layers are not in the plan (``ep_mesh.tp_plan``: no expert tensor parallelism).
4. **PP** over ``mesh.group("pp")`` (``apply_pp``): whatever 1-3 made of the model is cut into stages; the first
   stage embeds the tokens at their CP positions, and under SP the messages are the sequence-sharded hidden
   states (s/tp tokens).
5. **DP / ZeRO** last, over ``mesh.group("dp", "cp")`` (``apply_data_parallel``): CP ranks hold different tokens
   of the same rows, so for the gradient they are data-parallel ranks like any other (Megatron's distributed
   optimizer, torchtitan's ``dp_shard_cp``). It goes last because it must see exactly the parameters this rank
   trains, which exist only after 1-4. With a pipeline the averaging is the schedule's own ``REDUCE_GRAD``
   action; without one a bucketed ``DataParallel`` (ZeRO 0/1: ZeRO-1 is a ``ShardedOptimizer`` over the same
   group), the flat ``ZeroDataParallel`` (ZeRO-2) or ``FSDP2DataParallel`` (ZeRO-3: FSDP + TP, "2D").

A run is described by one value, ``config.ParallelConfig`` (the degrees, their order and every option):
``launch(train_parallel, 8, cfg, tc, ParallelConfig(dp=2, tp=2, pp=2))``.

One step, per rank: this dp rank's rows (``train_loop``), then its cp share of their tokens
(``forward_backward``), forward and backward through TP layers (and the pipeline's schedule), then
``finish_gradient_sync``: the data-parallel average first, then the sums of the gradients placed ``Partial()``
(TP's, over tp; both are sums of the same gradients over different groups, so they commute).

With a pipeline, ZeRO-3 shards each stage (``pp_fsdp``: the schedule's actions gather the shards, ``REDUCE_GRAD``
reduce-scatters the gradients accumulated over the micro-batches once): torchtitan's FSDP x TP x PP.

What this composition refuses, with the reason: ZeRO-2 with a pipeline (``config.ZERO_WITH_PIPELINE``: it would
save nothing over ZeRO-1 there); HSDP with a pipeline (``config.HSDP_WITH_PIPELINE``); with EP, ZeRO-2/3 and
sequence parallelism (``config.EP_REFUSALS``); an MoE's capacity or load-balancing loss under a pipeline with
dp x cp > 1 (``moe_mesh``).

Checked (tests/test_compose.py, tests/test_compose_pairs.py, tests/test_compose_ep.py, tests/test_compose_fsdp_pp.py,
tests/test_hsdp.py): DP x TP x PP (2 x 2 x 2 on 8 ranks), DP x CP, TP x CP, EP x DP, ZeRO-2/3 x TP (with SP),
FSDP2 x CP, PP x CP, PP x TP + SP, FSDP2 x PP (1F1B, GPipe, ZB-H1, interleaved), FSDP2 x TP x PP (+ SP) on 8 ranks,
HSDP (x TP, x CP), EP x PP (+ ZeRO-1; 1F1B, ZB-H1, interleaved), EP x TP, EP x CP, PP x EP x ZeRO-1 and
DP x TP x PP x EP on 8 ranks match one process (``train_baseline``) in losses and every parameter; mutations
(groups built in the wrong axis order, the DP average over the wrong group, the pipeline's gradient reduction
skipped or misplaced, a first stage at
chunk-local positions, ZeRO-3 of a TP weight recorded on the wrong dim, partial gradients summed twice or not at
all, expert gradients over dp x cp instead of edp, experts chosen by the tp coordinate or by their local index,
ZeRO-1 of the experts over dp x cp) fail.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from course_lib import comm
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig
from course_lib.moe import moe_aux_loss
from course_lib.parallel import placement as P
from course_lib.parallel import transforms as T
from course_lib.parallel.config import ParallelConfig, check_composable
from course_lib.parallel.contract import LossFn, ParallelWrapper
from course_lib.parallel.cp import Algorithm, CPContext
from course_lib.parallel.cp_attention import Layout, shard_sequence
from course_lib.parallel.dp import DataParallel
from course_lib.parallel.ep import ExpertParallel
from course_lib.parallel.ep_mesh import ExpertShardedOptimizer, tp_plan
from course_lib.parallel.fsdp2 import FSDP2DataParallel
from course_lib.parallel.loop import ModelFn, StepTime, build_model, train_loop
from course_lib.parallel.mesh_checkpoint import load_checkpoint, load_parameters, restore_optimizer, save_checkpoint
from course_lib.parallel.moe_mesh import share_routing
from course_lib.parallel.pp import PipelineExecutor, PipelineParallel
from course_lib.parallel.schedules import Schedule
from course_lib.parallel.sharded_optimizer import ShardedOptimizer
from course_lib.parallel.tp import TensorParallel
from course_lib.parallel.zero import ZeroDataParallel
from course_lib.runtime.mesh import Mesh
from course_lib.train import TrainConfig, TrainResult, make_optimizer


class Parallelized(ParallelWrapper):
    """``model`` with every non-trivial axis of ``mesh`` applied in place, in the module docstring's order (the
    ``transforms``), behind the one wrapper contract (``train_loop`` drives it like any other form).

    ``forward_backward(x, y)`` takes this data-parallel rank's rows of full sequences: it cuts its cp share of
    the tokens and runs forward and backward (the pipeline's schedule when pp > 1). The parts are attributes:
    ``tp`` (a ``TensorParallel`` or None), ``cp`` (the ``CPContext`` or None), ``ep`` (an ``ExpertParallel`` or
    None), ``pipe`` (a ``PipelineParallel`` or None), ``dp`` (what wraps a model without pipeline for the
    data-parallel average: ``DataParallel``, ``ZeroDataParallel`` (ZeRO-2), ``FSDP2DataParallel`` (ZeRO-3) or
    the ``ExpertParallel``; None). Seams: the classes of the parts (``SEAMS``), for variants and tests.
    """

    axes = ("dp", "cp")

    def __init__(self, model: GPT, mesh: Mesh, *, sequence_parallel: bool = False, cp_layout: Layout = "zigzag",
                 cp_algorithm: Algorithm = "ring", schedule: str | Schedule = "1f1b", microbatches: int = 2,
                 v: int = 1, global_batch: int | None = None, zero_stage: int = 0,
                 tp_class: type[TensorParallel] = TensorParallel,
                 pipeline_class: type[PipelineParallel] = PipelineParallel,
                 executor_class: type[PipelineExecutor] = PipelineExecutor,
                 data_parallel_class: type[DataParallel] = DataParallel,
                 fsdp_class: type[FSDP2DataParallel] = FSDP2DataParallel,
                 cp_context_class: type[CPContext] = CPContext,
                 ep_class: type[ExpertParallel] = ExpertParallel) -> None:
        super().__init__(model, mesh=mesh)
        self.batch_wide_loss = model.config.n_expert > 0  # the router losses: micro-batches cut globally first
        check_composable(mesh.shape, model.config, sequence_parallel=sequence_parallel, global_batch=global_batch,
                         microbatches=microbatches, v=v, zero_stage=zero_stage)
        self.mesh, self.zero_stage = mesh, zero_stage
        # The axes, each an in-place transform of the same model (transforms' docstring), in this order:
        self.tp = T.apply_tp(model, mesh, tp_plan(model.config), sequence_parallel=sequence_parallel,
                             tp_class=tp_class)
        self.cp = (T.apply_cp(model, mesh.group("cp"), layout=cp_layout, algorithm=cp_algorithm,
                              context_class=cp_context_class) if mesh.size("cp") > 1 else None)
        self.ep = T.apply_ep(model, mesh, ep_class=ep_class)
        # MoE routing as on one process over dp x cp, router losses per pipeline stage (moe_mesh's docstring).
        self.routing = share_routing(model, mesh, cp_layout=cp_layout,
                                     microbatches=microbatches if mesh.size("pp") > 1 else None)
        self.pipe = T.apply_pp(model, mesh, schedule=schedule, microbatches=microbatches, v=v,
                               global_batch=global_batch, loss_fn=self.loss, sequence_parallel=sequence_parallel,
                               pipeline_class=pipeline_class, executor_class=executor_class)
        if self.ep is not None and self.pipe is not None:  # the experts' wrapper reduces this rank's stages
            self.ep.hold(self.pipe.parameters())
        self.dp = self.ep or T.apply_data_parallel(model, mesh, zero=zero_stage, pipe=self.pipe,
                                                   data_parallel_class=data_parallel_class, fsdp_class=fsdp_class)
        self.body: nn.Module = self.dp if self.dp is not None else model
        if self.cp is not None:
            self._hooks.extend(self.cp.hooks)

    # -- one step -------------------------------------------------------------------------------------------------

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of this rank's tokens: vocab-parallel cross-entropy under TP (+ the router losses of an
        MoE model)."""
        loss = self.tp.loss(logits.float(), targets) if self.tp is not None else lm_loss(logits.float(), targets)
        return loss + moe_aux_loss(self.module) if self.module.config.n_expert else loss

    def local_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's context-parallel share of the tokens of ``t`` [rows, seq] (all of them when cp = 1)."""
        if self.cp is None:
            return t
        return shard_sequence(t, self.cp.rank, self.cp.size, self.cp.layout, dim=1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of this rank's tokens (``local_tokens(idx)``): vocab-sharded under TP."""
        if self.pipe is not None:
            return self.pipe(idx)  # raises: a pipeline runs forward_backward
        return self.body(idx)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn | None = None,
                         scale: float = 1.0) -> float:
        """One micro-batch of this data-parallel rank's rows (full sequences); ``loss_fn`` is ignored: the
        composed loss is ``loss``. Returns the scaled loss of this rank's tokens."""
        if self.cp is not None:  # every pipeline rank: its later stages never run the model's own forward
            self.cp.begin(x.shape[1], x.device)
        x, y = self.local_tokens(x), self.local_tokens(y)
        if self.pipe is not None:
            return self.pipe.forward_backward(x, y, self.loss, scale)
        loss = self.loss(self(x), y) * scale
        loss.backward()
        return loss.item()

    # -- the contract -------------------------------------------------------------------------------------------

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """What this rank's optimizer steps: its stages' shards (pipeline) or all its shards."""
        if self.pipe is not None:
            return self.pipe.parameters()
        if isinstance(self.dp, ZeroDataParallel):  # ZeRO-2's flat shards, FSDP2's per-parameter ones
            return self.dp.parameters()
        return iter([p for p in self.module.parameters() if p.requires_grad])

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for part in (self.pipe, self.dp):
                if part is not None:
                    stack.enter_context(part.no_sync())
            yield

    def finish_gradient_sync(self) -> None:
        """The data-parallel average (over dp x cp; the pipeline waits for its REDUCE_GRAD all-reduces), then
        the sums of the gradients recorded ``Partial()`` (TP's, over tp), read from the placements of what this
        rank's optimizer steps. Both are sums of the same gradients over different groups, so they commute.
        FSDP2 sums its partial shards itself (its shards replaced the module's parameters, so TP's own
        ``finish_gradient_sync`` would sum them twice); ZeRO-2's flat shards: ``transforms.reduce_partial_flat``."""
        for part in (self.pipe, self.dp):
            if part is not None:
                part.finish_gradient_sync()
        if isinstance(self.dp, FSDP2DataParallel) or (self.pipe is not None and self.pipe.sharding is not None):
            return
        if isinstance(self.dp, ZeroDataParallel):
            T.reduce_partial_flat(self.dp.units, self.mesh)
        else:
            P.reduce_partial_grads(self.parameters(), self.mesh)

    def after_step(self) -> None:
        for part in (self.pipe, self.dp, self.tp):
            if part is not None:
                part.after_step()

    def remove_hooks(self) -> None:
        for part in (self.pipe, self.dp, self.tp):
            if part is not None:
                part.remove_hooks()
        super().remove_hooks()

    def reduce_losses(self, local: torch.Tensor) -> torch.Tensor:
        """The global-batch mean per step: the pipeline's (broadcast from the last stage, then averaged over
        dp x cp: by the pipeline, or here when the experts' wrapper reduces the gradients instead of the
        pipeline), or the mean over dp x cp of the ranks' token means (equal token counts)."""
        if self.pipe is None:
            losses = super().reduce_losses(local)
        else:
            losses = self.pipe.reduce_losses(local)
            if self.ep is not None:
                losses = super().reduce_losses(losses)
        return self.routing.add_stage_losses(losses) if self.routing is not None else losses

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters this rank holds (its stages' under a pipeline), whole, by the single-process model's
        names, fp32 on the CPU: ``placement.full_parameters`` on the mesh (TP shards all-gathered, experts
        gathered). A collective over the axes that shard them: every rank calls it."""
        held = None if self.pipe is None else [q for st in self.pipe.stages.values() for q in st.parameters()]
        return {n: t.cpu() for n, t in P.full_parameters(self.module, self.mesh, held).items()}


def parallelize(model: GPT, mesh: Mesh, config: ParallelConfig | None = None, **options: Any) -> Parallelized:
    """Apply every non-trivial axis of ``mesh`` to ``model`` in place, in the fixed order TP -> CP -> EP -> PP ->
    DP / ZeRO (``transforms``), with the options of ``config`` (a ``ParallelConfig``: ``sequence_parallel``,
    ``zero_stage``, the schedule...; its degrees must be the mesh's) and ``options`` (``Parallelized``'s
    keywords: ``global_batch`` and the part classes). Every rank calls it with the same model (built from the
    same seed) and the same mesh."""
    if config is not None:
        if config.shape != mesh.shape:
            raise ValueError(f"rank {mesh.rank}: parallelize got a ParallelConfig for {config.shape} but the mesh "
                             f"{mesh.shape}: build the mesh from the config (config.mesh())")
        options = {**config.options(), **options}
    return Parallelized(model, mesh, **options)


# ----------------------------------------------------------------------------------------------------------------
# Training helper (a launch target)


@dataclass
class ComposedResult(TrainResult):
    """One rank's run: losses (the global-batch mean per step, equal on every rank), the parameters it trains
    (whole, by name: ``merge_composed`` joins the ranks'), its mesh coordinates, and per step its comm records
    and timing."""

    rank: int = 0
    coords: dict[str, int] = field(default_factory=dict)
    step_comm: list[list[comm.CommRecord]] = field(default_factory=list, repr=False)
    timeline: list[StepTime] = field(default_factory=list, repr=False)


SEAMS = ("tp_class", "pipeline_class", "executor_class", "data_parallel_class", "fsdp_class", "cp_context_class",
         "ep_class")
"""The keywords of ``Parallelized`` that swap a part's class (variants, tests, the grader)."""


@dataclass(frozen=True)
class Checkpointing:
    """Checkpoints of a composed run (``mesh_checkpoint``): ``save_to`` a folder after ``save_after`` steps;
    ``resume_from`` a folder written at any mesh (the run continues from its step on this mesh). Every form:
    replicated, ZeRO-1, ZeRO-2, ZeRO-3 / FSDP2 with or without TP, PP, EP (with ZeRO-1 too: its two
    partitions, ``ep_mesh.ExpertShardedOptimizer``)."""

    save_to: str | None = None
    save_after: int | None = None
    resume_from: str | None = None


def seams_of(caller: str, parts: dict[str, Any]) -> dict[str, Any]:
    """``parts`` when every key is a ``SEAMS`` class keyword; a ``TypeError`` naming ``ParallelConfig`` for a
    degree or option passed the old way (``dp=2``)."""
    fields = set(ParallelConfig.__dataclass_fields__)
    unknown = sorted(set(parts) - set(SEAMS))
    if unknown:
        moved = [k for k in unknown if k in fields]
        hint = (f"{', '.join(moved)} {'is a field' if len(moved) == 1 else 'are fields'} of ParallelConfig: pass "
                f"{caller}(..., ParallelConfig({', '.join(f'{k}=...' for k in moved)})); ") if moved else ""
        raise TypeError(f"{caller}: unexpected keywords {unknown}: {hint}the keywords take only the part "
                        f"classes {list(SEAMS)}")
    return parts


def train_parallel(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None,
                   parallel: ParallelConfig | None = None, *, checkpoint: Checkpointing | None = None,
                   model_fn: ModelFn | None = None, freeze: Sequence[str] = (),
                   composed_class: type[Parallelized] = Parallelized, mesh_class: type[Mesh] = Mesh,
                   **parts: Any) -> ComposedResult:
    """Train on the mesh of ``parallel`` (a ``ParallelConfig``; default one rank) through ``parallelize`` and
    the one training loop (a ``launch`` target: ``launch(train_parallel, 8, cfg, tc, ParallelConfig(dp=2, tp=2,
    pp=2))``). ``parts``: the part classes of ``Parallelized`` (``SEAMS``: ``pipeline_class``, ...);
    ``composed_class`` and ``mesh_class``: seams for tests (a mesh that builds its groups wrong).
    ``checkpoint``: save and resume (``Checkpointing``). Compare ``merge_composed`` of the ranks' results with
    ``train_baseline(cfg, tc, accumulation=parallel.accumulation)``."""
    tc, parallel, checkpoint = tc or TrainConfig(), parallel or ParallelConfig(), checkpoint or Checkpointing()
    seams_of("train_parallel", parts)
    mesh = parallel.mesh(mesh_class)
    model = build_model(cfg, tc.seed, model_fn, freeze)
    start, states = 0, None
    if checkpoint.resume_from is not None:  # whole tensors into the single-process model: parallelize cuts them
        start, whole, states = load_checkpoint(checkpoint.resume_from)
        load_parameters(model, whole)
    composed = composed_class(model, mesh, global_batch=tc.global_batch, **parallel.options(), **parts)
    params = list(composed.parameters())
    if parallel.zero_stage == 1 and mesh.size("dp", "cp") > 1:
        opt_cls, kwargs = ((torch.optim.SGD, {"lr": tc.lr, "momentum": tc.momentum}) if tc.optimizer == "sgd"
                           else (torch.optim.AdamW, {"lr": tc.lr}))
        kwargs |= {"weight_decay": tc.weight_decay, "foreach": False}
        optimizer: torch.optim.Optimizer = (
            ExpertShardedOptimizer(params, composed.ep, mesh, opt_cls, **kwargs) if composed.ep is not None
            else ShardedOptimizer(params, opt_cls, group=mesh.group("dp", "cp"), average_gradients=False,
                                  broadcast=False, **kwargs))
    else:
        optimizer = make_optimizer(params, tc)
    if states is not None:
        restore_optimizer(composed, optimizer, states)

    def maybe_save(step: int) -> None:
        if checkpoint.save_to is not None and step + 1 == checkpoint.save_after:
            save_checkpoint(composed, optimizer, step + 1, checkpoint.save_to)

    out = train_loop(composed, optimizer, cfg, tc, data_rank=mesh.coord("dp"), data_size=mesh.size("dp"),
                     accumulation=parallel.accumulation, start_step=start, on_step_end=maybe_save)
    return ComposedResult(out.losses, composed.full_parameters(), rank=rank, coords=mesh.shape.coords(rank),
                          step_comm=out.step_comm, timeline=out.timeline)


def merge_composed(results: Sequence[ComposedResult]) -> TrainResult:
    """Join the ranks' results (as ``launch`` returns them) into one ``TrainResult`` with every parameter once,
    comparable with ``train_baseline``. Every copy of a parameter (its data-parallel replicas, its TP ranks after
    the all-gather) must be bit-for-bit equal, and every rank must report the same losses: a replica that drifted
    is a bug, named here with its ranks."""
    if not results:
        raise ValueError("no results to merge")
    for r in results:
        if r.losses != results[0].losses:
            raise ValueError(f"rank {r.rank} reports losses {r.losses}, rank {results[0].rank} {results[0].losses}")
    params = P.merge_parameters([r.params for r in results], [r.rank for r in results])
    return TrainResult(list(results[0].losses), params)
