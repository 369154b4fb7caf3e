"""How a training job is split over GPUs (``ParallelLayout``), and the parameters each rank then holds.

The layout is the estimators' (``course_lib.estimates.memory``, the planner, the serving budget); a composed run's
mesh is ``course_lib.parallel.config.ParallelConfig``. ``params_per_rank`` counts a rank's parameters before any ZeRO
sharding: tensor parallelism splits the block matrices and the vocabulary, pipeline parallelism the layers
(``course_lib.parallel.pp_layers.layer_split``, the runtime's rule), expert parallelism the experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from course_lib.model_config import GPTConfig, dense_twin, norm_params, resolve
from course_lib.parallel.pp_layers import layer_split
from course_lib.parallel.schedules import SCHEDULE_ALIASES, canonical_schedule
from course_lib.parallel.zero import check_stage

__all__ = ["ParallelLayout", "block_params_per_rank", "params_per_rank"]


@dataclass(frozen=True)
class ParallelLayout:
    """How one training job is split. World size = dp x cp x tp x pp.

    * ``dp`` data-parallel ranks with ZeRO stage ``zero_stage`` 0..3. Context-parallel ranks hold the same weights,
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
    * ``dense``: per stage, how many of its blocks are dense MLPs of d_ff in an MoE model (the leading dense
      blocks of DeepSeek-V3 and Kimi K2; ``model_config.dense_twin``); None: every block as the config says.
    """

    dp: int = 1
    zero_stage: int = 0
    tp: int = 1
    sp: bool = False
    pp: int = 1
    schedule: Literal["1f1b", "afab"] = "1f1b"
    microbatches: int | None = None
    cp: int = 1
    ep: int = 1
    split: tuple[int, ...] | None = None
    dense: tuple[int, ...] | None = None

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
        check_stage(self.zero_stage)
        if self.schedule not in SCHEDULE_ALIASES or canonical_schedule(self.schedule) not in ("one_f_one_b", "gpipe"):
            raise ValueError(f"schedule must be '1f1b' or 'afab', got {self.schedule!r}")
        if self.m < 1:
            raise ValueError("microbatches must be >= 1")
        if c.n_head % self.tp:
            raise ValueError(f"tp={self.tp} must divide n_head={c.n_head}")
        if c.kv_heads % self.tp and self.tp % c.kv_heads:
            raise ValueError(f"tp={self.tp} and n_kv_head={c.kv_heads}: one must divide the other")
        blocks = layer_split(c.n_layer, self.pp, self.split)  # the runtime's rule: pp divides n_layer, or a split
        if self.dense is not None and (not c.n_expert or not _dense_fits(self.dense, tuple(blocks))):
            raise ValueError(f"dense={self.dense}: one count per stage (pp={self.pp}), each between 0 and the "
                             f"stage's blocks {tuple(blocks)}, and only for a mixture-of-experts model")
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


@lru_cache(maxsize=10_000)
def _dense_fits(dense: tuple[int, ...], blocks: tuple[int, ...]) -> bool:
    """One count of dense blocks per stage, each between 0 and the stage's blocks."""
    return len(dense) == len(blocks) and all(0 <= d <= n for d, n in zip(dense, blocks, strict=True))


def block_params_per_rank(c: GPTConfig, tp: int) -> tuple[float, float]:
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
    the embedding (Megatron all-reduces the two copies' gradients). ``experts`` are n_expert/ep per rank of
    each MoE block; a dense block (``layout.dense``) counts its MLP of d_ff in ``blocks``.
    With tp = pp = ep = 1 the sum equals ``param_count(config)``.
    """
    c = resolve(config)
    lay = layout or ParallelLayout()
    lay.validate(c)
    if not 0 <= stage < lay.pp:
        raise ValueError(f"stage must be in [0, {lay.pp}), got {stage}")
    h, v, t = c.d_model, c.vocab_size, lay.tp
    n_layers = layer_split(c.n_layer, lay.pp, lay.split)[stage]
    dense, experts = block_params_per_rank(c, t)
    n_dense = lay.dense[stage] if lay.dense else 0
    plain = block_params_per_rank(dense_twin(c), t)[0] if n_dense else 0.0
    word = math.ceil(v / t) * h
    emb = (word + (c.seq_len * h if c.pos == "learned" else 0)) if stage == 0 else 0
    head = 0.0
    if stage == lay.pp - 1:
        head = norm_params(c) + (word if (not c.tie_embeddings or lay.pp > 1) else 0)
    return {"embedding": float(emb), "blocks": (n_layers - n_dense) * dense + n_dense * plain,
            "experts": (n_layers - n_dense) * experts / lay.ep,
            "head": float(head)}

