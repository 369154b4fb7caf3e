"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019, section 3), each built from an existing
module by slicing its weights, so parity with that module holds by construction:

* ``ColumnParallelLinear``: ``Y_i = X A_i``, the output features split (rows of ``nn.Linear``'s
  weight);
* ``RowParallelLinear``: ``Z = sum_i Y_i B_i``, the input features split, then g (all-reduce);
* ``TensorParallelMLP``: column then row, one f in and one g out (GELU or SwiGLU);
* ``TensorParallelAttention``: split by heads (GQA's K/V split by heads when t divides n_kv_head,
  else replicated, each rank reading the heads its query heads use);
* ``VocabParallelEmbedding`` and ``vocab_parallel_cross_entropy``: the vocabulary split, the loss
  from the logit shards (3 all-reduces of b*s scalars, never the b*s*V logits);
* ``SequenceParallelPositionEmbedding``: learned positions under sequence parallelism.

Each layer records the placement of its parameters on "tp" (``Shard(0)`` column and vocabulary
slices, ``Shard(1)`` row slices, ``Partial()`` replicated weights whose gradient is this rank's
share), as DTensor's ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` would. f and g
are ``tp_comm``'s.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib import comm
from course_lib.layers import MLP, Attention, apply_rope, rope_cos_sin
from course_lib.parallel.placement import Partial, Placement, Replicate, Shard, set_placement
from course_lib.parallel.tp_comm import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
    sequence_parallel_linears,
    split_along,
)

__all__ = [
    "TP_AXIS",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "SequenceParallelPositionEmbedding",
    "TPError",
    "TensorParallelAttention",
    "TensorParallelMLP",
    "TensorParallelModule",
    "VocabParallelEmbedding",
    "enter_tp_region",
    "leave_tp_region",
    "vocab_parallel_cross_entropy",
]


TP_AXIS = "tp"
"""The mesh axis every tensor-parallel layer records its placements on."""


def place(module: nn.Module, where: Placement) -> None:
    """Record ``where`` on ``"tp"`` for every parameter of ``module`` (a replicated or partial
    sub-layer)."""
    for p in module.parameters():
        set_placement(p, TP_AXIS, where)


class TPError(ValueError):
    """A shape that tensor parallelism of this degree cannot split (says what to change)."""


def _size_rank(group: comm.Group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _divide(n: int, t: int, what: str, fix: str = "") -> int:
    if n % t:
        divisors = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
        raise TPError(f"{what}={n} is not divisible by the tensor-parallel degree t={t}: choose t "
                      f"among the divisors of {n} ({divisors}){fix}")
    return n // t


def enter_tp_region(x: torch.Tensor, group: comm.Group, sequence_parallel: bool) -> torch.Tensor:
    """Before column-parallel work: f (identity / all-reduce backward), or under SP the all-gather
    of the sequence shards (reduce-scatter backward)."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group)
    return copy_to_tensor_parallel_region(x, group)


def leave_tp_region(x: torch.Tensor, group: comm.Group, sequence_parallel: bool) -> torch.Tensor:
    """After row-parallel work: g (all-reduce / identity backward), or under SP the reduce-scatter
    to sequence shards (all-gather backward)."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(x, group)
    return reduce_from_tensor_parallel_region(x, group)


class TensorParallelModule(nn.Module):
    """The base of every layer here: its group, its degree and rank, f and g. Each layer records the
    ``"tp"`` placement of every parameter it holds (see the module docstring)."""

    sp_matmul: Any = None
    """Under SP, the function that runs the column-parallel GEMMs on the sequence shard (None:
    Megatron-LM's ``tp_comm.sequence_parallel_linears``; ``tp_overlap.collective_matmul`` overlaps
    the all-gather's ring steps with partial GEMMs, set by ``tp.apply_tp(sp_matmul=...)``); the
    numbers are the same."""

    def __init__(self, group: comm.Group, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.tp_size, self.tp_rank = _size_rank(group)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into the TP region: f, or the SP all-gather (``enter_tp_region``). A public seam."""
        return enter_tp_region(x, self.group, self.sequence_parallel)

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        """Out of the TP region: g, or the SP reduce-scatter (``leave_tp_region``). A public
        seam."""
        return leave_tp_region(y, self.group, self.sequence_parallel)

    def project(self, x: torch.Tensor, linears: list[nn.Module]) -> tuple[torch.Tensor, ...]:
        """Into the TP region and through the column-parallel ``linears`` that read its input
        (q/k/v, gate/up).

        Without SP: f, then each linear. Under SP, Megatron-LM's form
        (``tp_comm.sequence_parallel_linears``): one all-gather of the s/t shard feeds all of them,
        and only the shard is saved for backward, which all-gathers it again for the weight
        gradients (or ``sp_matmul``)."""
        if self.sequence_parallel:
            pairs = [(m.weight, m.bias) for m in linears]
            return (self.sp_matmul or sequence_parallel_linears)(x, pairs, self.group)
        x = self.enter(x)
        return tuple(F.linear(x, m.weight, m.bias) for m in linears)


def _slice_rows(weight: torch.Tensor, start: int, stop: int, dim: int = 0) -> nn.Parameter:
    return nn.Parameter(weight.detach().narrow(dim, start, stop - start).clone())


# --------------------------------------------------------------------------------------------------
# Linear layers


class ColumnParallelLinear(TensorParallelModule):
    """``Y_i = X A_i``: this rank's ``out_features / t`` output features (rows of the [out, in]
    weight).

    ``enter_region``: apply f (or the SP all-gather) to the input; False when the caller already did
    (the q/k/v or gate/up projections share one). ``gather_output``: all-gather the output features
    (the full Y on every rank; off by default, a row-parallel layer or the vocab-parallel loss
    consumes the shards).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: comm.Group = None, *,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 enter_region: bool = True) -> None:
        super().__init__(group, sequence_parallel)
        self.out_features_full, self.in_features = weight.shape[0] * self.tp_size, weight.shape[1]
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.gather_output, self.enter_region = gather_output, enter_region
        self.output_start = self.tp_rank * weight.shape[0]  # the first (global) output feature here
        place(self, Shard(0))  # this rank's output features: the weight's rows, the bias' entries

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: comm.Group = None,
                    **kwargs: Any) -> ColumnParallelLinear:
        """Keep this rank's rows of ``linear``'s full weight (and bias): parity with ``linear`` by
        construction."""
        t, r = _size_rank(group)
        n = _divide(linear.out_features, t, "out_features")
        rows = (r * n, (r + 1) * n)
        bias = _slice_rows(linear.bias, *rows).data if linear.bias is not None else None
        out = cls(_slice_rows(linear.weight, *rows).data, bias, group, **kwargs)
        if hasattr(linear, "vocab_size"):  # an LM head, padded vocabulary (GPT.head masks it)
            out.vocab_size = linear.vocab_size
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x, [self])[0] if self.enter_region else F.linear(x, self.weight, self.bias)
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features_full}/{self.tp_size}, "
                f"sequence_parallel={self.sequence_parallel}, gather_output={self.gather_output}")


class RowParallelLinear(TensorParallelModule):
    """``Z = sum_i Y_i B_i``: this rank's ``in_features / t`` input features (columns of the [out,
    in] weight), then g (or the SP reduce-scatter). The bias is replicated and added once, after the
    reduction.

    ``input_is_parallel``: the input already holds this rank's features (the output of a
    column-parallel layer); False splits a replicated input first.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: comm.Group = None, *,
                 input_is_parallel: bool = True, sequence_parallel: bool = False) -> None:
        super().__init__(group, sequence_parallel)
        self.out_features, self.in_features_full = weight.shape[0], weight.shape[1] * self.tp_size
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None
        self.input_is_parallel = input_is_parallel
        set_placement(self.weight, TP_AXIS, Shard(1))  # this rank's input features: weight columns
        if self.bias is not None:  # added after g, or under SP to this rank's tokens only
            set_placement(self.bias, TP_AXIS, Partial() if sequence_parallel else Replicate())

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: comm.Group = None,
                    **kwargs: Any) -> RowParallelLinear:
        """Keep this rank's columns of ``linear``'s full weight; the bias stays whole."""
        t, r = _size_rank(group)
        n = _divide(linear.in_features, t, "in_features")
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        weight = _slice_rows(linear.weight, r * n, (r + 1) * n, dim=1).data
        return cls(weight, bias, group, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        y = self.leave(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in={self.in_features_full}/{self.tp_size}, out={self.out_features}, " \
               f"sequence_parallel={self.sequence_parallel}"


# --------------------------------------------------------------------------------------------------
# The MLP and attention


class TensorParallelMLP(TensorParallelModule):
    """The MLP column -> row: one f (or all-gather) in, one g (or reduce-scatter) out.

    GELU: ``fc2(gelu(fc1(x)))``; SwiGLU: ``fc2(silu(gate(x)) * fc1(x))``, gate and up split alike so
    the product stays local. Each rank holds d_ff/t hidden features.
    """

    def __init__(self, mlp: MLP, group: comm.Group = None, sequence_parallel: bool = False) -> None:
        super().__init__(group, sequence_parallel)
        _divide(mlp.fc1.out_features, self.tp_size, "d_ff")
        col = {"enter_region": False, "sequence_parallel": sequence_parallel}
        self.fc1 = ColumnParallelLinear.from_linear(mlp.fc1, group, **col)
        self.gate = (ColumnParallelLinear.from_linear(mlp.gate, group, **col)
                     if mlp.gate is not None else None)
        self.fc2 = RowParallelLinear.from_linear(mlp.fc2, group,
                                                 sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            gate, up = self.project(x, [self.gate, self.fc1])
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(self.project(x, [self.fc1])[0]))


class TensorParallelAttention(TensorParallelModule):
    """Causal attention split by heads: n_head/t query heads per rank, each with the K/V head it
    reads.

    Query head j (global) reads K/V head ``kv_head_of(j) = j // (n_head / n_kv_head)`` (GQA, Ainslie
    et al. 2023; MHA when n_kv_head = n_head). When t divides n_kv_head the K/V projections are
    split by heads too (rank r holds K/V heads [r n_kv/t, (r+1) n_kv/t), exactly those its query
    heads read); otherwise they are replicated in full and each rank picks the heads it needs:
    their weight gradients are then partial sums (recorded ``Partial()``), summed over all of tp by
    data parallelism. vLLM's ``QKVParallelLinear`` keeps only the K/V head a rank's query heads
    read instead (chapter 04's exercise 3); Megatron-Core requires t to divide n_kv_head.
    """

    context: Any = None
    """A ``cp.CPContext`` when context parallelism is composed on top (``parallel.compose``): each
    rank then holds s/cp tokens, rotates them at their global positions and attends over the cp
    group, as Megatron's attention core takes a ``cp_group``. None: the whole sequence is local."""

    def __init__(self, attn: Attention, group: comm.Group = None,
                 sequence_parallel: bool = False) -> None:
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
            place(self.k_proj, Partial())  # each rank reads only the K/V heads its query heads use
            place(self.v_proj, Partial())
        self.o_proj = RowParallelLinear.from_linear(attn.o_proj, group,
                                                    sequence_parallel=sequence_parallel)

    def kv_head_of(self, q_head: torch.Tensor) -> torch.Tensor:
        """The (global) K/V head each (global) query head reads: q // (n_head / n_kv_head). A public
        seam."""
        return q_head // (self.n_head // self.n_kv_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x, [self.q_proj, self.k_proj, self.v_proj])
        B, T, _ = q.shape
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, n_head/t, T, d]
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, local K/V heads, T, d]
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.rope:
            q, k = self.rotary(q, k)
        first, held = self.head_offset, k.shape[1]
        q_heads = torch.arange(first, first + self.local_heads, device=x.device)
        kv_local = self.kv_head_of(q_heads) - self.kv_offset
        if not bool(((kv_local >= 0) & (kv_local < held)).all()):
            raise RuntimeError(f"query heads {q_heads.tolist()} read K/V heads "
                               f"{(kv_local + self.kv_offset).tolist()}, but this rank holds K/V "
                               f"heads {self.kv_offset}..{self.kv_offset + held - 1}")
        used = torch.unique(kv_local)  # sorted: the K/V heads this rank's query heads read
        rep = self.local_heads // used.numel()
        if torch.equal(kv_local, used.repeat_interleave(rep)):  # contiguous GQA: each head rep x
            if used.numel() < k.shape[1]:  # replicated K/V: keep the heads this rank reads
                k, v = k.index_select(1, used), v.index_select(1, used)
            if rep > 1 and self.context is None:  # the ring expands per block (sends K/V heads)
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        else:  # another map: pick each query head's K/V head
            k, v = k.index_select(1, kv_local), v.index_select(1, kv_local)
        y = self.attend(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def rotary(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE at positions 0..T-1, or at the tokens' global positions when ``context`` is set. A
        seam."""
        positions = None if self.context is None else self.context.local_positions()
        cos, sin = rope_cos_sin(q.shape[2], self.head_dim, device=q.device, positions=positions)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's heads [B, heads/t, T, d]: over the local sequence, or,
        when ``context`` is set, over the whole sequence held by the context-parallel group (its
        ring). A seam."""
        if self.context is not None:
            return self.context.attend(q.contiguous(), k.contiguous(), v.contiguous())
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _copy_linear(linear: nn.Linear) -> nn.Linear:
    out = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype)
    out.load_state_dict(linear.state_dict())
    return out


# --------------------------------------------------------------------------------------------------
# Embedding and loss


class VocabParallelEmbedding(TensorParallelModule):
    """Rows ``[r V/t, (r+1) V/t)`` of the embedding table; ids outside the shard look up zeros, then
    g adds the shards (each id lives in exactly one) -- or, under SP, a reduce-scatter leaves each
    rank its s/t tokens."""

    def __init__(self, emb: nn.Embedding, group: comm.Group = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__(group, sequence_parallel)
        n = _divide(emb.num_embeddings, self.tp_size, "vocab_size", ", or pad the vocabulary: "
                    f"GPTConfig(make_vocab_size_divisible_by=k*{self.tp_size})")
        self.vocab_start, self.vocab_end = self.tp_rank * n, (self.tp_rank + 1) * n
        self.num_embeddings = emb.num_embeddings
        self.weight = _slice_rows(emb.weight, self.vocab_start, self.vocab_end)
        set_placement(self.weight, TP_AXIS, Shard(0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.leave(out)


class SequenceParallelPositionEmbedding(TensorParallelModule):
    """Learned positions under SP: the full (replicated) table, but each rank adds the rows of its
    own s/t positions, so the weight's gradient is a partial sum (recorded ``Partial()``)."""

    def __init__(self, emb: nn.Embedding, group: comm.Group = None) -> None:
        super().__init__(group)
        self.weight = nn.Parameter(emb.weight.detach().clone())
        set_placement(self.weight, TP_AXIS, Partial())

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(split_along(positions, 0, self.group), self.weight)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token ``log sum_v exp(z_v) - z_target`` from vocab shards ``z`` [N, V/t]; three
    all-reduces of N fp32."""

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
        comm.all_reduce(target_logit, group=group)  # 2: the target's logit, from its rank
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
        # softmax - one_hot(target)
        g.scatter_add_(-1, local.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        return (g * grad.unsqueeze(-1)).to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 group: comm.Group = None,
                                 reduction: Literal["mean", "none"] = "mean",
                                 ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy from this rank's vocabulary shard of the logits [..., V/t], never gathering
    them.

    With z the logits, m = max_v z_v (all-reduce MAX), the loss of a token is
    ``log sum_v exp(z_v - m) - (z_target - m)``: the target logit comes from the one rank whose
    shard holds it (all-reduce SUM of zeros elsewhere) and the sum of exponentials is summed over
    the shards (all-reduce SUM): 3 all-reduces of b*s fp32 scalars instead of an all-gather of b*s*V
    logits. The gradient of each shard is ``softmax(z) - one_hot(target)`` restricted to the shard:
    no communication in backward. (Megatron-LM's ``vocab_parallel_cross_entropy``; DTensor's
    ``loss_parallel``.)

    As ``F.cross_entropy``: a target equal to ``ignore_index`` contributes loss 0 and no gradient,
    and the mean is over the other tokens (NaN when every token is ignored); any other target
    outside [0, t V/t) is refused. Padded vocabulary entries
    (``GPTConfig.make_vocab_size_divisible_by``) arrive as -inf logits: exp gives 0.
    """
    r, t = dist.get_rank(group), dist.get_world_size(group)
    v_local = logits.shape[-1]
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets of shape {tuple(targets.shape)} do not match logits "
                         f"{tuple(logits.shape)} (expected {tuple(logits.shape[:-1])})")
    keep = targets != ignore_index
    bad = keep & ((targets < 0) | (targets >= t * v_local))
    if bool(bad.any()):
        raise ValueError(f"rank {r}: target {int(targets[bad][0])} is outside the vocabulary "
                         f"[0, {t * v_local}) ({t} shards of {v_local} logits) and is not "
                         f"ignore_index={ignore_index}: fix the data or the tokenizer, or mark "
                         f"positions to skip with {ignore_index}")
    safe = targets.masked_fill(~keep, 0).reshape(-1)
    per_token = _VocabParallelCrossEntropy.apply(logits.reshape(-1, v_local), safe, r * v_local,
                                                 group)
    per_token = per_token.masked_fill(~keep.reshape(-1), 0.0)  # ignored: no loss, no gradient
    if reduction == "none":
        return per_token.view(targets.shape)
    return per_token.sum() / keep.sum()
