"""The shape of a decoder-only GPT, its parameter count from the formula, and the real shapes of famous models.

The same ``GPTConfig`` describes two kinds of model:

* tiny ones (a few hundred thousand parameters) that the course instantiates (``course_lib.model.GPT``) and
  trains on CPU ranks, and
* presets with the real shapes of Llama 2/3, Mixtral 8x7B and GPT-3 175B, used only by the estimators
  (memory, FLOPs, planner). They are never instantiated, and nothing here needs torch.

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
from dataclasses import dataclass, replace
from typing import Literal, get_args, get_origin, get_type_hints


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a decoder-only transformer.

    ``n_kv_head`` < ``n_head`` gives grouped-query attention (GQA); ``n_expert`` > 0 turns every MLP into a
    mixture of experts with ``top_k`` experts per token. MoE options (see ``MoE``): ``router`` "softmax"
    (Mixtral) or "sigmoid" (sigmoid scores + a selection bias, DeepSeek-V3); ``capacity_factor`` None is
    dropless, else each expert takes at most ceil(cf * T * k / E) of the T*k assignments; ``aux_loss_coef``
    (alpha of the Switch load-balancing loss) and ``z_loss_coef`` (the router z-loss) 0 turn those losses off.
    ``capacity_scope``: "global" (T = the whole micro-batch over every rank, as on one process) or "local" (T = the
    tokens one rank routes, and f_i over its data rank's micro-batch: Megatron-LM's); ``drop_policy``: which
    assignments a full expert drops -- "position" (the latest tokens), "probs" (the lowest combine weights,
    Megatron's default) or "choice" (every first choice queued before any second: GShard, DeepSpeed, Tutel).
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
    capacity_scope: Literal["global", "local"] = "global"
    drop_policy: Literal["position", "probs", "choice"] = "position"
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
        if self.drop_policy != "position" and self.capacity_factor is None:
            raise ValueError(f"drop_policy={self.drop_policy!r} decides which assignments a full expert drops: it "
                             f"needs a capacity_factor (None is dropless, nothing is ever dropped)")
        if self.capacity_scope != "global" and not self.n_expert:
            raise ValueError(f"capacity_scope={self.capacity_scope!r} describes MoE routing: set n_expert > 0")
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


@functools.lru_cache(maxsize=1_000)
def dense_twin(c: GPTConfig) -> GPTConfig:
    """The same model with dense MLPs of d_ff: what a leading dense block of an MoE model is (DeepSeek-V3's first
    three blocks, Kimi K2's first)."""
    return replace(c, n_expert=0, n_shared_expert=0, expert_d_ff=None, n_group=1, topk_group=None,
                   capacity_factor=None, capacity_scope="global", drop_policy="position")


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



def resolve(config: GPTConfig | str) -> GPTConfig:
    """``config`` itself, or the preset of that name (``PRESETS``)."""
    if isinstance(config, str):
        if config not in PRESETS:
            raise ValueError(f"unknown preset {config!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[config]
    return config
