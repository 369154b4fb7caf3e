"""Context parallelism for the tiny GPT: every block's attention becomes ring (or all-gather) attention over
the ranks of the cp group, each rank holding ``seq_len / cp`` tokens of every example.

    cp = ContextParallel(GPT(cfg), group=None, layout="zigzag")   # or mesh=Mesh(dp=2, cp=2)
    x, y = cp.shard(x), cp.shard(y)                               # this rank's tokens and their targets
    lm_loss(cp(x), y).backward()
    cp.finish_gradient_sync()                                     # average gradients over dp x cp
    optimizer.step(); cp.after_step()

(``loop.train_loop`` runs the same step through ``cp.forward_backward``, which cuts the tokens itself.)

What follows the layout (``cp_attention.positions``): the inputs and the loss targets (``shard``), the learned
position embeddings and the RoPE angles (the *global* positions of the rank's tokens), and the causal mask of
every ring step. Everything else in the model is per token and runs unchanged on the local tokens.

Gradients. Each rank's parameter gradient holds the contributions of its tokens (and, through the dK, dV that
ring attention sends back, of other ranks' queries to its keys). The gradient of the global mean loss is the
*average* over the cp ranks -- and over dp x cp with data parallelism too: CP ranks join the data-parallel
gradient all-reduce (as in Megatron-LM, where the gradient group is dp x cp). ``finish_gradient_sync`` runs
``course_lib.parallel.dp.DataParallel``'s bucketed all-reduce over that group.

Communication per layer and rank, forward (ring): cp - 1 sends of one K,V block,
``2 * (s/cp) * b * n_kv * d_head * bytes`` each (``ring_kv_bytes``); backward: cp - 1 K,V sends plus cp sends of
the fp32 dK,dV accumulator. The all-gather form moves the same K,V bytes in one collective (modelled, ring
convention) and reduce-scatters the gradient; it keeps the whole sequence's K,V in memory.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.layers import Attention, apply_rope, rope_cos_sin
from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.parallel import placement as P
from course_lib.parallel.contract import HasGroups, LossFn, ParallelWrapper, require_member
from course_lib.parallel.cp_attention import (
    AttentionStats,
    BlockAttention,
    Layout,
    all_positions,
    allgather_attention,
    check_sequence,
    chunks_per_rank,
    ring_attention,
    shard_sequence,
)
from course_lib.parallel.cp_ulysses import ulysses_attention
from course_lib.parallel.dp import DataParallel, Mode
from course_lib.parallel.loop import ModelFn, StepTime, build_model, train_loop
from course_lib.parallel.zero import ZeroDataParallel
from course_lib.train import TrainConfig, TrainResult, full_params, make_optimizer

Algorithm = Literal["ring", "allgather", "ulysses"]
ALGORITHMS: tuple[Algorithm, ...] = ("ring", "allgather", "ulysses")
_ATTEND = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}


def ring_kv_bytes(seq_len: int, batch: int, n_kv_head: int, head_dim: int, cp: int, element_size: int) -> int:
    """Bytes of the K,V block one ring step sends: 2 * (s/cp) * b * n_kv * d_head * bytes."""
    return 2 * (seq_len // cp) * batch * n_kv_head * head_dim * element_size


def ring_sends_per_layer(cp: int) -> dict[str, int]:
    """Sends per layer and rank: forward cp - 1 K,V blocks; backward cp - 1 K,V blocks and cp dK,dV blocks."""
    return {"forward_kv": cp - 1, "backward_kv": cp - 1, "backward_dkv": cp if cp > 1 else 0}


def activation_bytes_per_rank(cfg: GPTConfig, micro_batch: int, seq_len: int, cp: int,
                              element_bytes: int = 4) -> int:
    """Activation bytes one CP rank saves for backward (what ``course_lib.measure.memtrack`` measures), from the
    estimator's adapted formula at s/cp tokens (``memory.model_activation_bytes``) and what ring attention saves
    differently from PyTorch's SDPA: un-repeated K,V under GQA (2e(h - h_kv) less per token and layer), a
    contiguous attention output that o_proj saves as a copy without RoPE too (e*h more), and the positions of
    every rank [cp, s/cp] int64, shared by all layers (which replace the learned position ids).

    Everything scales with s/cp except those positions: activation memory per rank falls as 1/cp.
    """
    from course_lib.estimates.activation_memory import model_activation_bytes

    n = micro_batch * seq_len // cp
    e, h, layers = element_bytes, cfg.d_model, cfg.n_layer
    base = sum(model_activation_bytes(cfg, micro_batch, seq_len // cp, formula="adapted",
                                      element_bytes=e).values())
    gqa = -2 * e * n * (h - cfg.kv_heads * cfg.head_dim) * layers
    o_copy = 0 if cfg.pos == "rope" else e * n * h * layers
    pos = 8 * seq_len - (8 * seq_len // cp if cfg.pos == "learned" else 0)
    return int(base + gqa + o_copy + pos)


class CPContext:
    """What every ring-attention layer of one model shares: the group, the layout, the algorithm, and the
    positions of the batch now running (``begin``: set by the model's forward, or by the composed step on every
    pipeline rank, whose stages do not all run the model's forward)."""

    def __init__(self, group: comm.Group, layout: Layout, algorithm: Algorithm, causal: bool,
                 kernel: BlockAttention, max_len: int | None = None) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}: use one of {ALGORITHMS}")
        self.group, self.layout, self.algorithm, self.causal, self.kernel = group, layout, algorithm, causal, kernel
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.max_len = max_len
        self.positions: torch.Tensor | None = None  # [cp, T_local]
        self.stats = AttentionStats()
        self.hooks: list[Any] = []  # apply_cp's pre-hooks (the wrapper's remove_hooks removes them)

    def begin(self, seq_len: int, device: torch.device | str | None = None) -> None:
        """A batch of full sequences of ``seq_len`` tokens starts: every rank's global positions in the layout."""
        if self.max_len is not None and seq_len > self.max_len:
            raise ValueError(f"{seq_len // self.size} tokens per rank x cp={self.size} exceeds "
                             f"seq_len={self.max_len}")
        check_sequence(seq_len, self.size, self.layout)
        self.positions = all_positions(seq_len, self.size, self.layout, device)

    def local_positions(self) -> torch.Tensor:
        """The global positions of this rank's tokens in the batch now running."""
        if self.positions is None:
            raise RuntimeError("no batch is running: the positions are set by CPContext.begin (the model's forward)")
        return self.positions[self.rank]

    def embedding_positions(self, n: int) -> torch.Tensor:
        """The positions the learned position embedding reads for this rank's ``n`` tokens: their global ones
        (a seam: a pipeline's first stage that embeds chunk-local positions 0..n-1 is a subclass)."""
        mine = self.local_positions()
        if mine.numel() != n:
            raise ValueError(f"the position embedding got {n} positions, this rank holds {mine.numel()} tokens")
        return mine

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _ATTEND[self.algorithm](q, k, v, self.positions, chunks_per_rank(self.layout), self.causal,
                                       self.group, self.kernel, self.stats)


class CPAttention(nn.Module):
    """The GPT's attention with the same projections (same parameter names), attending over the cp group."""

    def __init__(self, attn: Attention, ctx: CPContext) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim, self.rope = attn.n_head, attn.n_kv_head, attn.head_dim, attn.rope
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.ctx = ctx

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE at the tokens' *global* positions (a seam: a layout bug that forgets this is a subclass)."""
        cos, sin = rope_cos_sin(positions.numel(), self.head_dim, positions=positions.cpu())
        cos, sin = cos.to(q.device), sin.to(q.device)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.rope:
            q, k = self.rotary(q, k, self.ctx.local_positions())
        y = self.ctx.attend(q.contiguous(), k.contiguous(), v.contiguous())
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def apply_cp(model: GPT, group: comm.Group, *, layout: Layout = "zigzag", algorithm: Algorithm = "ring",
             causal: bool = True, kernel: BlockAttention | None = None,
             attention_class: type[CPAttention] = CPAttention,
             context_class: type[CPContext] = CPContext) -> CPContext:
    """Context parallelism as an in-place transform of ``model`` over ``group``: no wrapper, the model itself
    then runs on this rank's s/cp tokens (``shard_sequence``) and is still a ``GPT`` a pipeline can cut.

    * every block's attention attends over the cp group: a tensor-parallel one (already transformed) gets the
      context (``TensorParallelAttention.context``), the plain one becomes ``attention_class`` (same parameter
      names);
    * the model's forward first sets the global positions of every rank's tokens (``CPContext.begin``, a
      forward pre-hook), and the learned position embedding reads this rank's global positions instead of
      0..s/cp-1 (a pre-hook on ``pos_emb``, whichever module TP left there);
    * no parameter changes: each is recorded ``Replicate()`` on "cp".

    Returns the ``CPContext`` every layer shares (its ``stats``, ``begin`` for a pipeline's later stages)."""
    ctx = context_class(group, layout, algorithm, causal, kernel or BlockAttention(), max_len=model.config.seq_len)
    for p in model.parameters():  # the sequence is split, not the weights
        P.set_placement(p, "cp", P.Replicate())
    for block in model.blocks:
        if hasattr(block.attn, "context"):  # a TensorParallelAttention: its heads, over the cp ring
            block.attn.context = ctx
        else:
            block.attn = attention_class(block.attn, ctx)
    ctx.hooks.append(model.register_forward_pre_hook(
        lambda _m, args: ctx.begin(args[0].shape[1] * ctx.size, args[0].device)))
    if model.pos_emb is not None:
        ctx.hooks.append(model.pos_emb.register_forward_pre_hook(
            lambda _m, args: (ctx.embedding_positions(args[0].numel()),)))
    return ctx


class ContextParallel(ParallelWrapper):
    """Wrap a ``GPT`` so that it runs on this rank's ``seq_len / cp`` tokens with attention over the cp group.

    ``mesh`` (its "cp" axis; gradients averaged over "dp" x "cp") or ``group`` (the cp group, default the world;
    gradients averaged over ``grad_group``, default the same group). ``layout``: "zigzag" (balanced under the
    causal mask) or "contiguous". ``algorithm``: "ring" (isend/irecv around the ring), "allgather"
    or "ulysses" (all-to-all from sequence to head shards and back, ``cp_ulysses``; cp must divide n_kv_head).
    ``kernel``: the per-block operations (a ``BlockAttention``); ``attention_class``: the module each block's
    attention becomes. Both are seams for variants and tests. Initial weights are broadcast over the gradient
    group. The model's attention modules are replaced in place (parameter names unchanged).

    The model itself is transformed in place (``apply_cp``). The gradient reduction over the gradient group is a
    data-parallel wrapper around it, ``grad_sync``: a bucketed ``DataParallel`` (``dp_mode``), or with
    ``zero_stage`` (0-3) a ``zero.ZeroDataParallel`` that also shards the model states over dp x cp -- CP ranks
    hold different tokens of the same sequences, so for ZeRO they are data-parallel ranks like any other
    (Megatron's distributed optimizer, torchtitan's dp_shard_cp). ``average_gradients=False`` leaves the
    reduction to the caller.

    ``forward(idx)`` takes this rank's tokens (``shard``); ``forward_backward(x, y)`` (what the training loop
    calls) takes full sequences and cuts them itself.
    """

    axes = ("cp",)

    def __init__(self, module: GPT, *, mesh: HasGroups | None = None, group: comm.Group = None,
                 grad_group: comm.Group = None, layout: Layout = "zigzag", algorithm: Algorithm = "ring",
                 causal: bool = True, kernel: BlockAttention | None = None,
                 attention_class: type[CPAttention] = CPAttention, dp_mode: Mode = "bucketed",
                 average_gradients: bool = True, zero_stage: int | None = None) -> None:
        chunks_per_rank(layout)  # validates the name
        super().__init__(module, mesh=mesh, group=group)
        if mesh is not None:
            grad_group = mesh.group("dp", "cp")
        elif grad_group is None:
            grad_group = self.group
        require_member(grad_group, type(self).__name__)
        self.ctx = apply_cp(module, self.group, layout=layout, algorithm=algorithm, causal=causal, kernel=kernel,
                            attention_class=attention_class)
        self.grad_group = grad_group
        self.zero_stage = zero_stage
        self.sharded = module  # apply_cp made the model itself run on this rank's tokens
        self._hooks.extend(self.ctx.hooks)
        self.grad_sync: ParallelWrapper | None = None
        if zero_stage is not None:
            self.grad_sync = ZeroDataParallel(self.sharded, zero_stage, units=[*module.blocks, module],
                                              group=grad_group)
        elif average_gradients:
            self.grad_sync = DataParallel(self.sharded, group=grad_group, mode=dp_mode)

    @property
    def cp_rank(self) -> int:
        return self.ctx.rank

    @property
    def cp_size(self) -> int:
        return self.ctx.size

    @property
    def stats(self) -> AttentionStats:
        """Attention work of this rank since construction (unmasked pairs, blocks computed / skipped)."""
        return self.ctx.stats

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a full-sequence tensor (inputs, targets) in the wrapper's layout."""
        return shard_sequence(t, self.cp_rank, self.cp_size, self.ctx.layout, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx [B, s/cp] (this rank's tokens, from ``shard``) -> logits [B, s/cp, vocab]."""
        return self.sharded(idx) if self.grad_sync is None else self.grad_sync(idx)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn | None = None,
                         scale: float = 1.0) -> float:
        """One micro-batch of full sequences: this rank's tokens of ``x`` and ``y`` (``shard``), forward (the
        ring runs), backward. Returns the scaled loss of this rank's tokens."""
        return super().forward_backward(self.shard(x), self.shard(y), loss_fn, scale)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """What this rank's optimizer steps: the trainable parameters (replicated), or ZeRO's shards."""
        params = self.grad_sync.parameters() if self.zero_stage is not None else self.module.parameters()
        return iter([p for p in params if p.requires_grad])

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally (the ring still runs: attention needs every rank in every forward)."""
        return super().no_sync() if self.grad_sync is None else self.grad_sync.no_sync()

    def finish_gradient_sync(self) -> None:
        """Average the gradients over the gradient group (cp, or dp x cp); before ``optimizer.step()``."""
        if self.grad_sync is not None:
            self.grad_sync.finish_gradient_sync()

    def after_step(self) -> None:
        """Replicated weights: nothing to do; ZeRO 1/2 all-gather the updated shards."""
        if self.grad_sync is not None:
            self.grad_sync.after_step()

    def remove_hooks(self) -> None:
        """Remove the gradient hooks of the data-parallel part (none in the default bucketed mode)."""
        if self.grad_sync is not None:
            self.grad_sync.remove_hooks()
        super().remove_hooks()

    def reduce_losses(self, local: torch.Tensor) -> torch.Tensor:
        """The global-batch mean per step: the mean over the gradient group (dp x cp) of the ranks' token
        means (every rank holds as many tokens)."""
        losses = local.to(torch.float32)
        comm.all_reduce(losses, group=self.grad_group)
        return losses / dist.get_world_size(self.grad_group)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by the model's names (under ZeRO gathered from the shards: a collective)."""
        if self.zero_stage is None:
            return full_params(self.module)
        return self.grad_sync.full_state_dict()


# ----------------------------------------------------------------------------------------------------------------
# Training helper (a launch target)


@dataclass
class CPResult(TrainResult):
    """Losses and full parameters (comparable with ``train_baseline``), this rank's comm records per step and
    its attention work (unmasked (q, k) pairs per step)."""

    step_comm: list[list[comm.CommRecord]] = field(default_factory=list, repr=False)
    pairs: list[int] = field(default_factory=list)
    timeline: list[StepTime] = field(default_factory=list, repr=False)


def train_cp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None, *,
             mesh: HasGroups | None = None, group: comm.Group = None, layout: Layout = "zigzag",
             algorithm: Algorithm = "ring", model_fn: ModelFn | None = None, kernel: BlockAttention | None = None,
             attention_class: type[CPAttention] = CPAttention,
             wrapper_class: type[ContextParallel] = ContextParallel, zero_stage: int | None = None,
             accumulation: int = 1, freeze: Sequence[str] = ()) -> CPResult:
    """Train with context parallelism (and data parallelism when ``mesh`` has a dp axis) through
    ``loop.train_loop``: each step, the dp rank's rows of ``global_batch(step, ...)``, and of those this cp
    rank's tokens in the layout. ``zero_stage`` (0-3): ``ContextParallel``'s gradient reduction is
    ``zero.ZeroDataParallel`` over the gradient group (dp x cp, or cp) instead of the all-reduce."""
    tc = tc or TrainConfig()
    dp_rank, dp_size = (mesh.coord("dp"), mesh.size("dp")) if mesh is not None else (0, 1)
    model = build_model(cfg, tc.seed, model_fn, freeze)
    cp = wrapper_class(model, mesh=mesh, group=group, layout=layout, algorithm=algorithm, kernel=kernel,
                       attention_class=attention_class, zero_stage=zero_stage)
    opt = make_optimizer(list(cp.parameters()), tc)
    marks = [cp.stats.pairs]
    out = train_loop(cp, opt, cfg, tc, data_rank=dp_rank, data_size=dp_size, accumulation=accumulation,
                     on_step_end=lambda step: marks.append(cp.stats.pairs))
    return CPResult(out.losses, cp.full_parameters(), out.step_comm, [b - a for a, b in itertools.pairwise(marks)],
                    out.timeline)
