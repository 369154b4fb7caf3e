"""MoE routing on any mesh: capacity, queue positions and the router losses of the single-process model.

An MoE layer's capacity C = ceil(cf * T * k / E), its queues (``model.expert_positions``) and the load-balancing
loss alpha * E * sum_i f_i P_i depend on *every* token of the forward's micro-batch: they are not sums over
tokens, so a rank that computes them on its own shard trains another objective (on dp = 2 with capacity and the
aux loss: the loss off by 1.1e-3 after two SGD steps). The z-loss is a mean over tokens and splits exactly.

The semantics, and why: **exchange, not per-shard**. The ranks that hold shares of the same micro-batch
exchange their routing, so every mesh trains the one model ``train_baseline`` trains; a per-shard definition
would make the objective depend on the mesh (dp = 2 and dp = 4 would train different models), which is what the
course's parity checks exist to exclude. Who shares a micro-batch:

* data- and context-parallel ranks (``mesh.group("dp", "cp")``): rows of the micro-batch (dp) and tokens of
  those rows at their layout's positions (cp). ``RoutingShards.gather`` all-gathers each rank's (global token
  index, k expert ids), int64, (k + 1) * T_r * 8 bytes a rank per MoE layer forward (modelled: an all_gather), and
  sorts them into the single-process token order: row after row, position after position. Each rank then runs
  the single-process queues on the whole micro-batch and keeps its own rows; f_i is the micro-batch's; P_i and
  the z-loss sum this rank's tokens times W / T, so the mean over the W ranks (what their gradient average and
  ``reduce_losses`` take) is the micro-batch's loss (``MoE.router_loss``). Nothing is exchanged when neither
  capacity nor f_i is needed.
* tensor-parallel ranks see the same tokens: the same routing, nothing to exchange.
* expert-parallel ranks: ``ExpertParallelMoE`` exchanges its counts itself (over the same dense group); under
  a pipeline its router loss back-propagates through its output like any stage's (below).
* pipeline stages see the same micro-batch one after another, each with its own MoE layers. Only the last stage
  computes a loss, so each layer's router loss is back-propagated through the layer's own output
  (``MoE.backward_scale``, Megatron-Core's ``MoEAuxLossAutoScaler``) with the weight the pipeline gives each
  micro-batch's loss (1 / m), and its value is added to the reported loss (``MeshRouting.add_stage_losses``: a
  sum over the pp group, a mean over dp x cp). The micro-batch is the pipeline's: the semantics of
  ``train_baseline(cfg, tc, accumulation=m)``.

Refused (``share_routing`` raises, and ``config.check_composable`` with ``config.routing_refusal``): dp x cp > 1
with pp > 1 when capacity or the load-balancing loss is on, with or without expert parallelism (whose ep ranks
are dp x cp ranks) -- the loop gives each data-parallel rank its contiguous rows and the pipeline cuts those into
m pieces, so the union of the dp ranks' j-th pipeline micro-batches is not the j-th piece of the batch, and no
single-process run has that micro-batch (the fix: give dp rank r the rows cat_j shard(piece_j, r, dp); the
z-loss alone composes).

What a composed wrapper calls (``compose.Parallelized``): ``routing = share_routing(model, mesh, cp_layout=...,
microbatches=m if pp > 1 else None)`` once, after expert parallelism replaced its layers and before the
pipeline cuts the model; and in ``reduce_losses``, after the pipeline's or data parallelism's reduction,
``routing.add_stage_losses(losses)`` when ``routing`` is not None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.moe import MoE
from course_lib.parallel.config import routing_refusal
from course_lib.parallel.cp_attention import Layout, positions
from course_lib.runtime.mesh import Mesh


@dataclass
class RoutingShards:
    """This rank's share of a micro-batch: rows ``row_rank`` of ``rows`` (dp, contiguous), tokens of chunk layout
    ``layout`` for ``cp_rank`` of ``cp``; ``group``: every rank of the micro-batch (dp x cp), ``size`` of them."""

    group: comm.Group
    size: int
    row_rank: int
    cp: int = 1
    cp_rank: int = 0
    layout: Layout = "zigzag"

    def token_index(self, rows: int, tokens: int, device: torch.device) -> torch.Tensor:
        """[rows * tokens]: the single-process flat index (row * T + position) of each of this rank's tokens."""
        seq = tokens * self.cp
        pos = (positions(seq, self.cp_rank, self.cp, self.layout, device) if self.cp > 1
               else torch.arange(tokens, device=device))
        row = self.row_rank * rows + torch.arange(rows, device=device)
        return (row[:, None] * seq + pos[None, :]).reshape(-1)

    def gather(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's expert choices of the micro-batch in single-process token order ([N, k]) and where this
        rank's tokens are in it (``model.TokenShards``). The gathered indices must be exactly 0..N-1: ranks that
        disagree on the rows or the layout raise instead of training on a wrong queue."""
        every, index, _ = self.gather_with_owners(chosen)
        return every, index

    def gather_with_owners(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``gather`` plus, per token in that order, the rank of ``group`` that holds it ([N]): what an
        expert-parallel layer needs to count each rank's kept assignments (``ExpertParallelMoE``)."""
        rows, tokens, k = chosen.shape
        index = self.token_index(rows, tokens, chosen.device)
        mine = torch.cat([index[:, None], chosen.reshape(-1, k)], dim=1).contiguous()
        every = mine.new_empty((self.size * mine.shape[0], k + 1))
        comm.all_gather(every, mine, group=self.group)
        order = torch.argsort(every[:, 0])
        every = every[order]
        if not torch.equal(every[:, 0], torch.arange(every.shape[0], device=every.device)):
            raise RuntimeError(f"rank {dist.get_rank()}: the ranks of this micro-batch do not hold disjoint shares "
                               f"of it (token indices {every[:, 0].tolist()[:8]}...): they must agree on dp "
                               f"rank, cp rank and layout")
        return every[:, 1:], index, order // mine.shape[0]


@dataclass
class MeshRouting:
    """The MoE layers of one rank's model on its mesh; ``pipelined``: their router losses back-propagate through
    their outputs (``MoE.backward_scale``) and are reported by ``add_stage_losses``."""

    layers: list[MoE]
    pipelined: bool
    pp_group: comm.Group = None
    data_group: comm.Group = None

    def stage_losses(self, steps: int) -> torch.Tensor:
        """[steps]: the router losses of this rank's layers in each step (each micro-batch's times its 1/m), from
        the layers' ``reported`` values (m per step, in order), which it clears."""
        total = torch.zeros(steps, dtype=torch.float32)
        for layer in self.layers:
            if layer.reported:
                total += torch.tensor(layer.reported, dtype=torch.float32).view(steps, -1).sum(1)
            layer.reported.clear()
        return total

    def add_stage_losses(self, losses: torch.Tensor) -> torch.Tensor:
        """``losses`` (the reduced per-step LM losses) plus every stage's router losses: summed over the pp group
        (each stage its own layers), averaged over dp x cp. A collective on every rank when pipelined."""
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


def share_routing(model: nn.Module, mesh: Mesh, *, cp_layout: Layout = "zigzag", microbatches: int | None = None,
                  shards_class: type[RoutingShards] = RoutingShards) -> MeshRouting | None:
    """Make every MoE layer of ``model`` route as on one process on ``mesh`` (the module docstring): their
    ``shards`` over dp x cp (not for ``ExpertParallelMoE`` layers, which exchange their counts themselves) and,
    with a pipeline of ``microbatches`` = m, their router losses back-propagated with weight 1/m. None for a
    model without MoE, or with ep > 1 and no pipeline (``ExpertParallel`` adds their losses). ``ValueError`` for
    dp x cp > 1 with pp > 1 and a batch-wide router term (``config.routing_refusal``; with ep > 1 the same rule
    is ``config.check_composable``'s, checked before the layers are built)."""
    layers = moe_layers(model)
    pipelined = microbatches is not None and mesh.size("pp") > 1
    expert_parallel = mesh.size("ep") > 1
    if not layers or (expert_parallel and not pipelined and mesh.size("cp") == 1):
        return None
    why = routing_refusal(mesh.size("dp", "cp"), mesh.size("pp"), any(m.capacity_factor is not None for m in layers),
                          any(m.aux_loss_coef for m in layers)) if pipelined and not expert_parallel else ""
    if why:
        raise ValueError(f"rank {dist.get_rank()}: {why}")
    size = mesh.size("dp", "cp")
    data_group = mesh.group("dp", "cp") if size > 1 else None
    for layer in layers:  # expert-parallel layers need the token order only for capacity with cp
        if size > 1 and (not expert_parallel or (mesh.size("cp") > 1 and layer.capacity_factor is not None)):
            layer.shards = shards_class(data_group, size, mesh.coord("dp"), mesh.size("cp"), mesh.coord("cp"),
                                        cp_layout)
        if pipelined:
            layer.backward_scale = 1.0 / microbatches
    return MeshRouting(layers, pipelined, mesh.group("pp") if pipelined else None, data_group)
