"""Tensor (and sequence) parallelism as an in-place transform: ``apply_tp(model, group, plan)``.

Megatron-LM (Shoeybi et al. 2019, arXiv:1909.08053) splits each layer's matrices over the t ranks:
q/k/v and the MLP's first linear column-parallel, the output projections row-parallel, so a block
costs one f and one g per region: 2 all-reduces of b*s*h forward and 2 backward. The embedding is
split by vocabulary rows, the loss is the vocab-parallel cross-entropy (3 all-reduces of b*s
scalars, not a gather of b*s*V logits). Sequence parallelism (Korthikanti et al. 2022,
arXiv:2205.05198) shards the norms between regions along the sequence: f/g become an all-gather /
reduce-scatter of the same bytes and those activations shrink t-fold.

The **plan** is data (as DTensor's ``parallelize_module``, torchtitan's): module pattern -> a name
of ``STYLES`` or a builder ``(module, group, sequence_parallel) -> replacement or None``. Each layer
records its parameters' placements on "tp" (``Shard`` for slices, ``Partial()`` for replicated
weights whose gradient is a share: norms under SP, replicated K/V); data parallelism sums those
over tp. Layers: ``tp_layers``; f and g: ``tp_comm``. Chapter 04 builds them in the notebook first.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping

from torch import nn

from course_lib import comm
from course_lib.layers import MLP, Attention
from course_lib.model_config import GPTConfig
from course_lib.parallel.contract import broadcast_from_first, require_member
from course_lib.parallel.placement import Partial, Replicate, placements_of, set_placement
from course_lib.parallel.tp_layers import (
    TP_AXIS,
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelPositionEmbedding,
    TensorParallelAttention,
    TensorParallelMLP,
    VocabParallelEmbedding,
    place,
)

Builder = Callable[[nn.Module, comm.Group, bool], "nn.Module | None"]


def _need(m: nn.Module, kind: type, style: str) -> None:
    if not isinstance(m, kind):
        raise ValueError(f"plan style {style!r} needs {kind.__name__}, got {type(m).__name__}")


def column(m: nn.Module, group: comm.Group, sp: bool) -> nn.Module:
    """``nn.Linear`` -> ``ColumnParallelLinear`` (f or all-gather in, output features sharded)."""
    _need(m, nn.Linear, "column")
    return ColumnParallelLinear.from_linear(m, group, sequence_parallel=sp)


def row(m: nn.Module, group: comm.Group, sp: bool) -> nn.Module:
    """``nn.Linear`` -> ``RowParallelLinear`` (input features sharded, g or reduce-scatter out)."""
    _need(m, nn.Linear, "row")
    return RowParallelLinear.from_linear(m, group, sequence_parallel=sp)


def vocab(m: nn.Module, group: comm.Group, sp: bool) -> nn.Module:
    """An ``nn.Embedding`` -> ``VocabParallelEmbedding``."""
    _need(m, nn.Embedding, "vocab")
    return VocabParallelEmbedding(m, group, sequence_parallel=sp)


def attention(m: nn.Module, group: comm.Group, sp: bool) -> nn.Module:
    """The course's ``Attention`` -> ``TensorParallelAttention`` (by heads, one f in, one g out)."""
    _need(m, Attention, "attention")
    return TensorParallelAttention(m, group, sequence_parallel=sp)


def mlp(m: nn.Module, group: comm.Group, sp: bool) -> nn.Module:
    """The course's ``MLP`` -> ``TensorParallelMLP`` (column then row)."""
    _need(m, MLP, "mlp")
    return TensorParallelMLP(m, group, sequence_parallel=sp)


def sequence(m: nn.Module, group: comm.Group, sp: bool) -> nn.Module | None:
    """A norm (or the learned position embedding) between regions: kept and replicated; under SP
    it sees s/t tokens, so its gradient is a partial sum (recorded ``Partial()``)."""
    if not sp:
        return None
    if isinstance(m, nn.Embedding):
        return SequenceParallelPositionEmbedding(m, group)
    place(m, Partial())
    return None


STYLES: dict[str, Builder] = {"column": column, "row": row, "vocab": vocab, "attention": attention,
                              "mlp": mlp, "sequence": sequence}


def gpt_plan(config: GPTConfig) -> dict[str, str]:
    """The course's GPT's plan: vocab-parallel embedding, attention by heads, MLP column -> row,
    norms (and learned positions) as sequence-parallel regions, the LM head column-parallel over the
    vocabulary. MoE layers stay replicated over tp (no expert tensor parallelism)."""
    plan = {"tok_emb": "vocab"}
    if config.pos == "learned":
        plan["pos_emb"] = "sequence"
    plan |= {"blocks.*.norm1": "sequence", "blocks.*.attn": "attention",
             "blocks.*.norm2": "sequence", "blocks.*.mlp": "mlp", "norm_f": "sequence",
             "lm_head": "column"}
    if config.n_expert:
        del plan["blocks.*.mlp"]
    return plan


def apply_tp(model: nn.Module, group: comm.Group,
             plan: Mapping[str, str | Builder] | None = None, *, sequence_parallel: bool = False,
             sp_matmul: Callable | None = None, broadcast: bool = True) -> None:
    """Tensor parallelism of ``model`` over ``group``, in place: the weights made equal over the
    group (``broadcast``), then each module matching a pattern of ``plan`` (default ``gpt_plan``)
    replaced by its style's layer holding this rank's slices; what no style changed is recorded
    ``Replicate()`` on "tp". ``sp_matmul``: under SP, the column-parallel GEMMs' function
    (``tp_overlap.collective_matmul``)."""
    if plan is None:
        if not isinstance(getattr(model, "config", None), GPTConfig):
            raise ValueError("plan= is required for modules other than course_lib.model.GPT")
        plan = gpt_plan(model.config)
    require_member(group, "apply_tp")
    if broadcast:
        broadcast_from_first(model, group)
    names = [n for n, _ in model.named_modules() if n]
    for pattern, style in plan.items():
        build = STYLES.get(style) if isinstance(style, str) else style
        if build is None:
            raise ValueError(f"unknown plan style {style!r}: use one of {sorted(STYLES)} "
                             "or a builder")
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise ValueError(f"plan entry {pattern!r} matches no module "
                             f"(modules: {', '.join(names[:8])}, ...)")
        for name in matched:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            try:
                new = build(getattr(parent, attr), group, sequence_parallel)
            except ValueError as e:  # say which module the plan could not split
                raise type(e)(f"{name!r}: {e}") from None
            if new is not None:
                setattr(parent, attr, new)
    if sp_matmul is not None:
        for m in model.modules():
            if hasattr(m, "sp_matmul"):
                m.sp_matmul = sp_matmul
    head, emb = getattr(model, "lm_head", None), getattr(model, "tok_emb", None)
    if getattr(getattr(model, "config", None), "tie_embeddings", False) and head is not None:
        if not (isinstance(head, ColumnParallelLinear) and isinstance(emb, VocabParallelEmbedding)):
            raise ValueError("tied embeddings need tok_emb 'vocab' and lm_head 'column' "
                             "in the plan")
        head.weight = emb.weight  # both hold the same vocabulary rows
    for p in model.parameters():
        if TP_AXIS not in placements_of(p):
            set_placement(p, TP_AXIS, Replicate())
