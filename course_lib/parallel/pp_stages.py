"""The pipeline's plan (which blocks each (virtual) stage holds, on which rank) and its stages: a
GPT, an ``nn.Sequential`` [first, *blocks, last] or ``PipelineParts`` cut up. ``pp`` runs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.parallel import schedules as S
from course_lib.parallel.pp_layers import layer_split, stage_layers
from course_lib.parallel.schedules import Schedule, add_send_recv, validate

# ----------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PipelinePlan:
    """Everything every rank must agree on: degree p, chunks per rank v, micro-batches m, the layers
    of each stage and the schedule, with its transfers (``actions[r]`` is rank r's list)."""

    p: int
    v: int
    m: int
    schedule: str
    split: list[int]
    layers: list[range]
    micro_batch: int  # rows per micro-batch (0 when the plan was made without a global batch)
    actions: Schedule

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank ``rank`` holds: r, r + p, ... (Megatron's interleaved placement)."""
        return list(range(rank, self.n_stages, self.p))

    def rank_of(self, stage: int) -> int:
        return stage % self.p

    def with_actions(self, actions: Schedule) -> PipelinePlan:
        """The same plan running ``actions`` (the schedule with its ``REDUCE_GRAD`` actions)."""
        return dataclasses.replace(self, actions=actions)


def plan_pipeline(cfg: GPTConfig | int, p: int, schedule: str | Schedule = "1f1b",
                  microbatches: int = 4, v: int = 1, split: Sequence[int] | None = None,
                  global_batch: int | None = None) -> PipelinePlan:
    """Check the arguments (clear ``ValueError`` s) and build the plan. ``cfg``: the GPT's config,
    or another model's block count. ``schedule``: a name (``S.SCHEDULE_ALIASES``) or a compute-only
    schedule (``list[list[Action]]``) of p ranks, m micro-batches, v chunks per rank."""
    S.check_positive(p=p, microbatches=microbatches, v=v)
    m = microbatches
    if isinstance(schedule, str):
        name = S.canonical_schedule(schedule)
        if name != "interleaved_one_f_one_b" and v != 1:
            raise ValueError(f"{name} has one stage per rank, so v must be 1 (got v={v}); "
                             "interleaving v model chunks per rank needs schedule='interleaved'")
        if name == "interleaved_one_f_one_b" and m % p:
            raise ValueError("interleaved 1F1B sends micro-batches through each model chunk in "
                             "groups of p, so m must be a multiple of p (m >= p): got "
                             f"m={m} micro-batches for p={p} stages")
        build = getattr(S, name)
        compute = build(p, m, v) if name == "interleaved_one_f_one_b" else build(p, m)
    else:
        name, compute = "custom", [list(rank) for rank in schedule]
        validate(compute, p, m, v)
    n_layer = cfg if isinstance(cfg, int) else cfg.n_layer
    if not isinstance(cfg, int) and cfg.tie_embeddings and p * v > 1:
        raise ValueError("tie_embeddings=True puts one weight on the first and the last stage: its "
                         "gradient would need an all-reduce between those ranks (Megatron's "
                         "embedding group), which this executor does not do; use an untied model")
    if global_batch is not None and global_batch % m:
        raise ValueError(f"the global batch of {global_batch} rows does not split into m={m} "
                         f"equal micro-batches: choose m dividing {global_batch}")
    counts = layer_split(n_layer, p * v, split)
    actions = add_send_recv(compute) if p > 1 else compute
    micro = global_batch // m if global_batch is not None else 0
    return PipelinePlan(p, v, m, name, counts, stage_layers(counts), micro, actions)


# --------------------------------------------------------------------------------------- the stages


@dataclass
class PipelineParts:
    """A model as the pipeline cuts it: ``first`` (token ids -> hidden states, stage 0), ``blocks``
    (split between the stages), ``last`` (hidden states -> logits, last stage)."""

    first: nn.Module
    blocks: Sequence[nn.Module]
    last: nn.Module


class _GPTEmbedding(nn.Module):
    """A GPT's embedding as a module (``GPT.embed``: token + learned position embeddings)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return GPT.embed(self, idx)  # the full model's code (it reads only tok_emb, pos_emb)


class _GPTHead(nn.Module):
    """A GPT's final norm and LM head as a module of its own (``GPT.head``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.norm_f, self.lm_head = model.norm_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return GPT.head(self, x)


def pipeline_parts(model: nn.Module | PipelineParts) -> PipelineParts:
    """Cut ``model`` into first part, blocks, last part: an ``nn.Sequential`` is [first, *blocks,
    last]; a GPT (``embed`` / ``blocks`` / ``head``) is embeddings, blocks, final norm + head."""
    if isinstance(model, PipelineParts):
        return model
    if isinstance(model, nn.Sequential):
        if len(model) < 3:
            raise ValueError("an nn.Sequential to pipeline needs [first, blocks..., last]: got "
                             f"{len(model)} modules")
        return PipelineParts(model[0], list(model)[1:-1], model[-1])
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, (nn.ModuleList, nn.Sequential)) and hasattr(model, "tok_emb"):
        return PipelineParts(_GPTEmbedding(model), list(model.blocks), _GPTHead(model))
    raise TypeError(f"cannot cut a {type(model).__name__} into pipeline stages: give an "
                    "nn.Sequential [first, *blocks, last], a GPT, or "
                    "PipelineParts(first, blocks, last)")


def shares_weights(first: nn.Module, last: nn.Module) -> bool:
    """Whether ``first`` and ``last`` hold the same parameter (tied embeddings)."""
    return bool({id(p) for p in first.parameters()} & {id(p) for p in last.parameters()})


class Stage(nn.Module):
    """One (virtual) stage of ``model`` (a GPT, an ``nn.Sequential`` or ``PipelineParts``): [first
    part] -> its blocks -> [last part]. ``blocks`` is a ``ModuleDict`` keyed by global block index;
    a GPT's stage holds ``tok_emb`` / ``pos_emb`` / ``norm_f`` / ``lm_head`` under those names, so
    its ``named_parameters()`` are the GPT's own (``blocks.3.attn.q_proj.weight``); other models'
    stages hold ``first`` / ``last``. ``forward(x)`` is the whole stage (what torch's
    ``PipelineStage`` wraps); the executor calls ``embed`` and ``body`` separately."""

    def __init__(self, model: nn.Module | PipelineParts, index: int, n_stages: int,
                 layers: range) -> None:
        super().__init__()
        parts = pipeline_parts(model)
        self.index, self.n_stages, self.layers = index, n_stages, layers
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.first: nn.Module | None = None  # None: a GPT's parts, held under the GPT's names
        self.last: nn.Module | None = None
        if self.is_first:
            if isinstance(parts.first, _GPTEmbedding):
                self.tok_emb, self.pos_emb = parts.first.tok_emb, parts.first.pos_emb
            else:
                self.first = parts.first
        self.blocks = nn.ModuleDict({str(i): parts.blocks[i] for i in layers})
        if self.is_last:
            if isinstance(parts.last, _GPTHead):
                self.norm_f, self.lm_head = parts.last.norm_f, parts.last.lm_head
            else:
                self.last = parts.last

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return GPT.embed(self, idx) if self.first is None else self.first(idx)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        """Blocks then (last stage) last part: hidden states in, hidden states or logits out."""
        for block in self.blocks.values():
            x = block(x)
        if not self.is_last:
            return x
        return GPT.head(self, x) if self.last is None else self.last(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(x) if self.is_first else x)

    def embedding_parameters(self) -> list[nn.Parameter]:
        if not self.is_first:
            return []
        modules = ([self.first] if self.first is not None
                   else [m for m in (self.tok_emb, self.pos_emb) if m is not None])
        return [p for m in modules for p in m.parameters() if p.requires_grad]

    def body_parameters(self) -> list[nn.Parameter]:
        emb = {id(p) for p in self.embedding_parameters()}
        return [p for p in self.parameters() if p.requires_grad and id(p) not in emb]


def named_subset(model: nn.Module, modules: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """Detached fp32 copies of ``model``'s parameters (by its names) that live in ``modules``."""
    mine = {id(p) for m in modules for p in m.parameters()}
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()
            if id(p) in mine}


def build_stages(cfg: GPTConfig, plan: PipelinePlan, rank: int, seed: int = 0,
                 model: nn.Module | None = None) -> dict[int, Stage]:
    """This rank's stages, by stage index, cut from ``model`` (default ``GPT(cfg, seed)``: the same
    initial weights as the baseline)."""
    model = GPT(cfg, seed=seed) if model is None else model
    return {s: Stage(model, s, plan.n_stages, plan.layers[s]) for s in plan.stages_of(rank)}
