"""Memory budgets per GPU: what the formulas predict, and what a run really holds.

Two budgets (as Viacheslav Dubrov's "Scaling LLMs with multi-GPU and multi-node parallelism" separates them):

* **training** peak = parameters + gradients + optimizer state + saved activations + temporary buffers
  + communication buffers + allocator headroom;
* **inference** peak = resident weights + KV cache + runtime workspace + communication buffers + headroom.

The estimators take a :class:`~course_lib.model_config.GPTConfig` (a preset with real shapes or a tiny one; MHA or
GQA; dense or MoE), a precision policy, an optimizer, a micro-batch and a parallel layout, and return a
:class:`~course_lib.estimates.memory_budget.MemoryBudget`: bytes per GPU by category, a read-only mapping with
``.total`` and a readable ``str``. Their parts, each with its formula and source: bytes per parameter and ZeRO's
sharding (``course_lib.estimates.model_states``), the parameters each rank holds (``course_lib.estimates.layout``), the
saved activations
(``course_lib.estimates.activation_memory``).

:class:`course_lib.measure.memtrack.MemoryTracker` measures the same categories inside a process, so that the estimate
for the course's tiny GPT can be checked against what PyTorch really allocates.
"""

from __future__ import annotations

import math

from course_lib.estimates.activation_memory import (
    Formula,
    Recompute,
    check_recompute,
    layer_activation_bytes,
    model_activation_bytes,
)
from course_lib.estimates.layout import ParallelLayout, block_params_per_rank, params_per_rank
from course_lib.estimates.memory_budget import MemoryBudget, check_amount, check_count
from course_lib.estimates.model_states import OptimizerName, ParamBytes, Precision, bytes_per_param, precision_policy
from course_lib.model_config import GPTConfig, resolve
from course_lib.parallel.pp_layers import layer_split

__all__ = ["INFERENCE_CATEGORIES", "TRAINING_CATEGORIES", "inference_memory", "kv_cache_bytes", "training_memory"]

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
    z = lay.zero_stage

    def shard(count: float, n_shard: int, sharded: bool) -> float:
        return count / n_shard if sharded else count

    parts = dict.fromkeys(TRAINING_CATEGORIES, 0.0)
    parts["parameters"] = pb.params * (shard(dense, n_dense, z >= 3) + shard(experts, n_expert, z >= 3))
    parts["gradients"] = pb.grads * (shard(dense, n_dense, z >= 2) + shard(experts, n_expert, z >= 2))
    parts["optimizer_state"] = pb.optimizer * (shard(dense, n_dense, z >= 1) + shard(experts, n_expert, z >= 1))

    e, t, sp = prec.activation_bytes, lay.tp, lay.sp
    s_loc = s // lay.cp
    n_layers = layer_split(c.n_layer, lay.pp, lay.split)[stage]
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
    dense_block, expert_block = block_params_per_rank(c, t)
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


_FORMULA_NOTES = {"adapted": "flash attention, no s x s scores (adapted formula)",
                  "paper": "Korthikanti et al. 2022, s x s scores stored (paper formula)"}


def training_memory(config: GPTConfig | str, *, precision: str | Precision = "mixed",
                    optimizer: OptimizerName = "adamw", fp32_grad_accum: bool = False, micro_batch: int = 1,
                    seq_len: int | None = None, recompute: Recompute = "none",
                    layout: ParallelLayout | None = None, activation_formula: Formula = "adapted",
                    dropout: bool = True, headroom: float = 0.10, bucket_bytes: float = 25 * 2**20,
                    stage: int | None = None) -> MemoryBudget:
    """Peak training memory of the worst GPU, by category (bytes).

    * parameters / gradients / optimizer_state: :func:`bytes_per_param` x parameters per rank
      (:func:`params_per_rank`: TP splits the block matrices and the vocab, PP splits the layers, EP the
      experts), then sharded by ZeRO over the dp x cp ranks as in :func:`zero_memory_per_device`.
    * activations: :func:`model_activation_bytes` for the stage's layers (+ embedding on the first stage,
      head on the last) with s/cp tokens, x the micro-batches in flight (1F1B: first stage min(pp, m);
      AFAB/GPipe: m). ``activation_formula``: "adapted" (the default: what a block saves with a flash
      attention kernel, FlashAttention or SDPA, which keeps no s x s score matrix, and no dropout; what the
      course's GPT saves and what the planner prices) or "paper" (Korthikanti et al. 2022's Table 2: the
      softmax scores, their dropout mask and output, the 2022 baseline). Element size comes from the precision
      (fp32 = 4, bf16/mixed = 2).
    * temporary and communication buffers: documented orders of magnitude (see the source).
    * headroom: ``headroom`` x the rest (allocator fragmentation, CUDA context, kernels' workspaces).

    With pp > 1 the first and the last stage (every stage, with an uneven ``split``) are evaluated and the
    largest is returned (a note says which);
    ``stage`` asks for one stage instead. The categories are summed as if they peaked together (gradients
    kept during the next forward, as with gradient accumulation): an upper bound for one step.
    """
    c = resolve(config)
    check_count("micro_batch", micro_batch)
    check_count("seq_len", seq_len, none="the config's seq_len")
    check_amount("headroom", headroom)
    check_amount("bucket_bytes", bucket_bytes)
    lay = layout or ParallelLayout()
    s = c.seq_len if seq_len is None else seq_len
    lay.validate(c, s)
    check_recompute(recompute)
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
             f"dp={lay.dp} zero={lay.zero_stage} tp={lay.tp}{'+sp' if lay.sp else ''} pp={lay.pp} cp={lay.cp} "
             f"ep={lay.ep} | per GPU")
    notes = [f"activations: {_FORMULA_NOTES[activation_formula]}"]
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
    c = resolve(config)
    check_count("tokens", tokens, minimum=0)
    check_count("batch", batch)
    check_count("tp", tp)
    check_count("n_layers", n_layers, minimum=0, none="all the layers")
    check_amount("kv_bytes", kv_bytes, positive=True)
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
    c = resolve(config)
    check_count("batch", batch)
    check_count("context_len", context_len, none="the config's seq_len")
    check_count("prefill_chunk", prefill_chunk, none="the whole context at once")
    check_amount("weight_bytes_per_param", weight_bytes_per_param, positive=True)
    check_amount("kv_bytes", kv_bytes, positive=True)
    check_amount("headroom", headroom)
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
        n_layers = layer_split(c.n_layer, pp)[stage]
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
