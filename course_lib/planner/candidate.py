"""The planner's search space: a cluster, one candidate (its mesh, ZeRO stage, micro-batch, recomputation and
pipeline schedule) and which candidates the search leaves out (``refusal``).

A candidate's stages hold ``pp_layers.ends_split`` blocks (equal when they divide) and its vocabulary is padded
as Megatron-LM pads it (``padded_vocab``); ``Candidate.layout`` is the ``memory.ParallelLayout`` the memory
model prices.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal

from course_lib.estimates.activation_memory import Recompute
from course_lib.estimates.hardware import GPU, Link
from course_lib.estimates.layout import ParallelLayout
from course_lib.model_config import GPTConfig
from course_lib.parallel.config import ZERO_WITH_PIPELINE
from course_lib.parallel.pp_layers import ends_split
from course_lib.runtime.mesh import MeshShape

Schedule = Literal["1f1b", "interleaved", "zb_h1"]
SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved", "zb_h1")
_COST_NAME = {"1f1b": "one_f_one_b", "interleaved": "interleaved_one_f_one_b", "zb_h1": "zb_h1"}

VOCAB_MULTIPLE = 128
"""Megatron-LM's ``--make-vocab-size-divisible-by`` default: the vocabulary is padded to a multiple of 128 x tp."""


@lru_cache(maxsize=1_000)
def padded_config(cfg: GPTConfig, tp: int) -> GPTConfig:
    """``cfg`` with its vocabulary padded for ``tp`` (``padded_vocab``): the model each TP degree trains."""
    return replace(cfg, vocab_size=padded_vocab(cfg.vocab_size, tp))


def padded_vocab(vocab_size: int, tp: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """The vocabulary Megatron-LM trains: ``vocab_size`` rounded up to a multiple of ``multiple`` x ``tp``
    (50257 at tp 8 -> 51200), so that every TP rank holds an equal, aligned slice of the embedding and head."""
    step = multiple * tp
    return -(-vocab_size // step) * step


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` GPUs; ``intra`` links GPUs of one node, ``inter`` is each GPU's share of the
    network between nodes (a DGX H100 has one 400 Gb/s NIC per GPU); ``source`` says where the node's shape
    comes from (each link's own numbers have theirs in ``hardware.LINKS``)."""

    name: str
    nodes: int
    gpus_per_node: int
    gpu: GPU
    intra: Link
    inter: Link
    source: str = ""

    def __post_init__(self) -> None:
        for what in ("nodes", "gpus_per_node"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Cluster {self.name!r}: {what} must be an int >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_nodes(self, nodes: int) -> Cluster:
        return replace(self, nodes=nodes)


@dataclass(frozen=True)
class Candidate:
    """One way to run the job. ``sp`` (sequence parallelism) is on whenever tp > 1, as Megatron recommends;
    ``schedule`` "1f1b", "interleaved" (``v`` model chunks per rank) or "zb_h1"; the blocks per (virtual) stage
    are ``pp_layers.ends_split`` (equal when they divide)."""

    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1
    zero_stage: int = 1
    micro_batch: int = 1
    recompute: Recompute = "selective"
    schedule: Schedule = "1f1b"
    v: int = 1

    @property
    def shape(self) -> MeshShape:
        return _shape(self.dp, self.tp, self.pp, self.cp, self.ep)

    @property
    def schedule_label(self) -> str:
        return f"interleaved v={self.v}" if self.schedule == "interleaved" else self.schedule

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches each pipeline runs per step: global batch / (dp x micro-batch)."""
        return global_batch // (self.dp * self.micro_batch)

    def split(self, n_layer: int) -> list[int]:
        """Blocks per virtual stage (pp x v of them), ``pp_layers.ends_split``: what ``apply_pp(split=...)`` cuts."""
        return ends_split(n_layer, self.pp * self.v)

    def rank_layers(self, n_layer: int) -> list[int]:
        """Blocks each pipeline rank holds: its v chunks r, r + p, ... (Megatron-LM's interleaving)."""
        return list(_rank_layers(self.pp, self.v, n_layer))

    def layout(self, global_batch: int, n_layer: int, dense_layers: int = 0) -> ParallelLayout:
        """The ``layout.ParallelLayout`` of this candidate: its degrees, ZeRO stage, m, blocks per rank and, of an
        MoE model whose first ``dense_layers`` blocks are dense, how many of those each rank holds."""
        return _layout(self.dp, self.zero_stage, self.tp, self.pp, self.cp, self.ep, self.v,
                       self.microbatches(global_batch), n_layer, dense_layers)

    def __str__(self) -> str:
        extra = "".join([f" {k}={getattr(self, k)}" for k in ("cp", "ep") if getattr(self, k) > 1])
        sched = f" {self.schedule_label}" if self.pp > 1 else ""
        return (f"dp={self.dp} tp={self.tp} pp={self.pp}{extra} zero={self.zero_stage} mb={self.micro_batch} "
                f"recompute={self.recompute}{sched}")


@lru_cache(maxsize=10_000)
def _rank_layers(pp: int, v: int, n_layer: int) -> tuple[int, ...]:
    split = ends_split(n_layer, pp * v)
    return tuple(sum(split[r::pp]) for r in range(pp))


@lru_cache(maxsize=10_000)
def rank_dense_layers(pp: int, v: int, n_layer: int, dense_layers: int) -> tuple[int, ...]:
    """Per pipeline rank, how many of the first ``dense_layers`` blocks it holds (its chunks r, r + p, ... of
    ``ends_split``)."""
    out, start = [0] * pp, 0
    for j, n in enumerate(ends_split(n_layer, pp * v)):
        out[j % pp] += max(0, min(start + n, dense_layers) - start)
        start += n
    return tuple(out)


@lru_cache(maxsize=10_000)
def _shape(dp: int, tp: int, pp: int, cp: int, ep: int) -> MeshShape:
    return MeshShape(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)


@lru_cache(maxsize=100_000)
def _layout(dp: int, zero: int, tp: int, pp: int, cp: int, ep: int, v: int, m: int, n_layer: int,
            dense_layers: int = 0) -> ParallelLayout:
    layers = _rank_layers(pp, v, n_layer)
    return ParallelLayout(dp=dp, zero_stage=zero, tp=tp, sp=tp > 1, pp=pp, microbatches=m, cp=cp, ep=ep,
                          split=None if len(set(layers)) == 1 else layers,
                          dense=rank_dense_layers(pp, v, n_layer, dense_layers) if dense_layers else None)


def refusal(cfg: GPTConfig, cand: Candidate, m: int) -> str:
    """Why the search leaves ``cand`` out ("" when it does not): combinations the libraries refuse or the
    schedule cannot run. ZeRO-2 with a pipeline: the course library's own rule and message
    (``parallel.config.ZERO_WITH_PIPELINE``: a stage's gradients are whole until its last micro-batch, so
    ZeRO-2 saves nothing over ZeRO-1 there, and DeepSpeed's pipeline engine runs ZeRO-1 only). ZeRO-3 with a
    pipeline is planned in torchtitan's form (``zero3_with_pipeline``), the form the library composes
    (``parallel.fsdp2_pipeline``), so ``library_rules`` keeps it too. Interleaved 1F1B needs m a multiple of p in the
    library's runtime (``parallel.pp_stages``; torch and Megatron-Core take more: ``schedules.interleaved_groups``);
    ZB-H1's bubble formula holds for m >= p."""
    if cand.pp > 1 and cand.zero_stage == 2:
        return ZERO_WITH_PIPELINE
    if cand.schedule == "interleaved" and (cand.pp == 1 or m % cand.pp or cfg.n_layer < cand.pp * cand.v):
        return f"interleaved v={cand.v} needs pp > 1, m={m} a multiple of pp={cand.pp} and pp x v <= n_layer"
    if cand.schedule == "zb_h1" and m < cand.pp:
        return f"ZB-H1 needs m >= pp (m={m}, pp={cand.pp})"
    return ""


def zero3_with_pipeline(zero: int, pp: int) -> bool:
    """ZeRO-3 composed with a pipeline as torchtitan composes FSDP2 with ``torch.distributed.pipelining``: the
    parameters (and the optimizer state) stay sharded and are all-gathered for every micro-batch's forward and
    backward, but each stage accumulates its gradients unsharded across its micro-batches and reduce-scatters
    them once, after the last one (so it holds its full gradients, as under ZeRO-1)."""
    return zero == 3 and pp > 1
