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

Communication per transformer block, per rank, with V = b*s*h activation elements (ring bytes, ``comm``)::

    TP       forward  2 all-reduces of V (after attention, after MLP)    backward  2 all-reduces of V (the f's)
    TP + SP  forward  2 all-gathers + 2 reduce-scatters of V            backward  the same, reversed

An all-reduce is a reduce-scatter plus an all-gather, so both rows move 4 x 2(t-1)/t x V bytes a block and step.

**Sequence parallelism** (Korthikanti et al. 2022, arXiv:2205.05198, Sec. 4.2.2): the norms (and dropout) between
the TP regions see the full activation on every rank under plain TP; SP shards them along the sequence: each rank
keeps s/t tokens there, an all-gather enters each TP region and a reduce-scatter leaves it. Activations per layer
drop from sbh(10 + 24/t + 5as/(ht)) to sbh/t (34 + 5as/h) (``course_lib.memory.activation_bytes_paper``).
Replicated parameters used inside the sharded region (norm weights and biases, position embeddings, row-parallel
biases) then get only the gradient of this rank's tokens: a partial sum that must be all-reduced over the TP group
before the optimizer step -- a step production code has forgotten more than once.

The ``TensorParallel`` wrapper applies a **plan** (module name pattern -> style, in the spirit of DTensor's
``parallelize_module``) to a single-process model by slicing its existing weights, so parity with one process holds
by construction; ``gpt_plan`` is the plan of the course's GPT.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib import comm
from course_lib.data import global_batch
from course_lib.launch import device
from course_lib.model import GPT, MLP, Attention, GPTConfig, apply_rope, lm_loss, rope_cos_sin
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
from course_lib.train import TrainConfig, TrainResult, make_optimizer

Style = Literal["column", "row", "vocab", "attention", "mlp", "sequence"]
STYLES: tuple[Style, ...] = ("column", "row", "vocab", "attention", "mlp", "sequence")


class TPError(ValueError):
    """A shape that tensor parallelism of this degree cannot split (says what to change)."""


def _size_rank(group: comm.Group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _divide(n: int, t: int, what: str) -> int:
    if n % t:
        raise TPError(f"{what}={n} is not divisible by the tensor-parallel degree t={t}: choose t among the "
                      f"divisors of {n} ({', '.join(str(d) for d in range(1, n + 1) if n % d == 0)})")
    return n // t


def enter_tp_region(x: torch.Tensor, group: comm.Group, sequence_parallel: bool) -> torch.Tensor:
    """Before column-parallel work: f (identity / all-reduce backward), or under SP the all-gather of the
    sequence shards (reduce-scatter backward)."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group)
    return copy_to_tensor_parallel_region(x, group)


def leave_tp_region(x: torch.Tensor, group: comm.Group, sequence_parallel: bool) -> torch.Tensor:
    """After row-parallel work: g (all-reduce / identity backward), or under SP the reduce-scatter to sequence
    shards (all-gather backward)."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(x, group)
    return reduce_from_tensor_parallel_region(x, group)


class TensorParallelModule(nn.Module):
    """What every layer here declares about its parameters.

    ``sharded_dims``: local parameter name -> the dim along which it is split over the group (the rest are
    replicated). ``partial_grads``: replicated parameters whose gradient on each rank is only a partial sum.
    """

    sharded_dims: dict[str, int]
    partial_grads: set[str]

    def __init__(self, group: comm.Group, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.tp_size, self.tp_rank = _size_rank(group)
        self.sharded_dims, self.partial_grads = {}, set()

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into the TP region: f, or the SP all-gather (``enter_tp_region``). A public seam."""
        return enter_tp_region(x, self.group, self.sequence_parallel)

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        """Out of the TP region: g, or the SP reduce-scatter (``leave_tp_region``). A public seam."""
        return leave_tp_region(y, self.group, self.sequence_parallel)


def _slice_rows(weight: torch.Tensor, start: int, stop: int, dim: int = 0) -> nn.Parameter:
    return nn.Parameter(weight.detach().narrow(dim, start, stop - start).clone())


# ----------------------------------------------------------------------------------------------------------------
# Linear layers


class ColumnParallelLinear(TensorParallelModule):
    """``Y_i = X A_i``: this rank's ``out_features / t`` output features (rows of the [out, in] weight).

    ``enter_region``: apply f (or the SP all-gather) to the input; False when the caller already did (the
    q/k/v or gate/up projections share one). ``gather_output``: all-gather the output features (the full Y on
    every rank; off by default, a row-parallel layer or the vocab-parallel loss consumes the shards).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: comm.Group = None, *,
                 gather_output: bool = False, sequence_parallel: bool = False, enter_region: bool = True) -> None:
        super().__init__(group, sequence_parallel)
        self.out_features_full, self.in_features = weight.shape[0] * self.tp_size, weight.shape[1]
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.gather_output, self.enter_region = gather_output, enter_region
        self.sharded_dims = {"weight": 0} | ({"bias": 0} if bias is not None else {})

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: comm.Group = None, **kwargs: Any) -> ColumnParallelLinear:
        """Keep this rank's rows of ``linear``'s full weight (and bias): parity with ``linear`` by construction."""
        t, r = _size_rank(group)
        n = _divide(linear.out_features, t, "out_features")
        rows = (r * n, (r + 1) * n)
        bias = _slice_rows(linear.bias, *rows).data if linear.bias is not None else None
        return cls(_slice_rows(linear.weight, *rows).data, bias, group, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter_region:
            x = self.enter(x)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features_full}/{self.tp_size}, "
                f"sequence_parallel={self.sequence_parallel}, gather_output={self.gather_output}")


class RowParallelLinear(TensorParallelModule):
    """``Z = sum_i Y_i B_i``: this rank's ``in_features / t`` input features (columns of the [out, in] weight),
    then g (or the SP reduce-scatter). The bias is replicated and added once, after the reduction.

    ``input_is_parallel``: the input already holds this rank's features (the output of a column-parallel layer);
    False splits a replicated input first.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: comm.Group = None, *,
                 input_is_parallel: bool = True, sequence_parallel: bool = False) -> None:
        super().__init__(group, sequence_parallel)
        self.out_features, self.in_features_full = weight.shape[0], weight.shape[1] * self.tp_size
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.input_is_parallel = input_is_parallel
        self.sharded_dims = {"weight": 1}
        if bias is not None and sequence_parallel:
            self.partial_grads = {"bias"}  # added to this rank's sequence shard only

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: comm.Group = None, **kwargs: Any) -> RowParallelLinear:
        """Keep this rank's columns of ``linear``'s full weight; the bias stays whole."""
        t, r = _size_rank(group)
        n = _divide(linear.in_features, t, "in_features")
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(_slice_rows(linear.weight, r * n, (r + 1) * n, dim=1).data, bias, group, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        y = self.leave(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in={self.in_features_full}/{self.tp_size}, out={self.out_features}, " \
               f"sequence_parallel={self.sequence_parallel}"


# ----------------------------------------------------------------------------------------------------------------
# The MLP and attention


class TensorParallelMLP(TensorParallelModule):
    """The MLP column -> row: one f (or all-gather) in, one g (or reduce-scatter) out.

    GELU: ``fc2(gelu(fc1(x)))``; SwiGLU: ``fc2(silu(gate(x)) * fc1(x))``, gate and up split alike so the product
    stays local. Each rank holds d_ff/t hidden features.
    """

    def __init__(self, mlp: MLP, group: comm.Group = None, sequence_parallel: bool = False) -> None:
        super().__init__(group, sequence_parallel)
        _divide(mlp.fc1.out_features, self.tp_size, "d_ff")
        col = {"enter_region": False, "sequence_parallel": sequence_parallel}
        self.fc1 = ColumnParallelLinear.from_linear(mlp.fc1, group, **col)
        self.gate = ColumnParallelLinear.from_linear(mlp.gate, group, **col) if mlp.gate is not None else None
        self.fc2 = RowParallelLinear.from_linear(mlp.fc2, group, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.enter(x)
        if self.gate is not None:
            return self.fc2(F.silu(self.gate(x)) * self.fc1(x))
        return self.fc2(F.gelu(self.fc1(x)))


class TensorParallelAttention(TensorParallelModule):
    """Causal attention split by heads: n_head/t query heads per rank, each with the K/V head it reads.

    Query head j (global) reads K/V head ``kv_head_of(j) = j // (n_head / n_kv_head)`` (GQA, Ainslie et al. 2023;
    MHA when n_kv_head = n_head). When t divides n_kv_head the K/V projections are split by heads too (rank r
    holds K/V heads [r n_kv/t, (r+1) n_kv/t), exactly those its query heads read); otherwise they are replicated
    in full (vLLM does the same for serving) and each rank picks the heads it needs: their weight gradients are
    then partial sums, all-reduced over the group by ``TensorParallel.finish_gradient_sync``.
    """

    context: Any = None
    """A ``cp.CPContext`` when context parallelism is composed on top (``parallel.compose``): each rank then holds
    s/cp tokens, rotates them at their global positions and attends over the cp group, as Megatron's attention
    core takes a ``cp_group``. None: the whole sequence is local."""

    def __init__(self, attn: Attention, group: comm.Group = None, sequence_parallel: bool = False) -> None:
        super().__init__(group, sequence_parallel)
        t, r = self.tp_size, self.tp_rank
        self.n_head, self.n_kv_head, self.head_dim = attn.n_head, attn.n_kv_head, attn.head_dim
        self.local_heads = _divide(attn.n_head, t, "n_head")
        self.head_offset = r * self.local_heads
        self.kv_sharded = attn.n_kv_head % t == 0
        self.rope = attn.rope
        col = {"enter_region": False, "sequence_parallel": sequence_parallel}
        self.q_proj = ColumnParallelLinear.from_linear(attn.q_proj, group, **col)
        if self.kv_sharded:
            self.k_proj = ColumnParallelLinear.from_linear(attn.k_proj, group, **col)
            self.v_proj = ColumnParallelLinear.from_linear(attn.v_proj, group, **col)
            self.kv_offset = r * (attn.n_kv_head // t)
        else:
            self.k_proj, self.v_proj = _copy_linear(attn.k_proj), _copy_linear(attn.v_proj)
            self.kv_offset = 0
            self.partial_grads = {f"{p}.{n}" for p in ("k_proj", "v_proj") for n, _ in attn.k_proj.named_parameters()}
        self.o_proj = RowParallelLinear.from_linear(attn.o_proj, group, sequence_parallel=sequence_parallel)
        self.sharded_dims = {f"{m}.{n}": d for m in ("q_proj", "k_proj", "v_proj", "o_proj")
                             for n, d in getattr(getattr(self, m), "sharded_dims", {}).items()}

    def kv_head_of(self, q_head: torch.Tensor) -> torch.Tensor:
        """The (global) K/V head each (global) query head reads: q // (n_head / n_kv_head). A public seam."""
        return q_head // (self.n_head // self.n_kv_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.enter(x)
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, n_head/t, T, d]
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, local K/V heads, T, d]
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.rope:
            q, k = self.rotary(q, k)
        q_heads = torch.arange(self.head_offset, self.head_offset + self.local_heads, device=x.device)
        kv_local = self.kv_head_of(q_heads) - self.kv_offset
        if not bool(((kv_local >= 0) & (kv_local < k.shape[1])).all()):
            raise RuntimeError(f"query heads {q_heads.tolist()} read K/V heads {(kv_local + self.kv_offset).tolist()},"
                               f" but this rank holds K/V heads {self.kv_offset}..{self.kv_offset + k.shape[1] - 1}")
        held = k.shape[1]
        rep = self.local_heads // held if self.local_heads % held == 0 else 0
        if rep and torch.equal(kv_local, torch.arange(held, device=x.device).repeat_interleave(rep)):
            if rep > 1:  # the single-process model's contiguous GQA map (MHA: nothing to do)
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        else:  # replicated K/V (or another map): pick each query head's K/V head
            k, v = k.index_select(1, kv_local), v.index_select(1, kv_local)
        y = self.attend(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def rotary(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE at positions 0..T-1, or at the tokens' global positions when ``context`` is set. A seam."""
        positions = None if self.context is None else self.context.local_positions()
        cos, sin = rope_cos_sin(q.shape[2], self.head_dim, device=q.device, positions=positions)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's heads [B, heads/t, T, d]: over the local sequence, or, when
        ``context`` is set, over the whole sequence held by the context-parallel group (its ring). A seam."""
        if self.context is not None:
            return self.context.attend(q.contiguous(), k.contiguous(), v.contiguous())
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _copy_linear(linear: nn.Linear) -> nn.Linear:
    out = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype)
    out.load_state_dict(linear.state_dict())
    return out


# ----------------------------------------------------------------------------------------------------------------
# Embedding and loss


class VocabParallelEmbedding(TensorParallelModule):
    """Rows ``[r V/t, (r+1) V/t)`` of the embedding table; ids outside the shard look up zeros, then g adds the
    shards (each id lives in exactly one) -- or, under SP, a reduce-scatter leaves each rank its s/t tokens."""

    def __init__(self, emb: nn.Embedding, group: comm.Group = None, sequence_parallel: bool = False) -> None:
        super().__init__(group, sequence_parallel)
        n = _divide(emb.num_embeddings, self.tp_size, "vocab_size")
        self.vocab_start, self.vocab_end = self.tp_rank * n, (self.tp_rank + 1) * n
        self.num_embeddings = emb.num_embeddings
        self.weight = _slice_rows(emb.weight, self.vocab_start, self.vocab_end)
        self.sharded_dims = {"weight": 0}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.leave(out)


class SequenceParallelPositionEmbedding(TensorParallelModule):
    """Learned positions under SP: the full (replicated) table, but each rank adds the rows of its own s/t
    positions, so the weight's gradient is a partial sum (all-reduced by the wrapper)."""

    def __init__(self, emb: nn.Embedding, group: comm.Group = None) -> None:
        super().__init__(group)
        self.weight = nn.Parameter(emb.weight.detach().clone())
        self.partial_grads = {"weight"}

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(split_along(positions, 0, self.group), self.weight)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token ``log sum_v exp(z_v) - z_target`` from vocab shards ``z`` [N, V/t]; three all-reduces of N fp32."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                group: comm.Group) -> torch.Tensor:
        z = logits.float()
        zmax = z.max(dim=-1).values
        comm.all_reduce(zmax, op=comm.ReduceOp.MAX, group=group)  # 1: global max, for stability
        z = z - zmax.unsqueeze(-1)
        local = target - vocab_start
        mine = (local >= 0) & (local < z.shape[-1])
        local = local.masked_fill(~mine, 0)
        target_logit = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        comm.all_reduce(target_logit, group=group)  # 2: the target's logit, from the rank that holds it
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, group=group)  # 3: the softmax denominator
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, mine)
        ctx.in_dtype = logits.dtype
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, mine = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))  # softmax - one_hot(target)
        return (g * grad.unsqueeze(-1)).to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: comm.Group = None,
                                 reduction: Literal["mean", "none"] = "mean") -> torch.Tensor:
    """Cross-entropy from this rank's vocabulary shard of the logits [..., V/t], never gathering them.

    With z the logits, m = max_v z_v (all-reduce MAX), the loss of a token is
    ``log sum_v exp(z_v - m) - (z_target - m)``: the target logit comes from the one rank whose shard holds it
    (all-reduce SUM of zeros elsewhere) and the sum of exponentials is summed over the shards (all-reduce SUM):
    3 all-reduces of b*s fp32 scalars instead of an all-gather of b*s*V logits. The gradient of each shard is
    ``softmax(z) - one_hot(target)`` restricted to the shard: no communication in backward.
    (Megatron-LM's ``vocab_parallel_cross_entropy``; DTensor's ``loss_parallel``.)
    """
    r = dist.get_rank(group)
    v_local = logits.shape[-1]
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets of shape {tuple(targets.shape)} do not match logits {tuple(logits.shape)} "
                         f"(expected {tuple(logits.shape[:-1])})")
    per_token = _VocabParallelCrossEntropy.apply(logits.reshape(-1, v_local), targets.reshape(-1), r * v_local,
                                                 group)
    if reduction == "none":
        return per_token.view(targets.shape)
    return per_token.mean()


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


def _resolve_group(mesh: Any, group: comm.Group, axis: str = "tp") -> comm.Group:
    if mesh is not None and group is not None:
        raise ValueError("pass either mesh= or group=, not both")
    return mesh.group(axis) if mesh is not None else group


class TensorParallel(nn.Module):
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

    Training step: ``loss.backward()``, ``finish_gradient_sync()`` (all-reduce of the partial gradients), optional
    ``clip_grad_norm_``, ``optimizer.step()``, ``after_step()``.

    Seams: the layer classes each style builds (``column_class`` ... ``mlp_class``), ``parallelize_submodule``,
    ``finish_gradient_sync``, ``loss`` and ``is_sharded``; a subclass overrides one to make a variant.
    """

    column_class: type[ColumnParallelLinear] = ColumnParallelLinear
    row_class: type[RowParallelLinear] = RowParallelLinear
    vocab_class: type[VocabParallelEmbedding] = VocabParallelEmbedding
    attention_class: type[TensorParallelAttention] = TensorParallelAttention
    mlp_class: type[TensorParallelMLP] = TensorParallelMLP

    def __init__(self, module: nn.Module, *, mesh: Any = None, group: comm.Group = None,
                 plan: Mapping[str, Style] | None = None, sequence_parallel: bool = False,
                 broadcast: bool = True) -> None:
        super().__init__()
        self.group = _resolve_group(mesh, group)
        self.tp_size, self.tp_rank = _size_rank(self.group)
        self.sequence_parallel = sequence_parallel
        if plan is None:
            if not isinstance(module, GPT):
                raise ValueError("plan= is required for modules other than course_lib.model.GPT")
            plan = gpt_plan(module.config)
        self.plan = dict(plan)
        if broadcast:
            src = dist.get_process_group_ranks(self.group)[0] if self.group is not None else 0
            with torch.no_grad():
                for p in module.parameters():
                    comm.broadcast(p.detach(), src, group=self.group)
        self._apply_plan(module)
        self.module = module
        self._sharded: dict[int, int] = {}  # id(param) -> shard dim
        self._partial: list[nn.Parameter] = []
        for name, p in module.named_parameters():
            owner, local = self._owner(name)
            if local in getattr(owner, "sharded_dims", {}):
                self._sharded[id(p)] = owner.sharded_dims[local]
            if local in getattr(owner, "partial_grads", ()) and p.requires_grad:
                self._partial.append(p)

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
        m.sharded_dims, m.partial_grads = {}, {n for n, _ in m.named_parameters()}
        return None

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        """The nearest enclosing module that declares its parameters (``sharded_dims``), and the parameter's
        name inside it; the direct parent when none does (a plain replicated parameter)."""
        parts = name.split(".")
        for cut in range(len(parts) - 1, -1, -1):
            owner = self.module.get_submodule(".".join(parts[:cut]))
            if hasattr(owner, "sharded_dims"):
                return owner, ".".join(parts[cut:])
        return self.module.get_submodule(".".join(parts[:-1])), parts[-1]

    # -- the wrapper contract -------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean vocab-parallel cross-entropy of the vocab-sharded logits (the same value on every rank)."""
        return vocab_parallel_cross_entropy(logits, targets, self.group)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: nothing to defer. TP's forward/backward collectives are part of the layer's
        math and cannot be skipped; the only gradient sync (the partial sums) already waits for
        ``finish_gradient_sync`` after the last micro-batch, and summing before or after accumulating is equal."""
        yield

    def finish_gradient_sync(self) -> None:
        """All-reduce (sum) the gradients that are partial sums on each rank -- replicated parameters used on a
        sequence shard under SP, replicated GQA K/V -- in one flat buffer. Call after the last backward."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._partial]
        if not grads:
            return
        flat = torch.cat([g_.reshape(-1) for g_ in grads])
        comm.all_reduce(flat, group=self.group)
        for p, chunk in zip(self._partial, flat.split([g_.numel() for g_ in grads]), strict=True):
            p.grad = chunk.view_as(p).clone()

    def after_step(self) -> None:
        """Nothing to do after ``optimizer.step()``: every rank updated exactly its own shards."""

    def remove_hooks(self) -> None:
        """TP installs no hooks (its communication lives in autograd Functions): nothing to remove."""

    @property
    def partial_grad_parameters(self) -> list[nn.Parameter]:
        return list(self._partial)

    def is_sharded(self, p: nn.Parameter) -> bool:
        """True when each rank holds a different slice of ``p`` (a public seam of the gradient norm)."""
        return id(p) in self._sharded

    def shard_dim(self, p: nn.Parameter) -> int | None:
        """The dimension along which ``p`` is cut into tp equal contiguous slices (rank r holds slice r), or
        None for a replicated parameter: how to gather it, or its optimizer state, and cut it again."""
        return self._sharded.get(id(p))

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients: sum of squares of every *shard* (all-reduced, one fp32 scalar) plus
        the replicated parameters' squares counted once (they are equal on every rank after the sync)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        if not params:
            return torch.zeros(())
        sq_sharded = torch.zeros((), dtype=torch.float32, device=params[0].device)
        sq_replicated = torch.zeros((), dtype=torch.float32, device=params[0].device)
        for p in params:
            sq = p.grad.detach().float().pow(2).sum()
            if self.is_sharded(p):
                sq_sharded += sq
            else:
                sq_replicated += sq
        comm.all_reduce(sq_sharded, group=self.group)
        return (sq_sharded + sq_replicated).sqrt()

    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for the sharded model: scale every gradient by
        min(1, max_norm / (norm + eps)). Returns the norm before clipping."""
        norm = self.grad_norm()
        coef = torch.clamp(max_norm / (norm + eps), max=1.0)
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
        return norm

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by the single-process model's names (one all-gather per sharded parameter)."""
        out = {}
        for name, p in self.module.named_parameters():
            t = p.detach().float()
            dim = self._sharded.get(id(p))
            out[name] = (all_gather_along(t, dim, self.group) if dim is not None else t).clone()
        return out


# ----------------------------------------------------------------------------------------------------------------
# Communication on paper


@dataclass(frozen=True)
class PlannedCollective:
    """One collective a TP step issues: ``op``, its ``tensor_bytes`` (``comm``'s V: the all-reduced tensor, the
    gathered output, the reduce-scatter input), the ``phase`` and the layer that issues it."""

    op: str
    tensor_bytes: int
    phase: Literal["forward", "backward", "sync"]
    where: str


def step_collectives(cfg: GPTConfig, batch: int, t: int, sequence_parallel: bool = False,
                     element_bytes: int = 4) -> list[PlannedCollective]:
    """Every collective of one training step of the GPT under ``TensorParallel`` with ``gpt_plan``, in call order.

    With V = batch * seq_len * d_model * element_bytes:

    * forward: the embedding's g (all-reduce V; SP: reduce-scatter V); per block attention and MLP each an
      all-reduce of V (SP: all-gather V in, reduce-scatter V out); the LM head's f (nothing; SP: all-gather V);
      the loss's 3 all-reduces of batch * seq_len fp32 scalars (max, target logit, sum of exponentials);
    * backward, in reverse: LM head all-reduce V (SP: reduce-scatter), per block MLP then attention: an
      all-reduce of V each (SP: all-gather then reduce-scatter), the embedding nothing (SP: all-gather V);
    * sync: one all-reduce of every partial gradient (under SP the norms, learned positions and row biases;
      replicated GQA K/V when t does not divide n_kv_head), when there is any.
    """
    n_tok = batch * cfg.seq_len
    v = n_tok * cfg.d_model * element_bytes
    sp = sequence_parallel
    enter, leave = ("all_gather", "reduce_scatter") if sp else (None, "all_reduce")
    enter_back, leave_back = ("reduce_scatter", "all_gather") if sp else ("all_reduce", None)
    out: list[PlannedCollective] = []

    def add(op: str | None, nbytes: int, phase: Literal["forward", "backward", "sync"], where: str) -> None:
        if op is not None and t > 1:
            out.append(PlannedCollective(op, nbytes, phase, where))

    add(leave, v, "forward", "tok_emb")
    for i in range(cfg.n_layer):
        for part in ("attn", "mlp"):
            add(enter, v, "forward", f"blocks.{i}.{part}")
            add(leave, v, "forward", f"blocks.{i}.{part}")
    add(enter, v, "forward", "lm_head")
    for _ in range(3):
        add("all_reduce", n_tok * 4, "forward", "loss")
    add(enter_back, v, "backward", "lm_head")
    for i in reversed(range(cfg.n_layer)):
        for part in ("mlp", "attn"):
            add(leave_back, v, "backward", f"blocks.{i}.{part}")
            add(enter_back, v, "backward", f"blocks.{i}.{part}")
    add(leave_back, v, "backward", "tok_emb")
    h, hkv = cfg.d_model, cfg.kv_heads * cfg.head_dim
    partial = 0
    if sp:
        norm = 2 * h if cfg.norm == "layernorm" else h
        partial += (2 * cfg.n_layer + 1) * norm + (cfg.seq_len * h if cfg.pos == "learned" else 0)
        partial += 2 * cfg.n_layer * h if cfg.bias else 0  # o_proj and fc2 biases
    if cfg.kv_heads % t:
        partial += cfg.n_layer * 2 * (h * hkv + (hkv if cfg.bias else 0))
    if partial:
        add("all_reduce", partial * element_bytes, "sync", "partial gradients")
    return out


def block_bytes_per_rank(batch: int, seq_len: int, d_model: int, t: int, element_bytes: int = 2) -> float:
    """Bytes one rank sends per transformer block and training step, TP or TP+SP (the same): 4 collectives of
    V = b*s*h*e -- 4 ring all-reduces 2(t-1)/t V, or 4 all-gathers + 4 reduce-scatters (t-1)/t V."""
    return 4 * 2 * (t - 1) / t * batch * seq_len * d_model * element_bytes


def layer_activation_bytes_tp(cfg: GPTConfig, micro_batch: int, t: int, sequence_parallel: bool = False,
                              element_bytes: int = 4) -> float:
    """Activation bytes one transformer block of *this* implementation saves for backward, per rank.

    ``course_lib.memory.layer_activation_bytes(formula="adapted", tp=t, sp=...)`` (what the course's eager block
    saves, Korthikanti et al.'s accounting with the /t parts split), plus, under SP, the all-gathered inputs of
    the attention and MLP regions: the column-parallel linears save the gathered [b, s, h] input, not the shard,
    2 e s b h (1 - 1/t) more. Megatron-LM saves the shard instead and all-gathers it again in backward (one more
    all-gather per region) to reach the paper's (sbh/t)(34 + 5as/h). Checked against ``MemoryTracker``.
    """
    from course_lib.memory import layer_activation_bytes

    base = layer_activation_bytes(cfg, micro_batch, cfg.seq_len, tp=t, sp=sequence_parallel, formula="adapted",
                                  element_bytes=element_bytes)
    if not sequence_parallel:
        return base
    return base + 2 * element_bytes * micro_batch * cfg.seq_len * cfg.d_model * (1 - 1 / t)


# ----------------------------------------------------------------------------------------------------------------
# The training helper


@dataclass
class TPResult(TrainResult):
    """``TrainResult`` plus this rank's communication records of each step (forward, backward, sync)."""

    step_comm: list[list[comm.CommRecord]] = field(default_factory=list, repr=False)
    grad_norms: list[float] = field(default_factory=list)


def train_tp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None, *, mesh: Any = None,
             group: comm.Group = None, sequence_parallel: bool = False,
             model_fn: Callable[[GPTConfig, int], nn.Module] | None = None, plan: Mapping[str, Style] | None = None,
             clip_grad_norm: float | None = None, tp_class: type[TensorParallel] = TensorParallel) -> TPResult:
    """Train the GPT with tensor (and optionally sequence) parallelism: a ``launch`` target.

    Every rank of the TP group sees the whole global batch (TP splits the layers, not the data). The loss is the
    vocab-parallel cross-entropy, the same on every rank. Returns per-step losses, the full parameters (gathered)
    and the communication records of each step. ``tp_class`` lets a test or notebook swap in a variant.
    """
    tc = tc or TrainConfig()
    dev = device()
    model = (model_fn or GPT)(cfg, tc.seed).to(dev)
    tp = tp_class(model, mesh=mesh, group=group, plan=plan, sequence_parallel=sequence_parallel)
    opt = make_optimizer([p for p in tp.parameters() if p.requires_grad], tc)
    losses, step_comm, norms = [], [], []
    for step in range(tc.steps):
        x, y = (t.to(dev) for t in global_batch(step, tc.global_batch, cfg.seq_len, tc.seed))
        opt.zero_grad(set_to_none=True)
        with comm.recording() as log:
            loss = tp.loss(tp(x), y)
            loss.backward()
            tp.finish_gradient_sync()
            if clip_grad_norm is not None:
                norms.append(float(tp.clip_grad_norm_(clip_grad_norm)))
        opt.step()
        tp.after_step()
        losses.append(loss.item())
        step_comm.append(list(log.records))
    return TPResult(losses, tp.full_parameters(), step_comm, norms)



# ----------------------------------------------------------------------------------------------------------------
# PyTorch's own: DTensor ``parallelize_module`` (the second oracle)


def dtensor_plan(cfg: GPTConfig, sequence_parallel: bool = False) -> dict[str, Any]:
    """The same plan in DTensor's styles (torchtitan's Llama plan, adapted to the course's GPT).

    ``PrepareModuleInput`` on the attention and MLP modules turns their input into one replicated DTensor that the
    q/k/v (gate/up) projections share: one f (SP: one all-gather) per region, as ours. Without it each
    ``ColwiseParallel`` linear converts its own plain input and backward all-reduces once per linear (3 + 1 per
    GELU block instead of 2). Learned positions cannot be added to a sequence-sharded embedding output here (a
    plain [T, h] table and a [B, T/t, h] shard), so SP needs ``pos="rope"``, as in torchtitan's models.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if sequence_parallel and cfg.pos == "learned":
        raise ValueError("the DTensor plan with sequence parallelism needs pos='rope' (see dtensor_plan)")
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "blocks.*.attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "blocks.*.attn.q_proj": ColwiseParallel(),
        "blocks.*.attn.k_proj": ColwiseParallel(),
        "blocks.*.attn.v_proj": ColwiseParallel(),
        "blocks.*.attn.o_proj": RowwiseParallel(output_layouts=seq),
        "blocks.*.mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "blocks.*.mlp.fc1": ColwiseParallel(),
        "blocks.*.mlp.fc2": RowwiseParallel(output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if cfg.mlp == "swiglu":
        plan["blocks.*.mlp.gate"] = ColwiseParallel()
    if sequence_parallel:
        plan |= {"blocks.*.norm1": SequenceParallel(), "blocks.*.norm2": SequenceParallel(),
                 "norm_f": SequenceParallel()}
    return plan


_DTENSOR_OPS = {"all_reduce": "all_reduce", "allreduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
                "_allgather_base_": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
                "_reduce_scatter_base_": "reduce_scatter"}


class DTensorCommLog:
    """Log the collectives DTensor issues, as ``comm.CommRecord``s (tensor_bytes by ``comm``'s convention: the
    gathered output of an all-gather, the input of a reduce-scatter; ring bytes per rank; no timings).

    A ``TorchDispatchMode`` sees each ``_c10d_functional`` / ``c10d`` op. Like DTensor's own ``CommDebugMode`` it
    returns ``NotImplemented`` for ops on DTensors, so that DTensor first lowers them to local ops and
    collectives, which the mode then sees (the vocab-parallel loss's all-reduces happen there).
    """

    def __init__(self, group_size: int, rank: int) -> None:
        self.group_size, self.rank = group_size, rank
        self.records: list[comm.CommRecord] = []

    def __enter__(self) -> DTensorCommLog:
        from torch.distributed.tensor import DTensor
        from torch.utils._python_dispatch import TorchDispatchMode

        log = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if any(issubclass(t, DTensor) for t in types):
                    return NotImplemented
                out = func(*args, **(kwargs or {}))
                name = func.__name__.split(".")[0]
                if "c10d" in func.namespace and name in _DTENSOR_OPS:
                    log._add(_DTENSOR_OPS[name], args[0][0] if isinstance(args[0], (list, tuple)) else args[0])
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)

    def _add(self, op: str, t: torch.Tensor) -> None:
        n = self.group_size
        numel = t.numel() * (n if op == "all_gather" else 1)
        sent, recv = comm.ring_bytes(op, numel, t.element_size(), n, self.rank)
        self.records.append(comm.CommRecord(op, "dtensor", n, numel * t.element_size(), sent, recv, None))


def train_dtensor_tp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None, *,
                     sequence_parallel: bool = False, group: comm.Group = None) -> TPResult:
    """The same training loop with DTensor's ``parallelize_module`` and ``loss_parallel`` (PyTorch's production
    API; runs on gloo CPU). ``step_comm`` holds the collectives DTensor issued each step (``DTensorCommLog``),
    the optimizer step included (DTensor all-reduces the norms' partial gradients there, parameter by parameter)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    tc = tc or TrainConfig()
    dev = device()
    t, r = _size_rank(group)
    if cfg.kv_heads % t:
        raise ValueError(f"DTensor's ColwiseParallel splits k_proj's {cfg.kv_heads} K/V heads evenly: t={t} must "
                         f"divide n_kv_head")
    mesh = init_device_mesh(dev.type, (t,)) if group is None else DeviceMesh.from_group(group, dev.type)
    model = GPT(cfg, tc.seed).to(dev)
    parallelize_module(model, mesh, dtensor_plan(cfg, sequence_parallel))
    opt = make_optimizer(list(model.parameters()), tc)
    losses, step_comm = [], []
    for step in range(tc.steps):
        x, y = (a.to(dev) for a in global_batch(step, tc.global_batch, cfg.seq_len, tc.seed))
        opt.zero_grad(set_to_none=True)
        with DTensorCommLog(t, r) as log:
            with loss_parallel():
                loss = lm_loss(model(x), y)
                loss.backward()
            opt.step()
        losses.append(loss.item())
        step_comm.append(log.records)
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
              for n, p in model.named_parameters()}
    return TPResult(losses, params, step_comm)
