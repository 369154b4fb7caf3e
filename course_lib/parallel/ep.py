"""Expert parallelism from scratch: each MoE layer's experts spread over an ``ep`` group, tokens
sent to their experts and back by two uneven all-to-alls that autograd differentiates.

An MoE layer (``course_lib.moe.MoE``) holds E expert MLPs, k per token: parameters grow with E,
FLOPs per token with k. EP keeps E/ep experts per rank and moves the *tokens* (GShard, Lepikhin et
al. 2020; Switch, Fedus et al. 2021). Per layer and rank: route (the router is replicated);
all-gather the routed counts per expert over the batch's ranks (capacity C = ceil(cf T k / E) over
the whole batch, each rank's place in every expert's queue, f_i of the balance loss); all-to-all
the kept counts (the splits); dispatch each kept (token, expert) row to the expert's owner; run the
local experts; combine back. Dispatch and combine each carry T k h bytes per layer forward (summed
over the ranks), again in backward with the splits swapped.

Global counts give every rank the single-process capacity and queue order (parity); each rank
checks its peers' announced rows against them, so a rank that computed another capacity raises
instead of hanging a mismatched all-to-all. ``capacity_scope="local"`` (Megatron-LM's): each rank
queues its own tokens (``MoE.local_routing``), rank s held to min(routed, C_s), C_s from its own
token count. The backward all-to-alls sum an expert's gradient over its ep peers' tokens; EP
reduces nothing else: ``apply_ep`` records expert parameters ``Replicate()`` on "edp" (the dp x cp
/ ep ranks holding the same experts), where data parallelism reduces them. Chapter 07 builds it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.moe import MoE, RoutingStats, expert_positions, routing_entropy
from course_lib.parallel import placement as P
from course_lib.parallel.contract import require_member

EP_AXIS = "ep"
"""The mesh axis the experts of every MoE layer are split over."""

# --------------------------------------------------------------------------------------------------
# The differentiable all-to-all and the capacity arithmetic


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``in_splits`` go to the ranks of ``group``; ``out_splits`` rows come
    back from each. Its gradient: the same all-to-all, splits swapped (both in the comm log)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: comm.Group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        comm.all_to_all(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all_rows(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                    group: comm.Group = None) -> torch.Tensor:
    """Uneven ``all_to_all_single`` of the rows of ``x`` through autograd (every rank must call it,
    also with 0 rows, in forward and -- through the graph -- in backward)."""
    return _AllToAll.apply(x, list(map(int, out_splits)), list(map(int, in_splits)), group)


def kept_counts(counts: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """Assignments each rank's tokens keep at each expert, from the routed ``counts`` [W, E] in
    batch order: kept[s, e] = clamp(C - offset[s, e], 0, counts[s, e]) with offset[s, e] =
    sum_{s' < s} counts[s', e]."""
    if capacity is None:
        return counts.clone()
    offset = counts.cumsum(0) - counts
    return (capacity - offset).clamp(min=0).minimum(counts)


def group_ranks(group: comm.Group) -> list[int]:
    """Global ranks of ``group`` in group order (None: the whole world)."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


# --------------------------------------------------------------------------------------------------
# The expert-parallel layer


@dataclass
class EPRoutingStats(RoutingStats):
    """``RoutingStats`` over the whole batch (counts from the exchange; entropy over this rank's
    tokens) plus this rank's forward dispatch + combine all-to-alls: bytes sent, seconds taken. With
    expert groups (``n_group`` G > 1, a group = the experts of ep/G ranks, "a node"), for this
    rank's kept assignments: ``cross_group_rows``, the rows its dispatch sends to another group (one
    per assignment, what our all-to-all moves); ``cross_group_pairs``, the distinct (token, other
    group) pairs -- the rows a node-level dispatcher sending a token once per node and fanning it
    out inside (DeepEP's internode kernels) would send; ``groups_per_token``, the mean number of
    groups a token's kept experts span (tokens that kept any)."""

    a2a_sent_bytes: int = 0
    a2a_seconds: float = 0.0
    cross_group_rows: int = 0
    cross_group_pairs: int = 0
    groups_per_token: float = 1.0


class ExpertParallelMoE(MoE):
    """An ``MoE`` layer that keeps only this rank's E/ep experts (global ids ``expert_ids``,
    contiguous) and moves tokens to them by all-to-all over ``ep_group``; ``batch_group`` (default:
    the world) is every rank whose shard belongs to the same batch, in batch order. Built from a
    full ``MoE`` (router and local experts shared).

    Seams a variant overrides: those of ``MoE`` plus ``exchange_counts``, ``keep_mask``,
    ``expert_owner``, ``all_to_all`` (the differentiable row exchange), ``run_experts``,
    ``combine``.
    """

    def __init__(self, moe: MoE, ep_group: comm.Group = None,
                 batch_group: comm.Group = None) -> None:
        nn.Module.__init__(self)  # not MoE.__init__: the router and experts come from ``moe``
        self.n_expert, self.top_k, self.router_kind = moe.n_expert, moe.top_k, moe.router_kind
        self.n_group, self.topk_group = moe.n_group, moe.topk_group
        self.capacity_factor = moe.capacity_factor
        self.aux_loss_coef, self.z_loss_coef = moe.aux_loss_coef, moe.z_loss_coef
        self.capacity_scope, self.drop_policy = moe.capacity_scope, moe.drop_policy
        self.local = None
        self.ep_group, self.batch_group = ep_group, batch_group
        self.ep_size, self.ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        if self.n_expert % self.ep_size:
            ok = [d for d in range(1, self.n_expert + 1) if self.n_expert % d == 0]
            raise ValueError(f"n_expert={self.n_expert} is not divisible by ep={self.ep_size}: "
                             f"choose ep among {ok}")
        self.n_local = self.n_expert // self.ep_size
        if self.ep_size % self.n_group:
            ok = [d for d in range(1, self.ep_size + 1) if self.ep_size % d == 0]
            raise ValueError(f"rank {dist.get_rank()}: n_group={self.n_group} groups of experts "
                             f"over ep={self.ep_size} ranks: a group must be the experts of whole "
                             f"ranks (a node); choose n_group dividing ep, e.g. {ok}")
        lo = self.ep_rank * self.n_local
        self.expert_ids = list(range(lo, lo + self.n_local))
        self.router, self.shared = moe.router, moe.shared  # dense: replicated like attention
        self.experts = nn.ModuleList(moe.experts[e] for e in self.expert_ids)
        # the list of experts is split over ep: rank r holds entries [r E/ep, (r+1) E/ep)
        P.set_placement(self.experts, EP_AXIS, P.Shard(0, size=self.n_expert))
        if self.router_kind == "sigmoid":
            self.register_buffer("expert_bias", moe.expert_bias)
        batch = group_ranks(batch_group)
        self.batch_size, self.batch_rank = len(batch), batch.index(dist.get_rank())
        self.peer_pos = [batch.index(g) for g in group_ranks(ep_group)]  # ep peers' batch places
        # this step's assignments per expert over the whole batch: kept, routed (before capacity)
        self.step_kept = torch.zeros(self.n_expert, dtype=torch.long)
        self.step_routed = torch.zeros(self.n_expert, dtype=torch.long)
        self.aux_loss: torch.Tensor | None = None
        self.stats: EPRoutingStats | None = None
        # its own count exchange (no ``shards``); ``backward_scale``: set by
        # ``moe_mesh.share_routing`` under a pipeline
        self.shards, self.backward_scale, self.reported = None, None, []

    # -- seams -------------------------------------------------------------------------------------

    def exchange_counts(self, local: torch.Tensor) -> torch.Tensor:
        """All-gather every rank's routed counts per expert: [W, E] in batch order."""
        out = local.new_empty(self.batch_size * local.numel())
        comm.all_gather(out, local, group=self.batch_group)
        return out.view(self.batch_size, -1)

    def keep_mask(self, chosen: torch.Tensor, counts: torch.Tensor,
                  capacity: int | None) -> torch.Tensor:
        """[T_r, k] bool: which of this rank's assignments its experts keep. Expert e's queue
        starts after the assignments the ranks before this one in the batch route to e
        (``counts`` [W, E])."""
        if capacity is None:
            return torch.ones_like(chosen, dtype=torch.bool)
        return expert_positions(chosen, self.n_expert, counts[:self.batch_rank].sum(0)) < capacity

    def local_kept(self, counts: torch.Tensor) -> torch.Tensor:
        """[W, E]: what each rank keeps at each expert under local capacity, min(routed, C_s) with
        C_s = ``capacity`` of rank s's own tokens (every drop policy keeps that many; only which
        ones differ)."""
        caps = [self.capacity(int(c.sum()) // self.top_k) for c in counts]
        if caps[0] is None:
            return counts.clone()
        return counts.minimum(torch.tensor(caps, device=counts.device)[:, None])

    def token_order_keep(self, chosen: torch.Tensor, lead: tuple[int, ...], capacity: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Under context parallelism the ranks' batch order is not the token order (the layout
        interleaves each row's positions over the cp ranks): the queues run on every rank's choices
        gathered in single-process token order (``shards``, a ``moe_mesh.RoutingShards`` over the
        counts' group). Returns this rank's keep mask [T_r, k] and every rank's kept counts per
        expert [W, E]."""
        every, index, owner = self.shards.gather_with_owners(chosen.view(*lead, self.top_k))
        keep_all = expert_positions(every, self.n_expert) < capacity
        kept = torch.zeros(self.batch_size, self.n_expert, dtype=torch.long, device=chosen.device)
        rows = owner[:, None].expand_as(every)[keep_all]
        kept.index_put_((rows, every[keep_all]), torch.ones_like(rows), accumulate=True)
        return keep_all[index], kept

    def expert_owner(self, expert: torch.Tensor) -> torch.Tensor:
        """The ep rank holding each expert id: e // (E / ep)."""
        return expert // self.n_local

    def all_to_all(self, rows: torch.Tensor, out_splits: list[int],
                   in_splits: list[int]) -> torch.Tensor:
        """The dispatch (and, splits swapped, the combine) over the ep group, through autograd."""
        return all_to_all_rows(rows, out_splits, in_splits, self.ep_group)

    def run_experts(self, recv: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """Run the local experts on ``recv`` (rows grouped by source rank, then by local expert,
        ``recv_counts`` [ep, E/ep]); return their outputs in the same row order. An expert's rows
        are taken source after source (batch order), as the single-process layer sees them."""
        local_of_row = torch.arange(self.n_local, device=recv.device).repeat(self.ep_size)
        local_of_row = local_of_row.repeat_interleave(recv_counts.reshape(-1).to(recv.device))
        order = torch.argsort(local_of_row, stable=True)
        chunks = recv[order].split(recv_counts.sum(0).tolist())
        # an expert with no rows is skipped (its gradient stays None); the empty chunk keeps the
        # graph connected
        outs = torch.cat([expert(c) if c.shape[0] else c
                          for expert, c in zip(self.experts, chunks, strict=True)])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return outs[inverse]

    def combine(self, back: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weight each returned expert output row by its router weight."""
        return back * weights[:, None]

    def group_traffic(self, token: torch.Tensor, expert: torch.Tensor,
                      n_tokens: int) -> tuple[int, int, float]:
        """(rows to other groups, distinct (token, other group) pairs, mean groups per token that
        kept any) of this rank's kept assignments (``token``, ``expert``), a group being E / G
        contiguous experts (``EPRoutingStats``)."""
        if self.n_group == 1 or not n_tokens:
            return 0, 0, 1.0
        size = self.n_expert // self.n_group
        group, mine = expert // size, self.expert_ids[0] // size
        touched = torch.zeros(n_tokens, self.n_group, dtype=torch.bool, device=expert.device)
        touched[token, group] = True
        spans = touched.sum(1)
        return (int((group != mine).sum()), int(touched.sum() - touched[:, mine].sum()),
                float(spans[spans > 0].float().mean()) if bool((spans > 0).any()) else 0.0)

    # -- the layer ---------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        r = self.route(flat)
        E, k, dev = self.n_expert, self.top_k, flat.device
        counts = self.exchange_counts(torch.bincount(r.chosen.reshape(-1), minlength=E))  # [W, E]
        if self.capacity_scope == "local":
            _, _, keep, loss = self.local_routing(r, tuple(x.shape[:-1]))
            kept = self.local_kept(counts)
        else:
            n_tokens = int(counts.sum()) // k
            cap = self.capacity(n_tokens)
            if cap is not None and self.drop_policy != "position":
                raise ValueError(f"drop_policy={self.drop_policy!r} with the global capacity: the "
                                 "global queues run in token order over the ranks; use "
                                 "capacity_scope='local'")
            if self.shards is not None and cap is not None:
                keep, kept = self.token_order_keep(r.chosen, tuple(x.shape[:-1]), cap)
            else:
                keep, kept = self.keep_mask(r.chosen, counts, cap), kept_counts(counts, cap)
            loss = self.router_loss(r, counts.sum(0), n_tokens, replicas=self.batch_size)

        token, slot = keep.nonzero(as_tuple=True)  # token order
        expert = r.chosen[token, slot]
        order = torch.argsort(self.expert_owner(expert) * E + expert, stable=True)  # owner, expert
        token, slot, expert = token[order], slot[order], expert[order]
        send = torch.bincount(expert, minlength=E)
        owners = self.expert_owner(torch.arange(E, device=dev))
        per_dest = [send[owners == j] for j in range(self.ep_size)]
        if any(c.numel() != self.n_local for c in per_dest):
            raise ValueError("expert_owner must give every ep rank exactly "
                             f"E/ep = {self.n_local} experts")
        announced = torch.empty(E, dtype=torch.long, device=dev)
        comm.all_to_all(announced, torch.cat(per_dest), group=self.ep_group)
        recv_counts = announced.view(self.ep_size, self.n_local)
        expected = kept[self.peer_pos][:, self.expert_ids].to(dev)
        if not torch.equal(recv_counts, expected):
            local = self.capacity_scope == "local"
            source = "each rank's own token count" if local else "the global counts"
            raise RuntimeError(
                f"rank {dist.get_rank()}: the ep peers announce {recv_counts.tolist()} rows for "
                f"experts {self.expert_ids} but the exchanged counts imply {expected.tolist()}: "
                "the ranks disagree on the capacity or on which rank owns which expert (capacity "
                f"must come from {source})")
        in_splits = [int(c.sum()) for c in per_dest]
        out_splits = recv_counts.sum(1).tolist()
        with comm.recording() as lg:
            recv = self.all_to_all(flat[token], out_splits, in_splits)
            back = self.all_to_all(self.run_experts(recv, recv_counts), in_splits, out_splits)
        combined = self.combine(back, r.weights[token, slot])
        out = self.add_shared(torch.zeros_like(flat).index_add(0, token, combined), flat)

        total_kept = kept.sum(0).cpu()
        self.step_kept += total_kept
        self.step_routed += counts.sum(0).cpu()
        self.stats = EPRoutingStats(counts.sum(0).tolist(), total_kept.tolist(),
                                    int(counts.sum() - kept.sum()),
                                    routing_entropy(r.probs.detach()), lg.sent_bytes("all_to_all"),
                                    lg.seconds("all_to_all"),
                                    *self.group_traffic(token, expert, flat.shape[0]))
        return self.attach_router_loss(out.view_as(x), loss)


def apply_ep(model: nn.Module, ep_group: comm.Group, batch_group: comm.Group, *,
             layer: Callable[[MoE, comm.Group, comm.Group], ExpertParallelMoE] = ExpertParallelMoE
             ) -> list[ExpertParallelMoE]:
    """Expert parallelism of ``model`` in place: every ``MoE`` becomes ``layer(moe, ep_group,
    batch_group)`` (``ExpertParallelMoE``), keeping this rank's E/ep experts; ``batch_group``: every
    rank whose shard belongs to the same batch, in batch order (dp x cp). Each expert parameter is
    recorded ``Replicate()`` on "edp" (where data parallelism reduces it). Returns the layers."""
    for g in (ep_group, batch_group):
        require_member(g, "apply_ep")
    layers = []
    for name, m in list(model.named_modules()):
        if isinstance(m, MoE) and not isinstance(m, ExpertParallelMoE):
            parent, _, child = name.rpartition(".")
            new = layer(m, ep_group, batch_group)
            setattr(model.get_submodule(parent) if parent else model, child, new)
            layers.append(new)
    if not layers:
        raise ValueError("the model has no MoE layer: expert parallelism needs "
                         "GPTConfig(n_expert > 0)")
    for p in (q for new in layers for q in new.experts.parameters()):
        P.set_placement(p, "edp", P.Replicate())
    return layers


def end_step(layers: Sequence[ExpertParallelMoE], bias_update_rate: float = 0.0) -> None:
    """After the optimizer step: with ``bias_update_rate`` gamma > 0 each layer's selection bias
    moves by gamma x sign(mean load - load_i) from the step's routed counts over the whole batch
    (DeepSeek-V3's auxiliary-loss-free balancing; the same counts on every rank, so the bias stays
    replicated); then the next step's counts start."""
    if bias_update_rate and any(layer.router_kind != "sigmoid" for layer in layers):
        raise ValueError(f"bias_update_rate={bias_update_rate} needs GPTConfig(router='sigmoid'): "
                         "the softmax router has no selection bias to move")
    for layer in layers:
        if bias_update_rate:
            layer.balance_bias_(layer.step_routed, bias_update_rate)
        layer.step_kept.zero_()
        layer.step_routed.zero_()
