"""Memory budgets per GPU: what the formulas predict, and what a run really holds.

Two budgets (as Viacheslav Dubrov's "Scaling LLMs with multi-GPU and multi-node parallelism" separates them):

* **training** peak = parameters + gradients + optimizer state + saved activations + temporary buffers
  + communication buffers + allocator headroom;
* **inference** peak = resident weights + KV cache + runtime workspace + communication buffers + headroom.

The estimators take a :class:`~course_lib.model_config.GPTConfig` (a preset with real shapes or a tiny one; MHA or
GQA; dense or MoE), a precision policy, an optimizer, a micro-batch and a parallel layout, and return a
:class:`MemoryBudget`: bytes per GPU by category, a read-only mapping with ``.total`` and a readable ``str``.

:class:`course_lib.memtrack.MemoryTracker` measures the same categories inside a process, so that the estimate
for the course's tiny GPT can be checked against what PyTorch really allocates.

Conventions (all sizes in bytes; GB means 10^9 bytes, GiB 2^30):

* Mixed-precision Adam keeps 2 (bf16 weights) + 2 (bf16 grads) + 4 (fp32 master weights) + 4 + 4 (fp32 Adam
  m and v) = 16 bytes per parameter; in the notation of ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory
  Optimizations Toward Training Trillion Parameter Models", Sec. 3.1) that is 2Ψ + 2Ψ + KΨ with K = 12.
  With a separate fp32 gradient-accumulation buffer, add 4 (20 bytes/param; we count it with the gradients).
  Megatron-LM's distributed optimizer keeps only the fp32 main grad (2 + 4 + 12 = 18): a different convention.
* ZeRO per device (N_d data-parallel ranks): baseline (4+K)Ψ; ZeRO-1 4Ψ + KΨ/N_d; ZeRO-2 2Ψ + (2+K)Ψ/N_d;
  ZeRO-3 (4+K)Ψ/N_d (ZeRO paper, Sec. 5 and Figure 1).
* Activations per transformer layer, 16-bit, with dropout (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", Sec. 4 and Table 2; s sequence, b micro-batch, h hidden,
  a heads, t tensor-parallel size): no parallelism sbh(34 + 5as/h); tensor parallel sbh(10 + 24/t + 5as/(ht));
  tensor + sequence parallel (sbh/t)(34 + 5as/h); selective recomputation drops the 5as/h term; full
  recomputation keeps only the layer input, 2sbh.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from course_lib.model_config import PRESETS, GPTConfig, norm_params
from course_lib.pp_layers import layer_split
from course_lib.schedules import SCHEDULE_ALIASES, canonical_schedule

__all__ = [
    "GB",
    "PRECISIONS",
    "GiB",
    "MemoryBudget",
    "ParallelLayout",
    "ParamBytes",
    "Precision",
    "activation_bytes_paper",
    "bytes_per_param",
    "bytes_per_param_table",
    "compare_budgets",
    "format_bytes",
    "inference_memory",
    "kv_cache_bytes",
    "layer_activation_bytes",
    "model_activation_bytes",
    "params_per_rank",
    "precision_policy",
    "training_memory",
    "weight_bytes",
    "zero_memory_per_device",
]

GB = 10**9
GiB = 2**30

Recompute = Literal["none", "selective", "full"]
Formula = Literal["paper", "adapted"]
OptimizerName = Literal["sgd", "sgd_momentum", "adam", "adamw"]

# ----------------------------------------------------------------------------------------------------------------
# Input checks: nonsense (seq_len=0, micro_batch=-1, tp=0) is refused by name, never replaced by a default


def _count(name: str, value: object, minimum: int = 1, none: str = "") -> None:
    """``value`` must be an int >= ``minimum``; None too where ``none`` says what None means."""
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        default = f" (or None: {none})" if none else ""
        raise ValueError(f"{name} must be an int >= {minimum}{default}, got {value!r}")


def _amount(name: str, value: object, positive: bool = False) -> None:
    """``value`` must be a number >= 0 (> 0 where ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (value > 0 if positive else value >= 0):
        raise ValueError(f"{name} must be a number {'> 0' if positive else '>= 0'}, got {value!r}")


# ----------------------------------------------------------------------------------------------------------------
# Results: bytes by category


def format_bytes(n: float, unit: str | None = None, *, digits: int | None = None) -> str:
    """The course's one byte formatter, decimal units: ``1.23 GB``-style (two decimals); ``unit`` forces one of
    B, kB, MB, GB, TB, KiB, MiB, GiB; ``digits`` gives that many significant digits instead
    (``format_bytes(4e6, digits=3)`` -> ``4 MB``, ``format_bytes(1500, digits=3)`` -> ``1.5 kB``)."""
    units = {"B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    if unit is not None and unit not in units:
        raise ValueError(f"unit must be one of {', '.join(units)} (or None to pick one), got {unit!r}")
    if unit is None:
        unit = next((u for u in ("TB", "GB", "MB", "kB") if abs(n) >= units[u]), "B")
    if digits is not None:
        return f"{n / units[unit]:.{digits}g} {unit}"
    if unit == "B":
        return f"{n:,.0f} B"
    return f"{n / units[unit]:,.2f} {unit}"


def _pick_unit(n: float) -> str:
    return next((u for u in ("TB", "GB", "MB", "kB") if abs(n) >= {"TB": 1e12, "GB": 1e9, "MB": 1e6, "kB": 1e3}[u]),
                "B")


@dataclass(eq=False)
class MemoryBudget(Mapping[str, float]):
    """Bytes per GPU by category, in a fixed order: a read-only ``dict`` with a total.

    ``budget["activations"]``, ``budget.total``, ``budget.gb()`` ({category: decimal GB}), ``dict(budget)``;
    ``str(budget)`` is a small table (GB for real models; a smaller unit is picked automatically when the
    total is below 1 GB, or ask ``budget.to_string("GB")``). ``notes`` say which assumptions produced it
    (e.g. which pipeline stage is the worst).
    """

    parts: dict[str, float]
    label: str = ""
    notes: list[str] = field(default_factory=list)

    def __getitem__(self, key: str) -> float:
        return self.parts[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)

    @property
    def total(self) -> float:
        """Sum of all categories (bytes)."""
        return float(sum(self.parts.values()))

    def gb(self) -> dict[str, float]:
        """{category: decimal GB}, handy for plotting."""
        return {k: v / GB for k, v in self.parts.items()}

    def to_string(self, unit: str | None = None) -> str:
        unit = unit or _pick_unit(self.total)
        width = max([len(k) for k in self.parts] + [5])
        lines = [self.label] if self.label else []
        for k, v in self.parts.items():
            share = f"{100 * v / self.total:5.1f}%" if self.total else ""
            lines.append(f"  {k:<{width}}  {format_bytes(v, unit):>14}  {share}")
        lines.append(f"  {'total':<{width}}  {format_bytes(self.total, unit):>14}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_string()

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={format_bytes(v)}" for k, v in self.parts.items())
        return f"MemoryBudget({self.label!r}: {inner}; total={format_bytes(self.total)})"


def compare_budgets(budgets: Mapping[str, Mapping[str, float]], unit: str = "GB") -> str:
    """A side-by-side table: one column per budget (e.g. estimate vs measured), one row per category."""
    names = list(budgets)
    cats: list[str] = []
    for b in budgets.values():
        cats += [k for k in b if k not in cats]
    w = max([len(c) for c in cats] + [5])
    col = max([len(n) for n in names] + [14])
    lines = [f"  {'':<{w}}  " + "  ".join(f"{n:>{col}}" for n in names)]
    for c in [*cats, "total"]:
        vals = [sum(b.values()) if c == "total" else b.get(c, 0.0) for b in budgets.values()]
        lines.append(f"  {c:<{w}}  " + "  ".join(f"{format_bytes(v, unit):>{col}}" for v in vals))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Precision policies and bytes per parameter


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of training state.

    * ``param_bytes``: the weights forward/backward read; ``grad_bytes``: their gradients;
    * ``master_bytes``: an fp32 master copy of the weights (mixed precision), 0 if none;
    * ``state_bytes``: each optimizer state tensor (Adam m and v, SGD momentum);
    * ``grad_accum_bytes``: a separate fp32 buffer that accumulates gradients across micro-batches;
    * ``activation_bytes``: saved activations.
    """

    name: str
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    state_bytes: int
    activation_bytes: int
    grad_accum_bytes: int = 0


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", param_bytes=4, grad_bytes=4, master_bytes=0, state_bytes=4, activation_bytes=4),
    "bf16": Precision("bf16", param_bytes=2, grad_bytes=2, master_bytes=0, state_bytes=2, activation_bytes=2),
    "mixed": Precision("mixed", param_bytes=2, grad_bytes=2, master_bytes=4, state_bytes=4, activation_bytes=2),
}


def precision_policy(name: str | Precision = "mixed", fp32_grad_accum: bool = False) -> Precision:
    """One of ``PRECISIONS``: "fp32"; "bf16" (pure bf16: weights, grads and optimizer states all 16-bit);
    "mixed" (bf16 weights/grads/activations, fp32 master weights and optimizer states). ``fp32_grad_accum``
    adds a 4-byte gradient-accumulation buffer (meaningless for fp32, whose grads already are fp32)."""
    p = name if isinstance(name, Precision) else PRECISIONS.get(name)
    if p is None:
        raise ValueError(f"unknown precision {name!r}; choose one of {sorted(PRECISIONS)}")
    if fp32_grad_accum:
        if p.grad_bytes == 4:
            raise ValueError("fp32 gradient accumulation only makes sense when gradients are 16-bit")
        p = Precision(f"{p.name}+fp32acc", p.param_bytes, p.grad_bytes, p.master_bytes, p.state_bytes,
                      p.activation_bytes, grad_accum_bytes=4)
    return p


_OPT_STATES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}


@dataclass(frozen=True)
class ParamBytes:
    """Bytes per parameter of training state, split as ZeRO splits it.

    ``params`` (sharded by ZeRO-3), ``grads`` incl. any fp32 accumulation buffer (sharded from ZeRO-2), and
    ``optimizer`` = fp32 master copy + optimizer states, which is ZeRO's K (sharded from ZeRO-1).
    """

    params: int
    grads: int
    optimizer: int

    @property
    def K(self) -> int:  # noqa: N802  (ZeRO's notation)
        """ZeRO's K: optimizer-state bytes per parameter (12 for mixed-precision Adam)."""
        return self.optimizer

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def bytes_per_param(precision: str | Precision = "mixed", optimizer: OptimizerName = "adamw",
                    fp32_grad_accum: bool = False) -> ParamBytes:
    """Bytes per parameter for a precision policy and optimizer.

    K = master + n_states * state_bytes, with n_states = 0 (SGD), 1 (SGD with momentum), 2 (Adam/AdamW).
    Examples: mixed + Adam = 2 + 2 + (4 + 4 + 4) = 16 (K = 12), +4 with ``fp32_grad_accum``; fp32 + Adam =
    4 + 4 + 8 = 16; pure bf16 + Adam = 2 + 2 + 4 = 8; mixed + SGD = 2 + 2 + 4 = 8 (the master copy stays).
    """
    if optimizer not in _OPT_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {sorted(_OPT_STATES)}")
    p = precision_policy(precision, fp32_grad_accum)
    return ParamBytes(params=p.param_bytes, grads=p.grad_bytes + p.grad_accum_bytes,
                      optimizer=p.master_bytes + _OPT_STATES[optimizer] * p.state_bytes)


def bytes_per_param_table() -> list[dict[str, Any]]:
    """Every precision x optimizer combination: rows of {precision, optimizer, params, grads, optimizer, K,
    total} (bytes per parameter). ``fp32_grad_accum`` rows are added for the 16-bit policies."""
    rows = []
    for prec in PRECISIONS:
        for acc in (False, True):
            if acc and PRECISIONS[prec].grad_bytes == 4:
                continue
            for opt in _OPT_STATES:
                pb = bytes_per_param(prec, opt, fp32_grad_accum=acc)  # type: ignore[arg-type]
                rows.append({"precision": precision_policy(prec, acc).name, "optimizer": opt, "params": pb.params,
                             "grads": pb.grads, "optimizer_state": pb.optimizer, "K": pb.K, "total": pb.total})
    return rows


def weight_bytes(n_params: float, bytes_per_weight: float = 2) -> float:
    """Resident weights: n_params x bytes (bf16 = 2, int8 = 1, int4 = 0.5). 70e9 in bf16 = 140 GB."""
    _amount("n_params", n_params)
    _amount("bytes_per_weight", bytes_per_weight, positive=True)
    return n_params * bytes_per_weight


def zero_memory_per_device(psi: float, K: float = 12, N_d: int = 1, stage: int = 0,
                           param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Model-state bytes per data-parallel rank under ZeRO (Rajbhandari et al. 2020, Sec. 5, Figure 1).

    With Ψ parameters, K optimizer bytes per parameter and N_d ranks (16-bit params and grads by default):

    * stage 0 (plain DP): (2 + 2 + K)Ψ
    * stage 1 (P_os, optimizer states sharded): (2 + 2)Ψ + KΨ/N_d
    * stage 2 (P_os+g, + gradients): 2Ψ + (2 + K)Ψ/N_d
    * stage 3 (P_os+g+p, + parameters): (2 + 2 + K)Ψ/N_d

    The paper's example: Ψ = 7.5B, K = 12, N_d = 64 gives 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0..3, got {stage}")
    _count("N_d", N_d)
    for name, value in (("psi", psi), ("K", K), ("param_bytes", param_bytes), ("grad_bytes", grad_bytes)):
        _amount(name, value)
    p = param_bytes * psi / (N_d if stage >= 3 else 1)
    g = grad_bytes * psi / (N_d if stage >= 2 else 1)
    o = K * psi / (N_d if stage >= 1 else 1)
    return p + g + o


# ----------------------------------------------------------------------------------------------------------------
# Parallel layout and parameters per rank


@dataclass(frozen=True)
class ParallelLayout:
    """How one training job is split. World size = dp x cp x tp x pp.

    * ``dp`` data-parallel ranks with ZeRO ``zero`` stage 0..3. Context-parallel ranks hold the same weights,
      so ZeRO shards model states over dp x cp ranks (as Megatron's distributed optimizer and torchtitan's
      FSDP over the ``dp_shard_cp`` mesh do).
    * ``tp`` tensor-parallel ranks; ``sp`` adds sequence parallelism (norms/dropout work on s/t tokens).
    * ``pp`` pipeline stages with ``schedule`` "1f1b" (stage i keeps min(pp - i, m) micro-batches in flight,
      so the first stage keeps <= pp) or "afab" (GPipe: every stage keeps all m); ``microbatches`` m per
      step (default 4 x pp, the m >= 4p rule of thumb); ``split``: blocks per stage when they are not equal
      (``pp_layers.layer_split``'s explicit split, e.g. ``pp_layers.ends_split``; None: L / pp each).
    * ``cp`` context-parallel ranks: each holds s/cp tokens of every sequence.
    * ``ep`` expert-parallel ranks (MoE), carved out of the dp x cp ranks as in Megatron Core and
      DeepSpeed-MoE: each rank holds n_expert/ep experts, each expert is replicated (dp x cp)/ep times, and
      experts are also split by tp (expert tensor parallel size = tp).
    """

    dp: int = 1
    zero: int = 0
    tp: int = 1
    sp: bool = False
    pp: int = 1
    schedule: Literal["1f1b", "afab"] = "1f1b"
    microbatches: int | None = None
    cp: int = 1
    ep: int = 1
    split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelLayout: {name}={value!r}, but every degree must be an int >= 1 "
                                 f"(1 = that parallelism is off)")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def m(self) -> int:
        """Micro-batches per step (default 4 x pp)."""
        return self.microbatches if self.microbatches is not None else 4 * self.pp

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations stage ``stage`` holds at its peak."""
        if self.pp == 1:
            return 1  # gradient accumulation runs micro-batches one after another
        if canonical_schedule(self.schedule) == "gpipe":
            return self.m
        return min(self.pp - stage, self.m)

    def validate(self, c: GPTConfig, seq_len: int | None = None) -> None:
        """Raise ``ValueError`` with the reason when the layout does not fit the model (and the sequence length,
        when given: CP and SP split it)."""
        for name in ("dp", "tp", "pp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero stage must be 0..3, got {self.zero}")
        if self.schedule not in SCHEDULE_ALIASES or canonical_schedule(self.schedule) not in ("one_f_one_b", "gpipe"):
            raise ValueError(f"schedule must be '1f1b' or 'afab', got {self.schedule!r}")
        if self.m < 1:
            raise ValueError("microbatches must be >= 1")
        if c.n_head % self.tp:
            raise ValueError(f"tp={self.tp} must divide n_head={c.n_head}")
        if c.kv_heads % self.tp and self.tp % c.kv_heads:
            raise ValueError(f"tp={self.tp} and n_kv_head={c.kv_heads}: one must divide the other")
        layer_split(c.n_layer, self.pp, self.split)  # the runtime's rule: pp divides n_layer, or an explicit split
        if seq_len is not None and seq_len % self.cp:
            raise ValueError(f"cp={self.cp} must divide the sequence length {seq_len}")
        if seq_len is not None and self.sp and (seq_len // self.cp) % self.tp:
            raise ValueError(f"sequence parallelism needs tp={self.tp} to divide the {seq_len // self.cp} local tokens")
        if self.ep > 1 and not c.n_expert:
            raise ValueError("ep > 1 needs a mixture-of-experts model (n_expert > 0)")
        if c.n_expert and c.n_expert % self.ep:
            raise ValueError(f"ep={self.ep} must divide n_expert={c.n_expert}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp x cp = {self.dp * self.cp} (EP is carved out of DP)")


def _resolve(config: GPTConfig | str) -> GPTConfig:
    if isinstance(config, str):
        if config not in PRESETS:
            raise ValueError(f"unknown preset {config!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[config]
    return config


def _layers_per_stage(n_layer: int, pp: int, split: tuple[int, ...] | None = None) -> list[int]:
    """L layers over pp stages: the pipeline runtime's rule (``pp_layers.layer_split``: L / pp each, or ``split``)."""
    return layer_split(n_layer, pp, split)


def _block_params_rank(c: GPTConfig, tp: int) -> tuple[float, float]:
    """(dense, experts) parameters of one block on one tensor-parallel rank (experts: all of them, before EP).

    Column-parallel matrices (q, k, v, fc1, gate) and their biases are split by t; row-parallel matrices
    (o, fc2) are split by t but their biases are replicated; norms and the MoE router are replicated. K/V
    heads: ceil(n_kv_head / t) per rank (GQA with fewer KV heads than t replicates them).
    """
    h, d, f = c.d_model, c.head_dim, c.ffn_dim
    kv_r = math.ceil(c.kv_heads / tp) * d
    attn = 2 * h * h / tp + 2 * h * kv_r + ((h / tp + 2 * kv_r + h) if c.bias else 0)
    n_in = 2 if c.mlp == "swiglu" else 1

    def mlp(f: int) -> float:
        return (n_in + 1) * h * f / tp + ((n_in * f / tp + h) if c.bias else 0)

    norms = 2 * norm_params(c)
    if c.n_expert:  # the shared experts (one MLP of n_s * f_e) are dense, the routed ones experts
        shared = mlp(c.n_shared_expert * c.expert_ffn_dim) if c.n_shared_expert else 0
        return attn + norms + h * c.n_expert + shared, c.n_expert * mlp(c.expert_ffn_dim)
    return attn + mlp(f) + norms, 0.0


def params_per_rank(config: GPTConfig | str, layout: ParallelLayout | None = None,
                    stage: int = 0) -> dict[str, float]:
    """Parameters held by one rank of pipeline stage ``stage``, before any ZeRO sharding.

    {"embedding", "blocks", "experts", "head"}: the token embedding is vocab-parallel (ceil(v/t) rows;
    Megatron also pads v), learned positions are replicated; both live on the first stage. The last stage
    holds the final norm and the untied head (v x h / t); with tied embeddings and pp > 1 it holds a copy of
    the embedding (Megatron all-reduces the two copies' gradients). ``experts`` are n_expert/ep per rank.
    With tp = pp = ep = 1 the sum equals ``param_count(config)``.
    """
    c = _resolve(config)
    lay = layout or ParallelLayout()
    lay.validate(c)
    if not 0 <= stage < lay.pp:
        raise ValueError(f"stage must be in [0, {lay.pp}), got {stage}")
    h, v, t = c.d_model, c.vocab_size, lay.tp
    n_layers = _layers_per_stage(c.n_layer, lay.pp, lay.split)[stage]
    dense, experts = _block_params_rank(c, t)
    word = math.ceil(v / t) * h
    emb = (word + (c.seq_len * h if c.pos == "learned" else 0)) if stage == 0 else 0
    head = 0.0
    if stage == lay.pp - 1:
        head = norm_params(c) + (word if (not c.tie_embeddings or lay.pp > 1) else 0)
    return {"embedding": float(emb), "blocks": n_layers * dense, "experts": n_layers * experts / lay.ep,
            "head": float(head)}


# ----------------------------------------------------------------------------------------------------------------
# Activations


def activation_bytes_paper(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                           recompute: Recompute = "none") -> float:
    """Activation bytes of ONE transformer layer, exactly Korthikanti et al. 2022, Table 2 (16-bit, dropout).

    * no recompute: TP only sbh(10 + 24/t + 5as/(ht)) (t = 1 gives sbh(34 + 5as/h)); TP+SP (sbh/t)(34 + 5as/h)
    * selective recompute: the same without the 5as/h term: sbh(10 + 24/t), (sbh/t)34
    * full recompute: 2sbh (only the layer's input is kept)
    """
    _check_recompute(recompute)
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t)):
        _count(name, value)
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh
    attn = 5 * a * s / h if recompute == "none" else 0.0
    if sp:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)


def _check_recompute(recompute: str) -> None:
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")


def layer_activation_bytes(config: GPTConfig | str, micro_batch: int, seq_len: int, *, tp: int = 1,
                           sp: bool = False, recompute: Recompute = "none", formula: Formula = "paper",
                           element_bytes: int = 2, dropout: bool = True) -> float:
    """Activation bytes saved by one transformer layer for one micro-batch, tensor by tensor.

    ``formula="paper"``: the accounting of Korthikanti et al. 2022 (Sec. 4.1), generalised to GQA (K/V are
    s·b·h_kv), SwiGLU (4 tensors of s·b·f instead of 2) and any d_ff; e = ``element_bytes``, dropout masks
    1 byte. Per token (x s·b): LN inputs 2·e·h; QKV input e·h; Q, K e(h + h_kv)/t; V e·h_kv/t; softmax
    e·a·s/t (+ dropout mask a·s/t and dropout output e·a·s/t); projection input e·h/t; attention dropout
    mask h; MLP input e·h; MLP hidden 2·e·f/t (SwiGLU 4·e·f/t); MLP dropout mask h. Parts marked without /t
    are replicated under TP and split by t with sequence parallelism. For a GPT (MHA, f = 4h, GELU, e = 2,
    dropout) this is exactly :func:`activation_bytes_paper`. MoE: the MLP terms of f_e x (top_k + n_shared_expert)
    (tokens per rank, balanced routing).

    ``formula="adapted"``: what the course's eager ``course_lib.model.Block`` saves for backward (no dropout,
    ``F.scaled_dot_product_attention`` -> CPU flash kernel, so no s² term), found by listing each autograd
    node's saved tensors, deduplicated by storage. Per token, e = ``element_bytes``:

    * norm (x2): LayerNorm: input e·h + mean and rstd 2·e (in the input's dtype on CPU; CUDA keeps them in
      fp32);  RMSNorm (eager): x e·h, rsqrt e, x·rsqrt e·h
    * attention input (norm output, shared by q/k/v projections): e·h
    * SDPA inputs q e·h/t, k and v e·h_kv/t each (GQA: the repeated K/V, e·h/t each); output e·h/t;
      logsumexp 4·a/t. The output takes the query's memory layout: without RoPE q is a transposed view of
      the projection, so ``y.transpose(1, 2).reshape(...)`` is free and o_proj saves the same storage; with
      RoPE q is contiguous [B, H, T, d], the reshape copies and o_proj saves another e·h/t
    * MLP input e·h; GELU: fc1 output + GELU output 2·e·f/t; SwiGLU: gate, silu, up, product 4·e·f/t
    * MoE, per token and chosen expert: gathered input e·h, hidden (2 or 4)·e·f_e, expert output e·h, gate
      weight e, product e·h, nonzero indices 16; per token: top-k indices 8k, softmax of top-k e·k; the
      shared experts' hidden (2 or 4)·e·n_s·f_e (f_e = ``expert_d_ff``)
    * RoPE: the cos/sin tables 2·s·(d/2)·4 bytes per layer (not per token)

    Under TP the /t parts are split; the rest are replicated unless ``sp``: with SP every replicated part is
    divided by t, including the attention and MLP inputs, because the column-parallel linears after an SP region
    keep only the s/t input shard and all-gather it again in backward (Megatron-LM's form, what
    ``course_lib.parallel.tp_comm.sequence_parallel_linears`` does; a linear that saved the gathered input would
    add 2·e·h·(1 - 1/t) per token). For MHA without RoPE a TP + SP layer is exactly the unsplit layer / t
    (measured in tests/test_tp.py). Selective recompute (of the core
    attention) drops only the logsumexp here: with a flash kernel there is no s² tensor left to drop, and
    the SDPA output is kept anyway as the o_proj input. Full recompute keeps the layer input e·h (/t with
    SP; what ``torch.utils.checkpoint`` saves per block, checked by the tracker); the paper's Table 2 writes
    2sbh in every case.
    """
    c = _resolve(config)
    _check_recompute(recompute)
    _count("micro_batch", micro_batch)
    _count("seq_len", seq_len)
    _count("tp", tp)
    _amount("element_bytes", element_bytes, positive=True)
    if c.n_head % tp:
        raise ValueError(f"tp={tp} must divide n_head={c.n_head}")
    e, s, b, t = element_bytes, seq_len, micro_batch, tp
    h, d, f, a = c.d_model, c.head_dim, c.ffn_dim, c.n_head
    n = s * b  # tokens of the micro-batch
    rep = t if sp else 1  # divisor of the parts TP replicates
    hkv = math.ceil(c.kv_heads / t) * d  # K/V width on one rank
    if recompute == "full":
        return e * n * h / rep
    n_hidden = 4 if c.mlp == "swiglu" else 2
    if formula == "paper":
        replicated = 2 * e * h + e * h + e * h + (2 * h if dropout else 0)  # LN inputs, QKV in, MLP in, masks
        split = e * h / t + 2 * e * hkv + e * h / t  # Q, K, V, projection input
        if recompute == "none":
            split += (2 * e + 1) * a * s / t if dropout else e * a * s / t  # softmax (+ mask + dropout out)
        mlp = n_hidden * e * f / t
        if c.n_expert:  # top_k routed experts of f_e, and the shared experts' one MLP of n_s f_e
            mlp = n_hidden * e * (c.top_k + c.n_shared_expert) * c.expert_ffn_dim / t
        return n * (replicated / rep + split + mlp)
    if formula != "adapted":
        raise ValueError(f"formula must be 'paper' or 'adapted', got {formula!r}")
    norm = e * h + 2 * e if c.norm == "layernorm" else 2 * e * h + e
    replicated = 2 * norm + e * h + e * h  # two norms, attention input, MLP input
    kv = e * h / t if c.kv_heads != c.n_head else e * hkv  # GQA saves the repeated K/V
    split = e * h / t + 2 * kv + e * h / t  # q, k, v, SDPA output (= o_proj input without RoPE)
    if c.pos == "rope":
        split += e * h / t  # o_proj input is a contiguous copy of the SDPA output
    if recompute == "none":
        split += 4 * a / t  # logsumexp
    if c.n_expert:
        k = c.top_k
        per_choice = e * (3 * h + n_hidden * c.expert_ffn_dim / t + 1) + 16
        mlp = 8 * k + e * k + k * per_choice + n_hidden * e * c.n_shared_expert * c.expert_ffn_dim / t
    else:
        mlp = n_hidden * e * f / t
    rope = 4 * s * d if c.pos == "rope" else 0
    return n * (replicated / rep + split + mlp) + rope


def model_activation_bytes(config: GPTConfig | str, micro_batch: int, seq_len: int | None = None, *,
                           tp: int = 1, sp: bool = False, recompute: Recompute = "none",
                           formula: Formula = "paper", element_bytes: int = 2, dropout: bool = True,
                           n_layers: int | None = None) -> dict[str, float]:
    """Activations of one micro-batch through the whole model (or ``n_layers`` of it), by part.

    {"layers": n_layers x :func:`layer_activation_bytes`, "embedding": ..., "head": ...}.

    * paper (Korthikanti et al. 2022, Sec. 4.3, with SP): embedding dropout mask s·b·h/t; final layer norm
      input e·s·b·h/t and output-projection input e·s·b·h/t; fp32 logits for the cross-entropy 4·s·b·v/t.
    * adapted (the course's GPT): token ids 8·s·b (+ 8·s position ids when learned); final norm as above;
      lm_head input e·s·b·h; log-softmax output e·s·b·v/t (the model's dtype); targets 8·s·b; NLL's 4-byte
      total weight.
    """
    c = _resolve(config)
    _count("micro_batch", micro_batch)
    _count("seq_len", seq_len, none="the config's seq_len")
    _count("tp", tp)
    _count("n_layers", n_layers, minimum=0, none="all the layers")
    s = c.seq_len if seq_len is None else seq_len
    L = c.n_layer if n_layers is None else n_layers
    layers = L * layer_activation_bytes(c, micro_batch, s, tp=tp, sp=sp, recompute=recompute, formula=formula,
                                        element_bytes=element_bytes, dropout=dropout)
    n, h, v, e = s * micro_batch, c.d_model, c.vocab_size, element_bytes
    rep = tp if sp else 1
    if formula == "paper":
        emb = n * h / rep if dropout else 0.0
        head = 2 * e * n * h / rep + 4 * n * v / tp
    else:
        emb = 8 * n + (8 * s if c.pos == "learned" else 0)
        norm = e * h + 2 * e if c.norm == "layernorm" else 2 * e * h + e
        head = n * (norm + e * h) / rep + e * n * v / tp + 8 * n + 4
    return {"layers": layers, "embedding": float(emb), "head": float(head)}


# ----------------------------------------------------------------------------------------------------------------
# Training budget


TRAINING_CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporary", "communication",
                       "headroom")


def _stage_budget(c: GPTConfig, lay: ParallelLayout, stage: int, pb: ParamBytes, prec: Precision, b: int, s: int,
                  recompute: Recompute, formula: Formula, dropout: bool, headroom: float,
                  bucket_bytes: float) -> dict[str, float]:
    counts = params_per_rank(c, lay, stage)
    dense = counts["embedding"] + counts["blocks"] + counts["head"]
    experts = counts["experts"]
    n_dense, n_expert = lay.dp * lay.cp, lay.dp * lay.cp // lay.ep  # ranks that replicate each parameter
    z = lay.zero

    def shard(count: float, n_shard: int, sharded: bool) -> float:
        return count / n_shard if sharded else count

    parts = dict.fromkeys(TRAINING_CATEGORIES, 0.0)
    parts["parameters"] = pb.params * (shard(dense, n_dense, z >= 3) + shard(experts, n_expert, z >= 3))
    parts["gradients"] = pb.grads * (shard(dense, n_dense, z >= 2) + shard(experts, n_expert, z >= 2))
    parts["optimizer_state"] = pb.optimizer * (shard(dense, n_dense, z >= 1) + shard(experts, n_expert, z >= 1))

    e, t, sp = prec.activation_bytes, lay.tp, lay.sp
    s_loc = s // lay.cp
    n_layers = _layers_per_stage(c.n_layer, lay.pp, lay.split)[stage]
    kw = dict(tp=t, sp=sp, formula=formula, element_bytes=e, dropout=dropout)
    act = model_activation_bytes(c, b, s_loc, recompute=recompute, n_layers=n_layers, **kw)  # type: ignore[arg-type]
    flight = lay.in_flight(stage)
    first, last = stage == 0, stage == lay.pp - 1
    parts["activations"] = flight * (act["layers"] + (act["embedding"] if first else 0) + (act["head"] if last else 0))

    # Temporary buffers: backward works on the gradient of one tensor at a time, about two of the largest
    # tensors of a layer (2·e·n·max(h, k·f/t), all routed tokens at once for MoE); the last stage starts
    # backward with two tensors of logits size (the gradients of the log-softmax and of the logits,
    # 2·e_logits·n·v/t; fp32 logits for the paper, the model's dtype for the course's GPT, which the tracker
    # measures); full recompute re-materialises one layer's activations on top.
    n, h, v, f = b * s_loc, c.d_model, c.vocab_size, c.ffn_dim
    k = c.top_k if c.n_expert else 1
    temp = 2 * e * n * max(h / (t if sp else 1), k * f / t)
    if last:
        temp = max(temp, 2 * (4 if formula == "paper" else e) * n * v / t)
    if recompute == "full":
        temp += layer_activation_bytes(c, b, s_loc, recompute="none", **kw)  # type: ignore[arg-type]
    parts["temporary"] = temp

    # Communication buffers (an order of magnitude): DP/ZeRO-1/2 reduce a gradient bucket while the next one
    # fills (DDP's default gradient_as_bucket_view=False even keeps a second copy of all gradients: not
    # modelled); ZeRO-3 gathers the current and the prefetched block and reduce-scatters one block's gradients;
    # TP/SP all-gathers an activation; PP sends and receives one activation; CP passes K/V blocks; EP
    # dispatches and combines routed tokens.
    comm = 0.0
    dense_block, expert_block = _block_params_rank(c, t)
    block = dense_block + expert_block / lay.ep
    if n_dense > 1:
        grad_total = pb.grads * (dense + experts)
        comm += 2 * pb.params * block + pb.grads * block if z >= 3 else min(2 * bucket_bytes, grad_total)
    if t > 1:
        comm += e * n * h
    if lay.pp > 1:
        comm += 2 * e * n * h / (t if sp else 1)
    if lay.cp > 1:
        comm += 2 * 2 * e * n * math.ceil(c.kv_heads / t) * c.head_dim
    if lay.ep > 1:
        comm += 2 * e * n * k * h
    parts["communication"] = comm
    parts["headroom"] = headroom * sum(parts.values())
    return parts


def training_memory(config: GPTConfig | str, *, precision: str | Precision = "mixed",
                    optimizer: OptimizerName = "adamw", fp32_grad_accum: bool = False, micro_batch: int = 1,
                    seq_len: int | None = None, recompute: Recompute = "none",
                    layout: ParallelLayout | None = None, activation_formula: Formula = "paper",
                    dropout: bool = True, headroom: float = 0.10, bucket_bytes: float = 25 * 2**20,
                    stage: int | None = None) -> MemoryBudget:
    """Peak training memory of the worst GPU, by category (bytes).

    * parameters / gradients / optimizer_state: :func:`bytes_per_param` x parameters per rank
      (:func:`params_per_rank`: TP splits the block matrices and the vocab, PP splits the layers, EP the
      experts), then sharded by ZeRO over the dp x cp ranks as in :func:`zero_memory_per_device`.
    * activations: :func:`model_activation_bytes` for the stage's layers (+ embedding on the first stage,
      head on the last) with s/cp tokens, x the micro-batches in flight (1F1B: first stage min(pp, m);
      AFAB/GPipe: m). ``activation_formula``: "paper" (Korthikanti et al. 2022) or "adapted" (what the
      course's GPT saves). Element size comes from the precision (fp32 = 4, bf16/mixed = 2).
    * temporary and communication buffers: documented orders of magnitude (see the source).
    * headroom: ``headroom`` x the rest (allocator fragmentation, CUDA context, kernels' workspaces).

    With pp > 1 the first and the last stage (every stage, with an uneven ``split``) are evaluated and the
    largest is returned (a note says which);
    ``stage`` asks for one stage instead. The categories are summed as if they peaked together (gradients
    kept during the next forward, as with gradient accumulation): an upper bound for one step.
    """
    c = _resolve(config)
    _count("micro_batch", micro_batch)
    _count("seq_len", seq_len, none="the config's seq_len")
    _amount("headroom", headroom)
    _amount("bucket_bytes", bucket_bytes)
    lay = layout or ParallelLayout()
    s = c.seq_len if seq_len is None else seq_len
    lay.validate(c, s)
    _check_recompute(recompute)
    prec = precision_policy(precision, fp32_grad_accum)
    pb = bytes_per_param(prec, optimizer)
    if stage is not None and not 0 <= stage < lay.pp:
        raise ValueError(f"stage must be in [0, {lay.pp}), got {stage}")
    every = range(lay.pp) if lay.split is not None else sorted({0, lay.pp - 1})  # uneven: any stage may be worst
    stages = list(every) if stage is None else [stage]
    per_stage = {i: _stage_budget(c, lay, i, pb, prec, micro_batch, s, recompute, activation_formula, dropout,
                                  headroom, bucket_bytes) for i in stages}
    worst = max(stages, key=lambda i: sum(per_stage[i].values()))
    label = (f"{c.name} training | {prec.name}/{optimizer} | b={micro_batch} s={s} recompute={recompute} | "
             f"dp={lay.dp} zero={lay.zero} tp={lay.tp}{'+sp' if lay.sp else ''} pp={lay.pp} cp={lay.cp} "
             f"ep={lay.ep} | per GPU")
    notes = [f"activations: {activation_formula} formula"]
    if lay.pp > 1:
        which = "worst pipeline stage" if stage is None else "pipeline stage"
        notes.append(f"{which}: {worst} of {lay.pp} ({lay.schedule}, m={lay.m}, "
                     f"{lay.in_flight(worst)} micro-batch(es) in flight)")
    return MemoryBudget(per_stage[worst], label=label, notes=notes)


# ----------------------------------------------------------------------------------------------------------------
# Inference budget


def kv_cache_bytes(config: GPTConfig | str, tokens: int, batch: int = 1, kv_bytes: float = 2, tp: int = 1,
                   n_layers: int | None = None) -> float:
    """KV cache: 2 (K and V) x L x n_kv_heads x d_head x bytes per token, x tokens x batch.

    Under TP each rank keeps ceil(n_kv_heads / t) heads: divided by t when t divides n_kv_heads; with GQA
    and t > n_kv_heads the KV heads are replicated and the division stops at one head per rank.
    """
    c = _resolve(config)
    _count("tokens", tokens, minimum=0)
    _count("batch", batch)
    _count("tp", tp)
    _count("n_layers", n_layers, minimum=0, none="all the layers")
    _amount("kv_bytes", kv_bytes, positive=True)
    L = c.n_layer if n_layers is None else n_layers
    return 2 * L * math.ceil(c.kv_heads / tp) * c.head_dim * kv_bytes * tokens * batch


INFERENCE_CATEGORIES = ("weights", "kv_cache", "workspace", "communication", "headroom")


def inference_memory(config: GPTConfig | str, *, batch: int = 1, context_len: int | None = None,
                     weight_bytes_per_param: float = 2, kv_bytes: float = 2, tp: int = 1, pp: int = 1,
                     ep: int = 1, prefill_chunk: int | None = None, headroom: float = 0.10) -> MemoryBudget:
    """Peak serving memory of the worst GPU: weights + KV cache + workspace + communication + headroom.

    * weights: :func:`params_per_rank` x ``weight_bytes_per_param`` (bf16 2, int8 1, int4 0.5);
    * kv_cache: :func:`kv_cache_bytes` for ``batch`` sequences of ``context_len`` tokens (prompt + output),
      on the stage's layers;
    * workspace (an order of magnitude): the transient tensors of one layer for the tokens processed at once
      (``prefill_chunk`` x batch; default the whole context), QKV + attention output + MLP hidden, plus the
      fp32 logits of the last position of each sequence;
    * communication: TP all-reduces one activation, PP sends/receives one;
    * headroom: ``headroom`` x the rest.
    """
    c = _resolve(config)
    _count("batch", batch)
    _count("context_len", context_len, none="the config's seq_len")
    _count("prefill_chunk", prefill_chunk, none="the whole context at once")
    _amount("weight_bytes_per_param", weight_bytes_per_param, positive=True)
    _amount("kv_bytes", kv_bytes, positive=True)
    _amount("headroom", headroom)
    ctx = c.seq_len if context_len is None else context_len
    lay = ParallelLayout(tp=tp, pp=pp, ep=ep, dp=ep)  # expert-parallel ranks serve as replicas of the dense part
    lay.validate(c, ctx)
    worst: dict[str, float] | None = None
    chunk = ctx if prefill_chunk is None else prefill_chunk
    h, d, f, v = c.d_model, c.head_dim, c.ffn_dim, c.vocab_size
    e = 2
    T = chunk * batch
    for stage in sorted({0, pp - 1}):
        counts = params_per_rank(c, lay, stage)
        n_layers = _layers_per_stage(c.n_layer, pp)[stage]
        parts = dict.fromkeys(INFERENCE_CATEGORIES, 0.0)
        parts["weights"] = weight_bytes_per_param * sum(counts.values())
        parts["kv_cache"] = kv_cache_bytes(c, ctx, batch, kv_bytes, tp, n_layers)
        n_in = 2 if c.mlp == "swiglu" else 1
        k = c.top_k if c.n_expert else 1
        hkv = math.ceil(c.kv_heads / tp) * d
        logits = 4 * batch * v / tp if stage == pp - 1 else 0
        parts["workspace"] = e * T * (h + (h / tp + 2 * hkv) + h / tp + k * n_in * f / tp) + logits
        parts["communication"] = (e * T * h if tp > 1 else 0) + (2 * e * T * h if pp > 1 else 0)
        parts["headroom"] = headroom * sum(parts.values())
        if worst is None or sum(parts.values()) > sum(worst.values()):
            worst = parts
    assert worst is not None
    label = (f"{c.name} inference | weights {weight_bytes_per_param} B/param, KV {kv_bytes} B | batch={batch} "
             f"context={ctx} | tp={tp} pp={pp} ep={ep} | per GPU")
    return MemoryBudget(worst, label=label)
