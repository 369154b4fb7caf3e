"""The one process a local-capacity MoE on a mesh matches: every rank's share of each micro-batch.

With ``GPTConfig(capacity_scope="local")`` each rank fills its experts' queues from its own tokens
and each data rank's micro-batch has its own balance loss (``MoE.local_routing``, as Megatron-LM
computes them), so what a run trains depends on how the mesh cuts the batch.
``train_local_reference(cfg, tc, parallel)`` trains on one process what the mesh of ``parallel``
trains:

* each step's micro-batches are the union, in data-rank order, of the data ranks' j-th micro-batches
  (``rank_micro_batches``): without a pipeline the loop's cut (the global batch cut into
  ``accumulation`` pieces, each sliced over dp); with one, each data rank's slice cut into the
  pipeline's m pieces;
* every MoE layer routes each rank's share of it as that rank would (``MeshShares``: the rows of a
  data rank, the positions of a context-parallel rank in its layout's order, each with its own
  capacity).

Tensor and expert parallelism do not change which tokens a rank routes. ``dropped`` counts what one
forward drops on a layout: the same batch drops different assignments on different meshes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from course_lib.data import global_batch
from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.cp_attention import Layout
from course_lib.parallel.loop import ModelFn, step_micro_batches
from course_lib.parallel.moe_mesh import RoutingShards, moe_layers
from course_lib.train import Batch, TrainConfig, TrainResult, train_baseline


@dataclass(frozen=True)
class MeshShares:
    """One process playing ``dp`` x ``cp`` ranks (``moe.RankShares``): a micro-batch of B rows is dp
    groups of B / dp rows; a group's cp shares are its rows at each cp rank's positions
    (``layout``), in that rank's order."""

    dp: int = 1
    cp: int = 1
    layout: Layout = "zigzag"

    def split(self, lead: tuple[int, ...], device: torch.device) -> list[list[torch.Tensor]]:
        rows, seq = lead
        if rows % self.dp or seq % self.cp:
            raise ValueError(f"a micro-batch of {rows} rows x {seq} tokens does not split over "
                             f"dp={self.dp}, cp={self.cp}")
        return [[RoutingShards(None, self.dp * self.cp, d, self.cp, c, self.layout)
                 .token_index(rows // self.dp, seq // self.cp, device) for c in range(self.cp)]
                for d in range(self.dp)]

    def group_counts(self, counts: torch.Tensor) -> torch.Tensor:
        return counts  # the whole group is here


def rank_micro_batches(x: torch.Tensor, y: torch.Tensor,
                       parallel: ParallelConfig) -> list[Batch]:
    """One step's micro-batches as the ranks of ``parallel`` hold them: the j-th is the data ranks'
    j-th micro-batches stacked in data-rank order (the module docstring)."""
    dp, pipelined = parallel.shape.dp, parallel.shape.pp > 1
    if pipelined and parallel.accumulation != 1:
        raise ValueError("a pipeline cuts its own micro-batches: accumulation must be 1 with "
                         "pp > 1")
    m = parallel.microbatches if pipelined else parallel.accumulation
    per_rank = [step_micro_batches(x, y, d, dp, m, micro_first=not pipelined) for d in range(dp)]
    return [(torch.cat([r[j][0] for r in per_rank]), torch.cat([r[j][1] for r in per_rank]))
            for j in range(m)]


def _with_shares(model_fn: ModelFn, shares: MeshShares, cfg: GPTConfig, seed: int) -> nn.Module:
    model = model_fn(cfg, seed)
    for layer in moe_layers(model):
        layer.local = shares
    return model


def _check(cfg: GPTConfig, parallel: ParallelConfig) -> MeshShares:
    if cfg.capacity_scope != "local":
        raise ValueError("the global capacity scope trains the model of one process on every "
                         "mesh: its reference is train_baseline (with the run's accumulation)")
    if parallel.bias_update_rate:
        raise ValueError("the local reference does not move the selection bias: use "
                         "bias_update_rate=0")
    return MeshShares(parallel.shape.dp, parallel.shape.cp, parallel.cp_layout)


def train_local_reference(cfg: GPTConfig, tc: TrainConfig, parallel: ParallelConfig,
                          model_fn: ModelFn | None = None) -> TrainResult:
    """``train_baseline`` of ``cfg`` (``capacity_scope="local"``) with the micro-batches and the
    routing shares of the mesh of ``parallel``: what ``runs.train_parallel(..., parallel)`` must
    match (``train.compare``). ``model_fn``: the model, as in ``train_parallel`` (default GPT)."""
    shares = _check(cfg, parallel)
    return train_baseline(cfg, tc, functools.partial(_with_shares, model_fn or GPT, shares),
                          split=functools.partial(rank_micro_batches, parallel=parallel))


@torch.no_grad()
def dropped(cfg: GPTConfig, parallel: ParallelConfig, tc: TrainConfig | None = None,
            step: int = 0) -> int:
    """Assignments the MoE layers of ``GPT(cfg, tc.seed)`` drop in step ``step``'s forward passes on
    the mesh of ``parallel`` (local capacity; ``ParallelConfig()``: one process, where both scopes
    agree)."""
    tc = tc or TrainConfig()
    model = _with_shares(GPT, _check(cfg, parallel), cfg, tc.seed)
    x, y = global_batch(step, tc.global_batch, cfg.seq_len, tc.seed)
    total = 0
    for xm, _ in rank_micro_batches(x, y, parallel):
        model(xm)
        total += sum(layer.stats.dropped for layer in moe_layers(model))
    return total
