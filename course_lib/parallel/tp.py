"""Tensor parallelism (Megatron-LM) and sequence parallelism, from scratch.

Tensor parallelism splits the *matrices* of each layer over the t ranks of a TP group, so a layer too big for one
device, and its activations, are divided by t. Shoeybi et al. 2019 ("Megatron-LM", arXiv:1909.08053, Sec. 3):

* **column-parallel** linear ``Y = X A`` with ``A = [A_1 ... A_t]`` split by output columns: rank i computes
  ``Y_i = X A_i`` from a replicated X (``ColumnParallelLinear``; in ``nn.Linear``'s [out, in] layout, rank i holds
  rows ``[i*out/t, (i+1)*out/t)`` of the weight);
* **row-parallel** linear ``Z = Y B`` with B split by input rows: rank i computes ``Y_i B_i`` from its own
  ``Y_i`` and ``Z = sum_i Y_i B_i`` (``RowParallelLinear``);
* an MLP ``GeLU(X A) B`` is column then row: the nonlinearity acts on each ``Y_i`` alone, so one all-reduce (g)
  forward and one (f's backward) backward per MLP; SwiGLU splits gate and up the same way (``TensorParallelMLP``);
* attention is split by **heads**: q/k/v projections column-parallel (n_head/t query heads per rank), the output
  projection row-parallel; GQA divides the n_kv_head K/V heads by t when t divides them and replicates K/V
  otherwise (each rank uses the K/V heads its query heads read; their gradients are then partial sums that
  ``TensorParallel.finish_gradient_sync`` adds up over the group) (``TensorParallelAttention``);
* the embedding is split by **vocabulary** rows (``VocabParallelEmbedding``: ids outside the shard give zeros, a
  g adds the shards), the LM head column-parallel over the vocabulary, and the loss is the **vocab-parallel
  cross-entropy** that never gathers the logits: a global max, the target logit and the sum of exponentials,
  three all-reduces of b*s fp32 scalars against b*s*V for gathering the logits (``vocab_parallel_cross_entropy``).

Per transformer block and rank: 2 all-reduces of V = b*s*h forward and 2 backward (TP), or 2 all-gathers and 2
reduce-scatters each way (TP + SP): the same bytes (``tp_accounting``, with every collective of a step).

**Sequence parallelism** (Korthikanti et al. 2022, arXiv:2205.05198, Sec. 4.2.2): the norms (and dropout) between
the TP regions see the full activation on every rank under plain TP; SP shards them along the sequence: each rank
keeps s/t tokens there, an all-gather enters each TP region and a reduce-scatter leaves it. Activations per layer
drop from sbh(10 + 24/t + 5as/(ht)) to sbh/t (34 + 5as/h)
(``course_lib.estimates.activation_memory.activation_bytes_paper``). Replicated parameters used inside the sharded
region (norm weights and biases, position embeddings, row-parallel biases) then get only the gradient of this rank's
tokens: a partial sum that must be all-reduced over the TP group before the optimizer step -- a step production code has
forgotten more than once.

The ``TensorParallel`` wrapper applies a **plan** (module name pattern -> style, in the spirit of DTensor's
``parallelize_module``) to a single-process model by slicing its existing weights, so parity with one process holds
by construction; ``gpt_plan`` is the plan of the course's GPT. The layers are in ``tp_layers``, f and g in
``tp_comm``, a step's collectives and activations on paper in ``tp_accounting``, DTensor's plan (the oracle of
``train_dtensor_tp``) in ``tp_dtensor``; every name is importable from here.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from course_lib import comm
from course_lib.layers import MLP, Attention
from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.parallel import placement as P
from course_lib.parallel.contract import HasGroups, ParallelWrapper, broadcast_from_first
from course_lib.parallel.loop import ModelFn, StepTime, build_model, train_loop
from course_lib.parallel.tp_accounting import (
    PlannedCollective,
    block_bytes_per_rank,
    layer_activation_bytes_tp,
    step_collectives,
)
from course_lib.parallel.tp_comm import (
    all_gather_along,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
    split_along,
)
from course_lib.parallel.tp_dtensor import (
    DTensorCommLog,
    DTensorTensorParallel,
    dtensor_fsdp_tp_placements,
    dtensor_plan,
)
from course_lib.parallel.tp_layers import (
    TP_AXIS,
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelPositionEmbedding,
    TensorParallelAttention,
    TensorParallelMLP,
    TensorParallelModule,
    TPError,
    VocabParallelEmbedding,
    _size_rank,
    enter_tp_region,
    leave_tp_region,
    place,
    vocab_parallel_cross_entropy,
)
from course_lib.train import TrainConfig, TrainResult, make_optimizer

__all__ = [
    "STYLES",
    "ColumnParallelLinear",
    "DTensorCommLog",
    "DTensorTensorParallel",
    "PlannedCollective",
    "RowParallelLinear",
    "SequenceParallelPositionEmbedding",
    "Style",
    "TPError",
    "TPResult",
    "TensorParallel",
    "TensorParallelAttention",
    "TensorParallelMLP",
    "TensorParallelModule",
    "VocabParallelEmbedding",
    "all_gather_along",
    "block_bytes_per_rank",
    "copy_to_tensor_parallel_region",
    "dtensor_fsdp_tp_placements",
    "dtensor_plan",
    "enter_tp_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "gpt_plan",
    "layer_activation_bytes_tp",
    "leave_tp_region",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
    "split_along",
    "step_collectives",
    "train_dtensor_tp",
    "train_tp",
    "vocab_parallel_cross_entropy",
]

Style = Literal["column", "row", "vocab", "attention", "mlp", "sequence"]
STYLES: tuple[Style, ...] = ("column", "row", "vocab", "attention", "mlp", "sequence")


# ----------------------------------------------------------------------------------------------------------------
# The wrapper and its plan


def gpt_plan(config: GPTConfig) -> dict[str, Style]:
    """The plan of ``course_lib.model.GPT``: vocab-parallel embedding, attention by heads, MLP column -> row,
    norms (and learned positions) as sequence-parallel regions, LM head column-parallel over the vocabulary."""
    plan: dict[str, Style] = {"tok_emb": "vocab"}
    if config.pos == "learned":
        plan["pos_emb"] = "sequence"
    plan |= {"blocks.*.norm1": "sequence", "blocks.*.attn": "attention", "blocks.*.norm2": "sequence",
             "blocks.*.mlp": "mlp", "norm_f": "sequence", "lm_head": "column"}
    return plan


class TensorParallel(ParallelWrapper):
    """Apply a tensor-parallel ``plan`` to ``module`` over the TP group (``mesh.group("tp")`` or ``group``).

    ``plan``: module name (``fnmatch`` pattern) -> style:

    * ``"column"`` / ``"row"``: an ``nn.Linear`` becomes ``ColumnParallelLinear`` (f or all-gather in, output
      features sharded) / ``RowParallelLinear`` (input features sharded, g or reduce-scatter out);
    * ``"vocab"``: an ``nn.Embedding`` becomes ``VocabParallelEmbedding``;
    * ``"attention"`` / ``"mlp"``: the course's ``Attention`` / ``MLP`` become ``TensorParallelAttention`` /
      ``TensorParallelMLP`` (one f in and one g out for the whole region, as Megatron fuses QKV and gate/up);
    * ``"sequence"``: a norm (or the learned position embedding) in the region between TP blocks: replicated;
      with ``sequence_parallel=True`` it runs on s/t tokens and its parameters' gradients are all-reduced.

    The full model is first made identical over the group (a broadcast from the group's first rank, as the
    parameters of one single-process model) and then sliced: every rank keeps only its shards. ``forward`` runs
    the module; a GPT then returns logits sharded over the vocabulary: use ``loss`` (vocab-parallel cross-entropy).

    Every parameter carries its placement on ``"tp"`` (``course_lib.parallel.placement``: ``Shard(dim)``,
    ``Partial()`` or ``Replicate()``, recorded by the layers); the gradient sync, the norm, the gather and the
    checkpoints read nothing else.

    Training step (``loop.train_loop`` drives it like every wrapper): ``forward_backward`` (the loss is
    ``self.loss`` unless the loop passes another), ``finish_gradient_sync()`` (all-reduce of the partial
    gradients), optional ``clip_grad_norm_``, ``optimizer.step()``, ``after_step()`` (nothing to do: every rank
    updated exactly its own shards). TP installs no hooks (its communication lives in autograd Functions), so
    ``remove_hooks`` has nothing to remove.

    Seams: the layer classes each style builds (``column_class`` ... ``mlp_class``), ``parallelize_submodule``,
    ``finish_gradient_sync`` and ``loss``; a subclass overrides one to make a variant.
    """

    column_class: type[ColumnParallelLinear] = ColumnParallelLinear
    row_class: type[RowParallelLinear] = RowParallelLinear
    vocab_class: type[VocabParallelEmbedding] = VocabParallelEmbedding
    attention_class: type[TensorParallelAttention] = TensorParallelAttention
    mlp_class: type[TensorParallelMLP] = TensorParallelMLP

    axes = ("tp",)

    def __init__(self, module: nn.Module, *, mesh: HasGroups | None = None, group: comm.Group = None,
                 plan: Mapping[str, Style] | None = None, sequence_parallel: bool = False,
                 broadcast: bool = True) -> None:
        super().__init__(module, mesh=mesh, group=group)
        self.tp_size, self.tp_rank = _size_rank(self.group)
        self.sequence_parallel = sequence_parallel
        if plan is None:
            if not isinstance(module, GPT):
                raise ValueError("plan= is required for modules other than course_lib.model.GPT")
            plan = gpt_plan(module.config)
        self.plan = dict(plan)
        if broadcast:
            broadcast_from_first(module, self.group)
        self._apply_plan(module)
        for p in module.parameters():  # what no layer changed is replicated over the group
            if TP_AXIS not in P.placements_of(p):
                P.set_placement(p, TP_AXIS, P.Replicate())
        self.groups = {TP_AXIS: self.group}
        """The axis -> group map the generic functions of ``placement`` read (a mesh has more axes)."""

    # -- building -------------------------------------------------------------------------------------------------

    def _apply_plan(self, module: nn.Module) -> None:
        unknown = sorted({s for s in self.plan.values() if s not in STYLES})
        if unknown:
            raise ValueError(f"unknown plan styles {unknown}: use {STYLES}")
        names = [n for n, _ in module.named_modules() if n]
        for pattern, style in self.plan.items():
            matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                raise ValueError(f"plan entry {pattern!r} matches no module (modules: {', '.join(names[:8])}, ...)")
            for name in matched:
                parent_name, _, attr = name.rpartition(".")
                parent = module.get_submodule(parent_name)
                new = self.parallelize_submodule(name, getattr(parent, attr), style)
                if new is not None:
                    setattr(parent, attr, new)
        head, emb = getattr(module, "lm_head", None), getattr(module, "tok_emb", None)
        if getattr(getattr(module, "config", None), "tie_embeddings", False) and head is not None:
            if not (isinstance(head, ColumnParallelLinear) and isinstance(emb, VocabParallelEmbedding)):
                raise ValueError("tied embeddings need tok_emb 'vocab' and lm_head 'column' in the plan")
            head.weight = emb.weight  # both hold the same vocabulary rows

    def parallelize_submodule(self, name: str, m: nn.Module, style: Style) -> nn.Module | None:
        """The replacement of submodule ``name`` under ``style`` (None: keep it in place)."""
        g, sp = self.group, self.sequence_parallel

        def need(kind: type | tuple[type, ...]) -> None:
            if not isinstance(m, kind):
                raise ValueError(f"plan style {style!r} for {name!r} needs {kind}, got {type(m).__name__}")

        if style == "column":
            need(nn.Linear)
            return self.column_class.from_linear(m, g, sequence_parallel=sp)
        if style == "row":
            need(nn.Linear)
            return self.row_class.from_linear(m, g, sequence_parallel=sp)
        if style == "vocab":
            need(nn.Embedding)
            return self.vocab_class(m, g, sequence_parallel=sp)
        if style == "attention":
            need(Attention)
            return self.attention_class(m, g, sequence_parallel=sp)
        if style == "mlp":
            need(MLP)
            return self.mlp_class(m, g, sequence_parallel=sp)
        if not sp:
            return None
        if isinstance(m, nn.Embedding):
            return SequenceParallelPositionEmbedding(m, g)
        place(m, P.Partial())  # a norm on s/t tokens: each rank's gradient is its tokens' share
        return None

    # -- the wrapper contract -------------------------------------------------------------------------------------

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean vocab-parallel cross-entropy of the vocab-sharded logits (the same value on every rank)."""
        return vocab_parallel_cross_entropy(logits, targets, self.group)

    def reduce_losses(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank of the TP group computed the loss of the same batch (the same value): nothing to reduce."""
        return local.to(torch.float32)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: nothing to defer. TP's forward/backward collectives are part of the layer's
        math and cannot be skipped; the only gradient sync (the partial sums) already waits for
        ``finish_gradient_sync`` after the last micro-batch, and summing before or after accumulating is equal."""
        yield

    def finish_gradient_sync(self) -> None:
        """All-reduce (sum) the gradients that are partial sums on each rank -- replicated parameters used on a
        sequence shard under SP, replicated GQA K/V: those placed ``Partial()`` on tp -- in one flat buffer
        (``placement.reduce_partial_grads``). Call after the last backward."""
        P.reduce_partial_grads(self.module.parameters(), self.groups)

    @property
    def partial_grad_parameters(self) -> list[nn.Parameter]:
        """The trainable parameters whose gradients ``finish_gradient_sync`` sums (``Partial()`` on tp)."""
        return [p for p in self.module.parameters()
                if p.requires_grad and isinstance(P.placement(p, TP_AXIS), P.Partial)]

    def shard_dim(self, p: nn.Parameter) -> int | None:
        """The dimension along which ``p`` is cut into tp equal contiguous slices (rank r holds slice r), or
        None for a replicated parameter: its ``Shard`` placement on tp, read."""
        where = P.placement(p, TP_AXIS)
        return where.dim if isinstance(where, P.Shard) else None

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients, each shard counted once (``placement.grad_norm``: the squares of
        the shards all-reduced, one fp32 scalar, plus the replicated ones once)."""
        return P.grad_norm(self.module, self.groups)

    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for the sharded model (``placement.clip_grad_norm_``). Returns
        the norm before clipping."""
        return P.clip_grad_norm_(self.module, max_norm, self.groups, eps)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by the single-process model's names (``placement.full_parameters``: one
        all-gather per sharded parameter)."""
        return P.full_parameters(self.module, self.groups)


# ----------------------------------------------------------------------------------------------------------------
# The training helpers: ours, and DTensor's `parallelize_module` as the second oracle


@dataclass
class TPResult(TrainResult):
    """``TrainResult`` plus this rank's communication records of each step (forward, backward, sync), the
    gradient norms before clipping (when clipping) and each step's timing."""

    step_comm: list[list[comm.CommRecord]] = field(default_factory=list, repr=False)
    grad_norms: list[float] = field(default_factory=list)
    timeline: list[StepTime] = field(default_factory=list, repr=False)


def train_tp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None, *,
             mesh: HasGroups | None = None, group: comm.Group = None, sequence_parallel: bool = False,
             model_fn: ModelFn | None = None, plan: Mapping[str, Style] | None = None,
             clip_grad_norm: float | None = None, accumulation: int = 1, freeze: Sequence[str] = (),
             wrapper_class: type[TensorParallel] = TensorParallel,
             tp_class: type[TensorParallel] | None = None) -> TPResult:
    """Train the GPT with tensor (and optionally sequence) parallelism: a ``launch`` target running
    ``loop.train_loop``.

    Every rank of the TP group sees the whole global batch (TP splits the layers, not the data). The loss is the
    vocab-parallel cross-entropy, the same on every rank. ``clip_grad_norm``: clip the gradients to that global
    norm after the gradient sync, before the step (the loop's ``before_optimizer`` hook). Returns per-step
    losses, the full parameters (gathered) and the communication records of each step. ``wrapper_class``
    (older name ``tp_class``) lets a test or notebook swap in a variant."""
    tc = tc or TrainConfig()
    model = build_model(cfg, tc.seed, model_fn, freeze)
    tp = (tp_class or wrapper_class)(model, mesh=mesh, group=group, plan=plan, sequence_parallel=sequence_parallel)
    opt = make_optimizer([p for p in tp.parameters() if p.requires_grad], tc)
    norms: list[float] = []

    def clip(step: int) -> None:
        if clip_grad_norm is not None:
            norms.append(float(tp.clip_grad_norm_(clip_grad_norm)))

    out = train_loop(tp, opt, cfg, tc, data_rank=0, data_size=1, accumulation=accumulation, before_optimizer=clip)
    return TPResult(out.losses, tp.full_parameters(), out.step_comm, norms, out.timeline)


def train_dtensor_tp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None, *,
                     sequence_parallel: bool = False, group: comm.Group = None) -> TPResult:
    """The same training with DTensor (``DTensorTensorParallel``) through ``loop.train_loop``. ``step_comm``
    holds the collectives DTensor issued each step (``DTensorCommLog``), the optimizer step included (DTensor
    all-reduces the norms' partial gradients there, parameter by parameter)."""
    tc = tc or TrainConfig()
    dt = DTensorTensorParallel(build_model(cfg, tc.seed), group=group, sequence_parallel=sequence_parallel)
    opt = make_optimizer(list(dt.parameters()), tc)
    with dt.recording():
        out = train_loop(dt, opt, cfg, tc, data_rank=0, data_size=1)
    return TPResult(out.losses, dt.full_parameters(), out.step_comm, timeline=out.timeline)
