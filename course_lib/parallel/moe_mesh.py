"""MoE routing on any mesh: the single-process model's capacity, queue positions and router losses.

Capacity C = ceil(cf T k / E), the queues (``moe.expert_positions``) and the balance loss
alpha E sum_i f_i P_i depend on *every* token of the micro-batch (per shard: another objective), so
the ranks sharing one exchange their routing (the z-loss, a mean over tokens, splits exactly):

* dp x cp ranks: ``RoutingShards.gather`` all-gathers each rank's (global token index, k expert
  ids), (k + 1) T_r int64 per layer forward, sorted into single-process token order; every rank runs
  the queues on the whole micro-batch and keeps its tokens; P_i and the z-loss sum its tokens times
  W / T, so the mean over the W ranks is the micro-batch's loss;
* tensor-parallel ranks see the same tokens; expert-parallel layers exchange their counts (``ep``);
* pipeline stages back-propagate their router losses through the layers' outputs, weight 1/m
  (Megatron-Core's ``MoEAuxLossAutoScaler``); ``MeshRouting.add_stage_losses`` reports them.

A pipeline with dp x cp > 1 refuses this global form (``config.routing_refusal``): it cuts each data
rank's rows into its own micro-batches, whose union is no one process's micro-batch.
``capacity_scope="local"`` (production's, ``MoE.local_routing``) needs one exchange only: each rank
queues its own tokens, f_i sums its cp peers' counts (``SequenceShares``). It composes with every
mesh; ``moe_reference`` is the one process it matches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.moe import MoE
from course_lib.parallel.cp_attention import Layout, positions
from course_lib.runtime.mesh import Mesh


@dataclass
class RoutingShards:
    """This rank's share of a micro-batch: rows ``row_rank`` of ``rows`` (dp, contiguous), tokens of
    chunk layout ``layout`` for ``cp_rank`` of ``cp``; ``group``: every rank of the micro-batch
    (dp x cp), ``size`` of them."""

    group: comm.Group
    size: int
    row_rank: int
    cp: int = 1
    cp_rank: int = 0
    layout: Layout = "zigzag"

    def token_index(self, rows: int, tokens: int, device: torch.device) -> torch.Tensor:
        """[rows * tokens]: the single-process flat index (row * T + position) of each of this
        rank's tokens."""
        seq = tokens * self.cp
        pos = (positions(seq, self.cp_rank, self.cp, self.layout, device) if self.cp > 1
               else torch.arange(tokens, device=device))
        row = self.row_rank * rows + torch.arange(rows, device=device)
        return (row[:, None] * seq + pos[None, :]).reshape(-1)

    def gather(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's expert choices of the micro-batch in single-process token order ([N, k]) and
        where this rank's tokens are in it (``model.TokenShards``). The gathered indices must be
        exactly 0..N-1: ranks that disagree on the rows or the layout raise instead of training on
        a wrong queue."""
        every, index, _ = self.gather_with_owners(chosen)
        return every, index

    def gather_with_owners(self, chosen: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``gather`` plus, per token in that order, the rank of ``group`` that holds it ([N]): what
        an expert-parallel layer needs to count each rank's kept assignments
        (``ExpertParallelMoE``)."""
        rows, tokens, k = chosen.shape
        index = self.token_index(rows, tokens, chosen.device)
        mine = torch.cat([index[:, None], chosen.reshape(-1, k)], dim=1).contiguous()
        every = mine.new_empty((self.size * mine.shape[0], k + 1))
        comm.all_gather(every, mine, group=self.group)
        order = torch.argsort(every[:, 0])
        every = every[order]
        if not torch.equal(every[:, 0], torch.arange(every.shape[0], device=every.device)):
            raise RuntimeError(f"rank {dist.get_rank()}: the ranks of this micro-batch do not hold "
                               "disjoint shares of it (token indices "
                               f"{every[:, 0].tolist()[:8]}...): they must agree on dp rank, cp "
                               "rank and layout")
        return every[:, 1:], index, order // mine.shape[0]


@dataclass
class SequenceShares:
    """Local capacity on a rank (``moe.RankShares``): its whole forward is one share (its own
    queues), and its data rank's group is its ``size`` context-parallel ranks ``group``, whose
    routed counts ``group_counts`` all-gathers and sums, E int64 per layer forward (Megatron-LM
    all-reduces them over tp x cp)."""

    group: comm.Group
    size: int

    def split(self, lead: tuple[int, ...], device: torch.device) -> list[list[torch.Tensor]]:
        return [[torch.arange(math.prod(lead), device=device)]]

    def group_counts(self, counts: torch.Tensor) -> torch.Tensor:
        every = counts.new_empty(self.size * counts.numel())
        comm.all_gather(every, counts.contiguous(), group=self.group)
        return every.view(self.size, -1).sum(0)


@dataclass
class MeshRouting:
    """The MoE layers of one rank's model on its mesh; ``pipelined``: their router losses
    back-propagate through their outputs (``MoE.backward_scale``), reported by
    ``add_stage_losses``."""

    layers: list[MoE]
    pipelined: bool
    pp_group: comm.Group = None
    data_group: comm.Group = None

    def stage_losses(self, steps: int) -> torch.Tensor:
        """[steps]: the router losses of this rank's layers in each step (each micro-batch's times
        its 1/m), from the layers' ``reported`` values (m per step, in order), which it clears."""
        total = torch.zeros(steps, dtype=torch.float32)
        for layer in self.layers:
            if layer.reported:
                total += torch.tensor(layer.reported, dtype=torch.float32).view(steps, -1).sum(1)
            layer.reported.clear()
        return total

    def add_stage_losses(self, losses: torch.Tensor) -> torch.Tensor:
        """``losses`` (the reduced per-step LM losses) plus every stage's router losses: summed over
        the pp group (each stage its own layers), averaged over dp x cp. A collective on every rank
        when pipelined."""
        if not self.pipelined:
            return losses
        extra = self.stage_losses(losses.numel()).to(losses.device)
        comm.all_reduce(extra, group=self.pp_group)
        if self.data_group is not None:
            comm.all_reduce(extra, group=self.data_group)
            extra /= dist.get_world_size(self.data_group)
        return losses + extra


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of ``model``, single-process and expert-parallel ones."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def share_routing(model: nn.Module, mesh: Mesh, *, cp_layout: Layout = "zigzag",
                  microbatches: int | None = None) -> MeshRouting | None:
    """Make every MoE layer of ``model`` route on ``mesh`` as the module docstring says: global
    scope, their ``shards`` over dp x cp (not for ``ExpertParallelMoE`` layers, which exchange their
    counts themselves); local scope with cp > 1, their ``local`` over cp; with a pipeline of
    ``microbatches`` = m, their router losses back-propagated with weight 1/m. None for a model
    without MoE, or with ep > 1, cp = 1 and no pipeline (the composed loss adds their losses). What
    cannot be built is refused before (``config.check_composable``)."""
    layers = moe_layers(model)
    pipelined = microbatches is not None and mesh.size("pp") > 1
    expert_parallel, cp = mesh.size("ep") > 1, mesh.size("cp")
    if not layers or (expert_parallel and not pipelined and cp == 1):
        return None
    size = mesh.size("dp", "cp")
    data_group = mesh.group("dp", "cp") if size > 1 else None
    for layer in layers:  # expert-parallel layers need the token order only for capacity with cp
        if layer.capacity_scope == "local":
            if cp > 1:
                layer.local = SequenceShares(mesh.group("cp"), cp)
        elif size > 1 and (not expert_parallel or (cp > 1 and layer.capacity_factor is not None)):
            layer.shards = RoutingShards(data_group, size, mesh.coord("dp"), cp, mesh.coord("cp"),
                                         cp_layout)
        if pipelined:
            layer.backward_scale = 1.0 / microbatches
    return MeshRouting(layers, pipelined, mesh.group("pp") if pipelined else None, data_group)
