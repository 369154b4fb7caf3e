"""A tiny decoder-only GPT you can read in one sitting, and the real shapes of famous models.

The same ``GPTConfig`` describes two kinds of model:

* tiny ones (a few hundred thousand parameters) that the course instantiates and trains on CPU ranks, and
* presets with the real shapes of Llama 2/3, Mixtral 8x7B and GPT-3 175B, used only by the estimators
  (memory, FLOPs, planner). They are never instantiated.

``param_count(config)`` computes the parameter count from the formula; a test checks that it equals the
module's real count for every option (MHA/GQA, GELU/SwiGLU, LayerNorm/RMSNorm, learned/rotary positions,
tied/untied head, dense/MoE).

Formulas (h = d_model, f = d_ff, L = n_layer, v = vocab, h_kv = n_kv_head * d_head):

* attention: q and o are h x h, k and v are h x h_kv  -> 2h^2 + 2*h*h_kv weights (+ 2h + 2h_kv biases)
* MLP: GELU uses two h x f matrices (+ f + h biases); SwiGLU uses three (gate, up, down)
* GPT-2 style block (MHA, f = 4h, biases, LayerNorm): 12h^2 + 13h
* MoE: E experts each with its own MLP (hidden size f_e = ``expert_d_ff``, default f), a router h x E, and
  n_s shared experts as one MLP of hidden size n_s * f_e (DeepSeekMoE)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, get_args, get_origin, get_type_hints

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a decoder-only transformer.

    ``n_kv_head`` < ``n_head`` gives grouped-query attention (GQA); ``n_expert`` > 0 turns every MLP into a
    mixture of experts with ``top_k`` experts per token. MoE options (see ``MoE``): ``router`` "softmax"
    (Mixtral) or "sigmoid" (sigmoid scores + a selection bias, DeepSeek-V3); ``capacity_factor`` None is
    dropless, else each expert takes at most ceil(cf * T * k / E) of the T*k assignments; ``aux_loss_coef``
    (alpha of the Switch load-balancing loss) and ``z_loss_coef`` (the router z-loss) 0 turn those losses off.
    DeepSeekMoE (Dai et al. 2024): ``expert_d_ff`` the hidden size of each expert (None: ``d_ff``) -- m times
    more experts of f/m with m times the top_k is *fine-grained* segmentation, the same parameters and FLOPs
    with many more expert combinations; ``n_shared_expert`` experts every token passes through, unrouted.
    Node-limited routing (DeepSeek-V3): the experts form ``n_group`` contiguous groups (under expert parallelism
    the experts of one node's ranks) and each token picks its experts from at most ``topk_group`` = M of them.

    ``make_vocab_size_divisible_by`` (Megatron-LM's ``--make-vocab-size-divisible-by``, which it multiplies by
    the TP degree t): the embedding and the LM head get ``padded_vocab_size = ceil(V / m) * m`` rows, so that t
    can split a vocabulary it does not divide (pick m = k * t; Megatron's default k is 128). The padded logits
    are set to -inf (``GPT.head``), so the softmax, the loss and sampling never see them.
    """

    vocab_size: int = 256
    seq_len: int = 32
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    n_kv_head: int | None = None
    d_ff: int | None = None
    mlp: Literal["gelu", "swiglu"] = "gelu"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    pos: Literal["learned", "rope"] = "learned"
    bias: bool = True
    tie_embeddings: bool = False
    n_expert: int = 0
    top_k: int = 2
    router: Literal["softmax", "sigmoid"] = "softmax"
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    expert_d_ff: int | None = None
    n_shared_expert: int = 0
    n_group: int = 1
    topk_group: int | None = None
    make_vocab_size_divisible_by: int = 1
    name: str = "tiny"

    def __post_init__(self) -> None:
        for name, allowed in _choices().items():  # mlp, norm, pos, router: an unknown one is never replaced
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {getattr(self, name)!r}")
        sizes = {"vocab_size": self.vocab_size, "seq_len": self.seq_len, "n_layer": self.n_layer,
                 "n_head": self.n_head, "d_model": self.d_model,
                 "make_vocab_size_divisible_by": self.make_vocab_size_divisible_by}
        sizes |= {k: v for k, v in (("n_kv_head", self.n_kv_head), ("d_ff", self.d_ff),
                                    ("expert_d_ff", self.expert_d_ff)) if v is not None}
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(self.n_expert, bool) or not isinstance(self.n_expert, int) or self.n_expert < 0:
            raise ValueError(f"n_expert must be an int >= 0 (0: a dense MLP), got {self.n_expert!r}")
        if isinstance(self.n_shared_expert, bool) or not isinstance(self.n_shared_expert, int) \
                or self.n_shared_expert < 0:
            raise ValueError(f"n_shared_expert must be an int >= 0, got {self.n_shared_expert!r}")
        if not self.n_expert and (self.n_shared_expert or self.expert_d_ff is not None):
            raise ValueError("n_shared_expert and expert_d_ff describe MoE experts: set n_expert > 0 as well")
        if self.topk_group is not None:
            if not self.n_expert or self.n_expert % self.n_group or not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"node-limited routing needs n_expert divisible by n_group={self.n_group} and "
                                 f"1 <= topk_group <= n_group, got n_expert={self.n_expert}, topk_group="
                                 f"{self.topk_group}")
            if self.top_k > self.topk_group * (self.n_expert // self.n_group):
                raise ValueError(f"top_k={self.top_k} experts do not fit in topk_group={self.topk_group} groups of "
                                 f"{self.n_expert // self.n_group}: raise topk_group")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.kv_heads}")
        if self.pos == "rope" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim, got {self.head_dim}")
        if self.n_expert and not 1 <= self.top_k <= self.n_expert:
            raise ValueError(f"top_k={self.top_k} must be in [1, n_expert={self.n_expert}]")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 (or None for dropless), got {self.capacity_factor}")
        if self.aux_loss_coef < 0 or self.z_loss_coef < 0:
            raise ValueError(f"aux_loss_coef and z_loss_coef must be >= 0, got {self.aux_loss_coef}, "
                             f"{self.z_loss_coef}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by`` (the rows the embedding
        and the LM head hold; the ids >= ``vocab_size`` are padding, never a token)."""
        m = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def expert_ffn_dim(self) -> int:
        """f_e, the hidden size of one (routed or shared) expert."""
        return self.expert_d_ff or self.ffn_dim

    def with_(self, **changes: object) -> GPTConfig:
        """A copy with some fields changed (``cfg.with_(n_layer=4)``)."""
        return replace(self, **changes)


@functools.cache
def _choices() -> dict[str, tuple]:
    """The allowed values of every ``Literal`` field of ``GPTConfig``."""
    hints = get_type_hints(GPTConfig)
    return {name: get_args(h) for name, h in hints.items() if get_origin(h) is Literal}


# ----------------------------------------------------------------------------------------------------------------
# Parameter counts from the formula


def attention_params(c: GPTConfig) -> int:
    """q, k, v, o projections: 2h^2 + 2*h*h_kv (+ biases 2h + 2h_kv)."""
    h, hkv = c.d_model, c.kv_heads * c.head_dim
    return 2 * h * h + 2 * h * hkv + (2 * h + 2 * hkv if c.bias else 0)


def mlp_params(c: GPTConfig, d_ff: int | None = None) -> int:
    """One MLP of hidden size f (``d_ff``, default ``c.ffn_dim``): GELU 2hf (+ f + h), SwiGLU 3hf (+ 2f + h)."""
    h, f = c.d_model, d_ff or c.ffn_dim
    if c.mlp == "gelu":
        return 2 * h * f + (f + h if c.bias else 0)
    return 3 * h * f + (2 * f + h if c.bias else 0)


def norm_params(c: GPTConfig) -> int:
    return 2 * c.d_model if c.norm == "layernorm" else c.d_model


def shared_expert_params(c: GPTConfig) -> int:
    """The n_s shared experts of one MoE layer, one MLP of hidden size n_s * f_e (DeepSeek's implementation;
    with biases that is one output bias, not n_s): 0 without them."""
    return mlp_params(c, c.n_shared_expert * c.expert_ffn_dim) if c.n_shared_expert else 0


def block_params(c: GPTConfig, active_only: bool = False) -> int:
    """One transformer block. With MoE: E routed experts of hidden size f_e, the router h x E and the shared
    experts; ``active_only`` counts the top_k routed experts a token uses (the router and shared ones always)."""
    if c.n_expert:
        experts = c.top_k if active_only else c.n_expert
        ffn = experts * mlp_params(c, c.expert_ffn_dim) + c.d_model * c.n_expert + shared_expert_params(c)
    else:
        ffn = mlp_params(c)
    return attention_params(c) + ffn + 2 * norm_params(c)


def param_count(c: GPTConfig, active_only: bool = False) -> int:
    """Total parameters: embeddings + L blocks + final norm + head (untied); the vocabulary padded."""
    emb = c.padded_vocab_size * c.d_model + (c.seq_len * c.d_model if c.pos == "learned" else 0)
    head = 0 if c.tie_embeddings else c.padded_vocab_size * c.d_model
    return emb + c.n_layer * block_params(c, active_only) + norm_params(c) + head


# ----------------------------------------------------------------------------------------------------------------
# Presets: real shapes, for estimators only (never instantiated)

PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "gpt2-124m": GPTConfig(name="gpt2-124m", vocab_size=50257, seq_len=1024, n_layer=12, n_head=12, d_model=768,
                           tie_embeddings=True),
    "gpt3-175b": GPTConfig(name="gpt3-175b", vocab_size=50257, seq_len=2048, n_layer=96, n_head=96,
                           d_model=12288, tie_embeddings=True),
    "llama2-7b": GPTConfig(name="llama2-7b", vocab_size=32000, seq_len=4096, n_layer=32, n_head=32, d_model=4096,
                           d_ff=11008, mlp="swiglu", norm="rmsnorm", pos="rope", bias=False),
    "llama2-70b": GPTConfig(name="llama2-70b", vocab_size=32000, seq_len=4096, n_layer=80, n_head=64,
                            n_kv_head=8, d_model=8192, d_ff=28672, mlp="swiglu", norm="rmsnorm", pos="rope",
                            bias=False),
    "llama3-8b": GPTConfig(name="llama3-8b", vocab_size=128256, seq_len=8192, n_layer=32, n_head=32, n_kv_head=8,
                           d_model=4096, d_ff=14336, mlp="swiglu", norm="rmsnorm", pos="rope", bias=False),
    "llama3-70b": GPTConfig(name="llama3-70b", vocab_size=128256, seq_len=8192, n_layer=80, n_head=64,
                            n_kv_head=8, d_model=8192, d_ff=28672, mlp="swiglu", norm="rmsnorm", pos="rope",
                            bias=False),
    "mixtral-8x7b": GPTConfig(name="mixtral-8x7b", vocab_size=32000, seq_len=32768, n_layer=32, n_head=32,
                              n_kv_head=8, d_model=4096, d_ff=14336, mlp="swiglu", norm="rmsnorm", pos="rope",
                              bias=False, n_expert=8, top_k=2),
    "mixtral-8x22b": GPTConfig(name="mixtral-8x22b", vocab_size=32768, seq_len=65536, n_layer=56, n_head=48,
                               n_kv_head=8, d_model=6144, d_ff=16384, mlp="swiglu", norm="rmsnorm", pos="rope",
                               bias=False, n_expert=8, top_k=2),
}


# ----------------------------------------------------------------------------------------------------------------
# The module


class RMSNorm(nn.Module):
    """x / rms(x) * g (Zhang & Sennrich 2019); no bias, no mean subtraction."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(c: GPTConfig) -> nn.Module:
    return nn.LayerNorm(c.d_model) if c.norm == "layernorm" else RMSNorm(c.d_model)


def rope_cos_sin(seq_len: int, head_dim: int, base: float = 10000.0,
                 positions: torch.Tensor | None = None,
                 device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables (Su et al. 2021): angle(pos, i) = pos / base^(2i/d). Shapes [T, d/2], on ``device`` (or
    that of ``positions``)."""
    if positions is not None:
        device = positions.device
    pos = torch.arange(seq_len, dtype=torch.float32, device=device) if positions is None else positions.float()
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    ang = torch.outer(pos, inv)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [B, H, T, d] by the angles in cos/sin [T, d/2]."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    """Causal multi-head attention with optional grouped-query K/V heads (Ainslie et al. 2023)."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.kv_heads, c.head_dim
        kv_dim = c.kv_heads * c.head_dim
        self.q_proj = nn.Linear(c.d_model, c.d_model, bias=c.bias)
        self.k_proj = nn.Linear(c.d_model, kv_dim, bias=c.bias)
        self.v_proj = nn.Linear(c.d_model, kv_dim, bias=c.bias)
        self.o_proj = nn.Linear(c.d_model, c.d_model, bias=c.bias)
        self.rope = c.pos == "rope"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, H, T, d]
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, H_kv, T, d]
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.rope:
            cos, sin = rope_cos_sin(T, self.head_dim, device=x.device)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if k.shape[1] != q.shape[1]:  # GQA: each K/V head serves n_head / n_kv_head query heads
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """GELU MLP h -> f -> h, or SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, c: GPTConfig, d_ff: int | None = None) -> None:
        super().__init__()
        self.swiglu, f = c.mlp == "swiglu", d_ff or c.ffn_dim
        self.fc1 = nn.Linear(c.d_model, f, bias=c.bias)  # "up"
        self.gate = nn.Linear(c.d_model, f, bias=c.bias) if self.swiglu else None
        self.fc2 = nn.Linear(f, c.d_model, bias=c.bias)  # "down"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.fc2(F.silu(self.gate(x)) * self.fc1(x))
        return self.fc2(F.gelu(self.fc1(x)))


def expert_capacity(capacity_factor: float | None, n_tokens: int, top_k: int, n_expert: int) -> int | None:
    """Slots per expert, C = ceil(cf * T * k / E) for T tokens routed to k of E experts each (GShard, Lepikhin
    et al. 2020; Switch Transformer, Fedus et al. 2021). cf = 1 is exactly enough for perfectly even routing;
    ``None`` means dropless (no limit)."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * n_tokens * top_k / n_expert)


def expert_positions(chosen: torch.Tensor, n_expert: int, offset: torch.Tensor | None = None) -> torch.Tensor:
    """Where each of the T*k assignments ``chosen`` [T, k] stands in its expert's queue (0-based): a cumulative
    sum over the one-hot routing mask in token order, so token t's j-th choice comes after every choice of the
    tokens before t and after its own choices before j. ``offset[e]``: assignments to expert e already queued
    by tokens that come earlier in the batch (other ranks' shards). An assignment is kept when position < C."""
    flat = chosen.reshape(-1, 1)
    mask = F.one_hot(flat[:, 0], n_expert)  # [T*k, E]
    pos = (mask.cumsum(0) - 1).gather(1, flat).view_as(chosen)
    return pos if offset is None else pos + offset[chosen]


@dataclass
class Routing:
    """The router's decision for T tokens: ``logits`` [T, E]; ``probs`` [T, E], the distribution over experts
    the load-balancing loss averages (softmax; for the sigmoid router its scores normalised to sum 1);
    ``chosen`` [T, k] expert ids; ``weights`` [T, k] the combine weights."""

    logits: torch.Tensor
    probs: torch.Tensor
    chosen: torch.Tensor
    weights: torch.Tensor


@dataclass
class RoutingStats:
    """One MoE layer in one forward: assignments routed to each expert (before capacity), kept by each expert,
    dropped in all, and the mean per-token entropy of the router distribution (nats; log E is uniform)."""

    tokens_per_expert: list[int]
    kept_per_expert: list[int]
    dropped: int
    entropy: float


def routing_entropy(probs: torch.Tensor) -> float:
    """Mean over tokens of -sum_e p_e log p_e."""
    return float(-(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()) if probs.numel() else 0.0


class TokenShards(Protocol):
    """The ranks that each hold a share of the same micro-batch (data- and context-parallel ranks: set by
    ``course_lib.parallel.ep.share_routing``). ``size``: how many; ``gather(chosen)``: every rank's routing of
    the micro-batch, ``chosen`` [B_r, T_r, k] on this rank -> ([N, k] for the N tokens of the micro-batch in
    the single-process order, row after row; this rank's token t is row ``index[t]`` of it)."""

    size: int

    def gather(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class _RouterLossInBackward(torch.autograd.Function):
    """Identity on ``out`` whose backward also back-propagates ``loss`` with weight ``scale``: a layer's router
    loss reaches its router wherever the layer's output is differentiated, also on a pipeline stage that
    computes no loss (Megatron-Core's ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.loss_shape, ctx.scale = loss.shape, scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, grad.new_full(ctx.loss_shape, ctx.scale), None


class MoE(nn.Module):
    """Top-k mixture of experts (Shazeer et al. 2017; Mixtral): a router picks ``top_k`` experts per token and
    mixes their outputs; the single-process reference (the expert-parallel version is
    ``course_lib.parallel.ep.ExpertParallelMoE``, a subclass that keeps only its rank's experts).

    * Router "softmax" (Mixtral): the top-k logits, their weights the softmax over the k selected. Router
      "sigmoid" (DeepSeek-V3): scores s = sigmoid(logits), experts selected by top-k of s + b with b the
      ``expert_bias`` buffer (no gradient: moved by ``balance_bias_``, "auxiliary-loss-free" balancing, Wang
      et al. 2024), weights s_selected / sum(s_selected).
    * Capacity (``capacity_factor``): expert e keeps the assignments whose ``expert_positions`` < C =
      ``expert_capacity``; a dropped assignment adds nothing, so a token dropped by all its experts passes
      through the block's residual connection unchanged. None: dropless.
    * Losses (``aux_loss`` after each forward, added to the LM loss by ``moe_aux_loss``): the Switch/GShard
      load-balancing loss alpha * E * sum_i f_i P_i (f_i: fraction of the T*k assignments routed to i, before
      capacity; P_i: mean router probability of i; exactly alpha for uniform routing, Fedus et al. 2021, eq. 4)
      and the router z-loss beta * mean_t logsumexp(logits_t)^2 (ST-MoE, Zoph et al. 2022, eq. 5).
    * Node-limited routing (``n_group``, ``topk_group`` = M; DeepSeek-V3, section 2.1.2): the E experts form
      G contiguous groups; each group scores the sum of its top max(1, k // M) selection scores, and a token's
      top-k is taken among the experts of its M best groups only (``select_experts``): under expert
      parallelism with a group per node, each token's rows cross to at most M nodes.
    * Shared experts (``n_shared_expert``, DeepSeekMoE, Dai et al. 2024): ``shared``, one MLP every token goes
      through, added unweighted to the routed experts' weighted sum (``add_shared``); its parameters are dense
      (replicated under expert parallelism), not experts.
    * ``stats``: the ``RoutingStats`` of the last forward.
    * On many ranks (``shards``, a ``TokenShards``, set by ``parallel.ep.share_routing``): capacity, queue
      positions and f_i are those of the whole micro-batch, every rank's routing gathered in token order; each
      rank's P_i and z-loss sum its own tokens scaled so that the mean over the ranks is the micro-batch's loss.
      ``backward_scale`` (set for a pipeline): the router loss is not left for ``moe_aux_loss`` but
      back-propagated through the layer's output with that weight (``router_loss_in_backward``) and its value
      kept in ``reported`` for the step's loss.

    Public seams a variant overrides: ``router_logits``, ``route``, ``capacity``, ``expert_fractions``,
    ``select_experts``, ``load_balancing_loss``, ``batch_routing``, ``add_shared``, ``router_loss_in_backward``,
    ``attach_router_loss``.
    """

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_expert, self.top_k, self.router_kind = c.n_expert, c.top_k, c.router
        self.capacity_factor, self.aux_loss_coef, self.z_loss_coef = c.capacity_factor, c.aux_loss_coef, c.z_loss_coef
        self.n_group, self.topk_group = c.n_group, c.topk_group
        self.router = nn.Linear(c.d_model, c.n_expert, bias=False)
        self.experts = nn.ModuleList(MLP(c, c.expert_ffn_dim) for _ in range(c.n_expert))
        self.shared = MLP(c, c.n_shared_expert * c.expert_ffn_dim) if c.n_shared_expert else None
        if c.router == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(c.n_expert))
        self.aux_loss: torch.Tensor | None = None
        self.stats: RoutingStats | None = None
        self.shards: TokenShards | None = None
        self.backward_scale: float | None = None
        self.reported: list[float] = []

    # -- seams ------------------------------------------------------------------------------------------------

    def router_logits(self, flat: torch.Tensor) -> torch.Tensor:
        """[T, E] scores of every expert for tokens ``flat`` [T, h]: a linear map h -> E."""
        return self.router(flat)

    def select_experts(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, ids) [T, k] of the top-k of the selection ``scores`` [T, E]; node-limited (``topk_group``): among
        the experts of each token's M best groups, a group's score the sum of its top max(1, k // M)."""
        if self.topk_group is None or self.topk_group == self.n_group:
            return scores.topk(self.top_k, dim=-1)
        T, E, G, M = scores.shape[0], self.n_expert, self.n_group, self.topk_group
        grouped = scores.view(T, G, E // G)
        group_score = grouped.topk(min(max(1, self.top_k // M), E // G), dim=-1).values.sum(-1)  # [T, G]
        allowed = torch.zeros(T, G, dtype=torch.bool, device=scores.device)
        allowed.scatter_(1, group_score.topk(M, dim=-1).indices, True)
        return scores.masked_fill(~allowed.repeat_interleave(E // G, dim=1), float("-inf")).topk(self.top_k, dim=-1)

    def route(self, flat: torch.Tensor) -> Routing:
        """Router logits, probabilities, top-k choices and combine weights for tokens ``flat`` [T, h]."""
        logits = self.router_logits(flat)
        if self.router_kind == "softmax":
            top, chosen = self.select_experts(logits)
            return Routing(logits, logits.softmax(-1), chosen, top.softmax(-1))
        scores = logits.sigmoid()
        chosen = self.select_experts(scores + self.expert_bias)[1]
        picked = scores.gather(1, chosen)
        return Routing(logits, scores / scores.sum(-1, keepdim=True), chosen, picked / picked.sum(-1, keepdim=True))

    def capacity(self, n_tokens: int) -> int | None:
        """Slots per expert for a batch of ``n_tokens`` tokens (all of them, over every rank)."""
        return expert_capacity(self.capacity_factor, n_tokens, self.top_k, self.n_expert)

    def expert_fractions(self, counts: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """f_i = (assignments routed to i) / (T * k): the fractions sum to 1."""
        return counts.float() / (n_tokens * self.top_k)

    def load_balancing_loss(self, f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """alpha * E * sum_i f_i * P_i (f carries no gradient; the router learns through P)."""
        return self.aux_loss_coef * self.n_expert * (f * p).sum()

    # -- the layer --------------------------------------------------------------------------------------------

    def router_loss(self, r: Routing, counts: torch.Tensor, n_tokens: int, replicas: int = 1) -> torch.Tensor:
        """Load-balancing + z-loss of a batch of ``n_tokens`` tokens whose routed ``counts`` per expert are given.

        When the batch is split over ``replicas`` ranks whose losses are averaged, each rank passes the global
        ``counts`` and ``n_tokens`` with its own routing ``r``: P_i and the z-loss then sum this rank's tokens
        only, times ``replicas / n_tokens``, so the mean over the ranks is exactly the whole batch's loss."""
        loss = r.logits.new_zeros(())
        scale = replicas / n_tokens
        if self.aux_loss_coef:
            loss = loss + self.load_balancing_loss(self.expert_fractions(counts, n_tokens), r.probs.sum(0) * scale)
        if self.z_loss_coef:
            loss = loss + self.z_loss_coef * r.logits.logsumexp(-1).pow(2).sum() * scale
        return loss

    @torch.no_grad()
    def balance_bias_(self, counts: torch.Tensor, rate: float) -> None:
        """Auxiliary-loss-free balancing (sigmoid router): b_i += rate * sign(mean load - load_i), so an
        overloaded expert is selected less next step and an idle one more (Wang et al. 2024; DeepSeek-V3)."""
        if self.router_kind != "sigmoid":
            raise ValueError("balance_bias_ needs router='sigmoid' (the softmax router has no selection bias)")
        load = counts.float().to(self.expert_bias.device)
        self.expert_bias.add_(rate * torch.sign(load.mean() - load))

    def batch_routing(self, chosen: torch.Tensor, lead: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor, int, int]:
        """For this rank's choices ``chosen`` [T_r, k] (tokens shaped ``lead`` = (B_r, T_r')): the micro-batch's
        routed and kept counts per expert [E], this rank's keep mask [T_r, k], the micro-batch's token count and
        the number of ranks sharing it. One process: all local. Sharded (``shards``): when capacity or f_i need
        them, every rank's choices are gathered (``TokenShards.gather``) and the queues run in token order;
        otherwise (dropless, no load-balancing loss) the counts are this rank's alone."""
        E, size = self.n_expert, 1 if self.shards is None else self.shards.size
        if size > 1 and (self.capacity_factor is not None or self.aux_loss_coef):
            every, index = self.shards.gather(chosen.view(*lead, self.top_k))
        else:
            every, index = chosen, None
        cap = self.capacity(chosen.shape[0] * size)
        keep_all = (torch.ones_like(every, dtype=torch.bool) if cap is None
                    else expert_positions(every, E) < cap)
        keep = keep_all if index is None else keep_all[index]
        routed = torch.bincount(every.reshape(-1), minlength=E)
        kept = torch.bincount(every[keep_all], minlength=E)
        return routed, kept, keep, chosen.shape[0] * size, size

    def add_shared(self, routed: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """y_t = shared(x_t) + sum_j w_tj E_j(x_t): the shared experts' output, once per token and unweighted, plus
        the routed sum ``routed`` [T, h] (DeepSeekMoE, eq. 9). Without shared experts: ``routed``."""
        return routed if self.shared is None else routed + self.shared(flat)

    def router_loss_in_backward(self, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """``out`` unchanged, its backward also back-propagating ``loss`` x ``backward_scale``; the value is kept
        in ``reported`` (the pipeline's stages report their layers' router losses from there)."""
        self.reported.append(float(loss.detach()) * self.backward_scale)
        return _RouterLossInBackward.apply(out, loss, self.backward_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        r = self.route(flat)
        counts, kept, keep, n_tokens, size = self.batch_routing(r.chosen, tuple(x.shape[:-1]))
        loss = self.router_loss(r, counts, n_tokens, replicas=size)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = ((r.chosen == e) & keep).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, r.weights[token, slot, None] * expert(flat[token]))
        self.stats = RoutingStats(counts.tolist(), kept.tolist(), int(counts.sum() - kept.sum()),
                                  routing_entropy(r.probs.detach()))
        return self.attach_router_loss(self.add_shared(out, flat).view_as(x), loss)

    def attach_router_loss(self, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """The layer's output, its router ``loss`` either kept in ``aux_loss`` for ``moe_aux_loss`` (one process,
        data parallelism) or, under a pipeline (``backward_scale`` set), back-propagated through ``out``
        (``router_loss_in_backward``)."""
        if self.backward_scale is None or not (self.aux_loss_coef or self.z_loss_coef):
            self.aux_loss = loss
            return out
        self.aux_loss = None
        return self.router_loss_in_backward(out, loss)


def moe_aux_loss(model: nn.Module) -> torch.Tensor | float:
    """Sum of the router losses every MoE layer of ``model`` computed in its last forward (0.0 without MoE):
    what a training loop adds to the LM loss."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    return sum(losses) if losses else 0.0


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.norm1 = make_norm(c)
        self.attn = Attention(c)
        self.norm2 = make_norm(c)
        self.mlp = MoE(c) if c.n_expert else MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token (+ learned position) embedding -> L blocks -> final norm -> LM head.

    ``embed``, ``blocks`` and ``head`` are separate so that pipeline stages can run a slice of the model.
    Initialisation is deterministic from ``seed`` (its own generator; the global RNG is untouched):
    weights ~ N(0, 0.02), residual output projections ~ N(0, 0.02 / sqrt(2L)) (GPT-2), biases 0, norms 1.
    """

    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        c = self.config = config
        with torch.random.fork_rng(devices=[]):  # torch's default inits draw from the global RNG: leave it as it was
            self.tok_emb = nn.Embedding(c.padded_vocab_size, c.d_model)
            self.pos_emb = nn.Embedding(c.seq_len, c.d_model) if c.pos == "learned" else None
            self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
            self.norm_f = make_norm(c)
            self.lm_head = nn.Linear(c.d_model, c.padded_vocab_size, bias=False)
        if c.padded_vocab_size != c.vocab_size:
            self.lm_head.vocab_size = c.vocab_size  # the real vocabulary: the rows beyond it are padding
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # norm gains
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith(("o_proj.weight", "fc2.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head; the padded vocabulary's logits -inf. The LM head carries the real
        ``vocab_size`` when the vocabulary is padded (so a pipeline stage or a TP shard of it masks too; under TP
        the shard's first id is its ``output_start``). Reads only ``norm_f`` and ``lm_head``."""
        logits = self.lm_head(self.norm_f(x))
        vocab = getattr(self.lm_head, "vocab_size", None)
        if vocab is None:
            return logits
        start = getattr(self.lm_head, "output_start", 0)
        ids = torch.arange(start, start + logits.shape[-1], device=logits.device)
        return logits.masked_fill(ids >= vocab, float("-inf"))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx [B, T] token ids -> logits [B, T, vocab]."""
        if idx.shape[1] > self.config.seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens exceeds seq_len={self.config.seq_len}")
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def num_params(model: nn.Module) -> int:
    """Real parameter count of a module (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
