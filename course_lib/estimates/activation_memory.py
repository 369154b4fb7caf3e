"""Activation bytes a transformer layer saves for backward: the paper's accounting and what the course's GPT saves.

Per transformer layer, 16-bit, with dropout (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Sec. 4 and Table 2; s sequence, b micro-batch, h hidden, a heads, t tensor-parallel size):
no parallelism sbh(34 + 5as/h); tensor parallel sbh(10 + 24/t + 5as/(ht)); tensor + sequence parallel
(sbh/t)(34 + 5as/h); selective recomputation drops the 5as/h term; full recomputation keeps only the layer input,
2sbh. All sizes in bytes.
"""

from __future__ import annotations

import math
from typing import Literal

from course_lib.estimates.memory_budget import check_amount, check_count
from course_lib.model_config import GPTConfig, resolve

__all__ = [
    "Formula",
    "Recompute",
    "activation_bytes_paper",
    "check_recompute",
    "layer_activation_bytes",
    "model_activation_bytes",
]

Recompute = Literal["none", "selective", "full"]
Formula = Literal["paper", "adapted"]


def activation_bytes_paper(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                           recompute: Recompute = "none") -> float:
    """Activation bytes of ONE transformer layer, exactly Korthikanti et al. 2022, Table 2 (16-bit, dropout).

    * no recompute: TP only sbh(10 + 24/t + 5as/(ht)) (t = 1 gives sbh(34 + 5as/h)); TP+SP (sbh/t)(34 + 5as/h)
    * selective recompute: the same without the 5as/h term: sbh(10 + 24/t), (sbh/t)34
    * full recompute: 2sbh (only the layer's input is kept)
    """
    check_recompute(recompute)
    for name, value in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t)):
        check_count(name, value)
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh
    attn = 5 * a * s / h if recompute == "none" else 0.0
    if sp:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)


def check_recompute(recompute: str) -> None:
    """``recompute`` must be "none", "selective" or "full" (what is recomputed in backward, not saved)."""
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
    c = resolve(config)
    check_recompute(recompute)
    check_count("micro_batch", micro_batch)
    check_count("seq_len", seq_len)
    check_count("tp", tp)
    check_amount("element_bytes", element_bytes, positive=True)
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
    c = resolve(config)
    check_count("micro_batch", micro_batch)
    check_count("seq_len", seq_len, none="the config's seq_len")
    check_count("tp", tp)
    check_count("n_layers", n_layers, minimum=0, none="all the layers")
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

