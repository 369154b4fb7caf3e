"""Top-k mixture of experts, the single-process reference: the router, capacity, the router losses, the experts.

``MoE`` replaces a block's MLP when ``GPTConfig.n_expert`` > 0; ``course_lib.parallel.ep.ExpertParallelMoE``
is its expert-parallel subclass. The parameter counts of its router and experts are in
``course_lib.model_config`` (``block_params``), with the dense ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.layers import MLP
from course_lib.model_config import GPTConfig


def expert_capacity(capacity_factor: float | None, n_tokens: int, top_k: int, n_expert: int) -> int | None:
    """Slots per expert, C = ceil(cf * T * k / E) for T tokens routed to k of E experts each (GShard, Lepikhin
    et al. 2020; Switch Transformer, Fedus et al. 2021). cf = 1 is exactly enough for perfectly even routing;
    ``None`` means dropless (no limit)."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * n_tokens * top_k / n_expert)


DropPolicy = Literal["position", "probs", "choice"]


def expert_positions(chosen: torch.Tensor, n_expert: int, offset: torch.Tensor | None = None) -> torch.Tensor:
    """Where each of the T*k assignments ``chosen`` [T, k] stands in its expert's queue (0-based): a cumulative
    sum over the one-hot routing mask in token order, so token t's j-th choice comes after every choice of the
    tokens before t and after its own choices before j. ``offset[e]``: assignments to expert e already queued
    by tokens that come earlier in the batch (other ranks' shards). An assignment is kept when position < C."""
    flat = chosen.reshape(-1, 1)
    mask = F.one_hot(flat[:, 0], n_expert)  # [T*k, E]
    pos = (mask.cumsum(0) - 1).gather(1, flat).view_as(chosen)
    return pos if offset is None else pos + offset[chosen]


def queue_positions(chosen: torch.Tensor, weights: torch.Tensor, n_expert: int,
                    policy: DropPolicy = "position") -> torch.Tensor:
    """Where each assignment of ``chosen`` [T, k] stands in its expert's queue under a drop ``policy`` (an expert
    of capacity C keeps positions < C, so each keeps min(routed, C) whatever the policy; only *which* differs):

    * "position": token order (``expert_positions``), the latest tokens drop: Megatron-LM's
      ``--moe-token-drop-policy position`` ("tokens at the end of each batch will be dropped"; its activations
      are [s, b, h], so its end is the last positions of every sequence, ours [b, s, h] the last rows);
    * "probs": highest combine weight ``weights`` [T, k] first (ties in token order), the lowest drop:
      Megatron-LM's default ``probs`` (a top-C down each expert's column of routing probabilities,
      ``moe_utils.apply_router_token_dropping``; DeepSpeed's ``topkgating(drop_policy="probs")`` alike);
    * "choice": every token's first choice before any token's second, each in token order: GShard's top-2
      gating (DeepSpeed ``sharded_moe.top2gating``: ``locations2 += sum(mask1)``; Tutel ``extract_critical``),
      so a token loses its second expert before another token loses its first."""
    if policy == "position":
        return expert_positions(chosen, n_expert)
    if policy == "choice":
        return expert_positions(chosen.t(), n_expert).t()
    order = torch.argsort(weights.detach().reshape(-1), descending=True, stable=True)
    pos = torch.empty_like(order)
    pos[order] = expert_positions(chosen.reshape(-1, 1)[order], n_expert).view(-1)
    return pos.view_as(chosen)


@dataclass
class Routing:
    """The router's decision for T tokens: ``logits`` [T, E]; ``probs`` [T, E], the distribution over experts
    the load-balancing loss averages (softmax; for the sigmoid router its scores normalised to sum 1);
    ``chosen`` [T, k] expert ids; ``weights`` [T, k] the combine weights."""

    logits: torch.Tensor
    probs: torch.Tensor
    chosen: torch.Tensor
    weights: torch.Tensor

    def rows(self, tokens: torch.Tensor) -> Routing:
        """The same decision for the tokens ``tokens`` only."""
        return Routing(self.logits[tokens], self.probs[tokens], self.chosen[tokens], self.weights[tokens])


@dataclass
class RoutingStats:
    """One MoE layer in one forward: assignments routed to each expert (before capacity), kept by each expert,
    dropped in all, and the mean per-token entropy of the router distribution (nats; log E is uniform)."""

    tokens_per_expert: list[int]
    kept_per_expert: list[int]
    dropped: int
    entropy: float


def routing_entropy(probs: torch.Tensor) -> float:
    """Mean over tokens of -sum_e p_e log p_e."""
    return float(-(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()) if probs.numel() else 0.0


class TokenShards(Protocol):
    """The ranks that each hold a share of the same micro-batch (data- and context-parallel ranks: set by
    ``course_lib.parallel.ep.share_routing``). ``size``: how many; ``gather(chosen)``: every rank's routing of
    the micro-batch, ``chosen`` [B_r, T_r, k] on this rank -> ([N, k] for the N tokens of the micro-batch in
    the single-process order, row after row; this rank's token t is row ``index[t]`` of it)."""

    size: int

    def gather(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class RankShares(Protocol):
    """For ``capacity_scope="local"``: which ranks' tokens one forward holds (``course_lib.parallel.moe_mesh``
    builds one for a rank, ``parallel.moe_reference`` for the one process that plays every rank).
    ``split(lead, device)``: for tokens shaped ``lead``, the flat indices of each rank's tokens in that rank's
    own order, grouped by data rank (a list over data ranks of a list over its context-parallel ranks);
    ``group_counts(counts)``: the routed counts per expert of the group's tokens held here -> the whole group's
    (its data rank's micro-batch)."""

    def split(self, lead: tuple[int, ...], device: torch.device) -> list[list[torch.Tensor]]: ...

    def group_counts(self, counts: torch.Tensor) -> torch.Tensor: ...


class _RouterLossInBackward(torch.autograd.Function):
    """Identity on ``out`` whose backward also back-propagates ``loss`` with weight ``scale``: a layer's router
    loss reaches its router wherever the layer's output is differentiated, also on a pipeline stage that
    computes no loss (Megatron-Core's ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.loss_shape, ctx.scale = loss.shape, scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, grad.new_full(ctx.loss_shape, ctx.scale), None


class MoE(nn.Module):
    """Top-k mixture of experts (Shazeer et al. 2017; Mixtral): a router picks ``top_k`` experts per token and
    mixes their outputs; the single-process reference (the expert-parallel version is
    ``course_lib.parallel.ep.ExpertParallelMoE``, a subclass that keeps only its rank's experts).

    * Router "softmax" (Mixtral): the top-k logits, their weights the softmax over the k selected. Router
      "sigmoid" (DeepSeek-V3): scores s = sigmoid(logits), experts selected by top-k of s + b with b the
      ``expert_bias`` buffer (no gradient: moved by ``balance_bias_``, "auxiliary-loss-free" balancing, Wang
      et al. 2024), weights s_selected / sum(s_selected).
    * Capacity (``capacity_factor``): expert e keeps the assignments whose ``expert_positions`` < C =
      ``expert_capacity``; a dropped assignment adds nothing, so a token dropped by all its experts passes
      through the block's residual connection unchanged. None: dropless.
    * Losses (``aux_loss`` after each forward, added to the LM loss by ``moe_aux_loss``): the Switch/GShard
      load-balancing loss alpha * E * sum_i f_i P_i (f_i: fraction of the T*k assignments routed to i, before
      capacity; P_i: mean router probability of i; exactly alpha for uniform routing, Fedus et al. 2021, eq. 4)
      and the router z-loss beta * mean_t logsumexp(logits_t)^2 (ST-MoE, Zoph et al. 2022, eq. 5).
    * Node-limited routing (``n_group``, ``topk_group`` = M; DeepSeek-V3, section 2.1.2): the E experts form
      G contiguous groups; each group scores the sum of its top max(1, k // M) selection scores, and a token's
      top-k is taken among the experts of its M best groups only (``select_experts``): under expert
      parallelism with a group per node, each token's rows cross to at most M nodes.
    * Shared experts (``n_shared_expert``, DeepSeekMoE, Dai et al. 2024): ``shared``, one MLP every token goes
      through, added unweighted to the routed experts' weighted sum (``add_shared``); its parameters are dense
      (replicated under expert parallelism), not experts.
    * ``stats``: the ``RoutingStats`` of the last forward.
    * Drop policy (``drop_policy``, ``queue_positions``): which assignments a full expert drops.
    * Global scope (``capacity_scope="global"``, on many ranks ``shards``, a ``TokenShards`` set by
      ``parallel.moe_mesh.share_routing``): capacity, queue positions and f_i are those of the whole micro-batch,
      every rank's routing gathered in token order; each rank's P_i and z-loss sum its own tokens scaled so that
      the mean over the ranks is the micro-batch's loss: any mesh trains the model of one process.
    * Local scope (``"local"``, ``local_routing``), as Megatron-LM computes it: each rank's tokens (``local``, a
      ``RankShares``) fill their own queues of C = ceil(cf T_r k / E) slots; the balance loss is
      ``moe_utils.switch_load_balancing_loss_func``'s (load-balancing type ``aux_loss``, its default; its
      ``global_aux_loss`` counts f_i over the global batch instead), per micro-batch of a data rank: f_i counted
      over its tokens (summed over its context-parallel ranks, the ``sequence_partition_group``), P_i over the
      tokens held here divided by their number; a step averages it over data ranks and micro-batches. What drops
      then depends on the layout; ``parallel.moe_reference`` replays a layout's shares on one process.
    * ``backward_scale`` (set for a pipeline): the router loss is not left for ``moe_aux_loss`` but
      back-propagated through the layer's output with that weight (``router_loss_in_backward``) and its value
      kept in ``reported`` for the step's loss.

    Public seams a variant overrides: ``router_logits``, ``route``, ``capacity``, ``expert_fractions``,
    ``select_experts``, ``load_balancing_loss``, ``batch_routing``, ``local_routing``, ``add_shared``,
    ``router_loss_in_backward``, ``attach_router_loss``.
    """

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_expert, self.top_k, self.router_kind = c.n_expert, c.top_k, c.router
        self.capacity_factor, self.aux_loss_coef, self.z_loss_coef = c.capacity_factor, c.aux_loss_coef, c.z_loss_coef
        self.capacity_scope, self.drop_policy = c.capacity_scope, c.drop_policy
        self.n_group, self.topk_group = c.n_group, c.topk_group
        self.router = nn.Linear(c.d_model, c.n_expert, bias=False)
        self.experts = nn.ModuleList(MLP(c, c.expert_ffn_dim) for _ in range(c.n_expert))
        self.shared = MLP(c, c.n_shared_expert * c.expert_ffn_dim) if c.n_shared_expert else None
        if c.router == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(c.n_expert))
        self.aux_loss: torch.Tensor | None = None
        self.stats: RoutingStats | None = None
        self.shards: TokenShards | None = None
        self.local: RankShares | None = None
        self.backward_scale: float | None = None
        self.reported: list[float] = []

    # -- seams ------------------------------------------------------------------------------------------------

    def router_logits(self, flat: torch.Tensor) -> torch.Tensor:
        """[T, E] scores of every expert for tokens ``flat`` [T, h]: a linear map h -> E."""
        return self.router(flat)

    def select_experts(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, ids) [T, k] of the top-k of the selection ``scores`` [T, E]; node-limited (``topk_group``): among
        the experts of each token's M best groups, a group's score the sum of its top max(1, k // M)."""
        if self.topk_group is None or self.topk_group == self.n_group:
            return scores.topk(self.top_k, dim=-1)
        T, E, G, M = scores.shape[0], self.n_expert, self.n_group, self.topk_group
        grouped = scores.view(T, G, E // G)
        group_score = grouped.topk(min(max(1, self.top_k // M), E // G), dim=-1).values.sum(-1)  # [T, G]
        allowed = torch.zeros(T, G, dtype=torch.bool, device=scores.device)
        allowed.scatter_(1, group_score.topk(M, dim=-1).indices, True)
        return scores.masked_fill(~allowed.repeat_interleave(E // G, dim=1), float("-inf")).topk(self.top_k, dim=-1)

    def route(self, flat: torch.Tensor) -> Routing:
        """Router logits, probabilities, top-k choices and combine weights for tokens ``flat`` [T, h]."""
        logits = self.router_logits(flat)
        if self.router_kind == "softmax":
            top, chosen = self.select_experts(logits)
            return Routing(logits, logits.softmax(-1), chosen, top.softmax(-1))
        scores = logits.sigmoid()
        chosen = self.select_experts(scores + self.expert_bias)[1]
        picked = scores.gather(1, chosen)
        return Routing(logits, scores / scores.sum(-1, keepdim=True), chosen, picked / picked.sum(-1, keepdim=True))

    def capacity(self, n_tokens: int) -> int | None:
        """Slots per expert for a batch of ``n_tokens`` tokens (all of them, over every rank)."""
        return expert_capacity(self.capacity_factor, n_tokens, self.top_k, self.n_expert)

    def expert_fractions(self, counts: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """f_i = (assignments routed to i) / (T * k): the fractions sum to 1."""
        return counts.float() / (n_tokens * self.top_k)

    def load_balancing_loss(self, f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """alpha * E * sum_i f_i * P_i (f carries no gradient; the router learns through P)."""
        return self.aux_loss_coef * self.n_expert * (f * p).sum()

    # -- the layer --------------------------------------------------------------------------------------------

    def router_loss(self, r: Routing, counts: torch.Tensor, n_tokens: int, replicas: int = 1) -> torch.Tensor:
        """Load-balancing + z-loss of a batch of ``n_tokens`` tokens whose routed ``counts`` per expert are given.

        When the batch is split over ``replicas`` ranks whose losses are averaged, each rank passes the global
        ``counts`` and ``n_tokens`` with its own routing ``r``: P_i and the z-loss then sum this rank's tokens
        only, times ``replicas / n_tokens``, so the mean over the ranks is exactly the whole batch's loss."""
        loss = r.logits.new_zeros(())
        scale = replicas / n_tokens
        if self.aux_loss_coef:
            loss = loss + self.load_balancing_loss(self.expert_fractions(counts, n_tokens), r.probs.sum(0) * scale)
        if self.z_loss_coef:
            loss = loss + self.z_loss_coef * r.logits.logsumexp(-1).pow(2).sum() * scale
        return loss

    @torch.no_grad()
    def balance_bias_(self, counts: torch.Tensor, rate: float) -> None:
        """Auxiliary-loss-free balancing (sigmoid router): b_i += rate * sign(mean load - load_i), so an
        overloaded expert is selected less next step and an idle one more (Wang et al. 2024; DeepSeek-V3)."""
        if self.router_kind != "sigmoid":
            raise ValueError("balance_bias_ needs router='sigmoid' (the softmax router has no selection bias)")
        load = counts.float().to(self.expert_bias.device)
        self.expert_bias.add_(rate * torch.sign(load.mean() - load))

    def batch_routing(self, chosen: torch.Tensor, lead: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor, int, int]:
        """For this rank's choices ``chosen`` [T_r, k] (tokens shaped ``lead`` = (B_r, T_r')): the micro-batch's
        routed and kept counts per expert [E], this rank's keep mask [T_r, k], the micro-batch's token count and
        the number of ranks sharing it. One process: all local. Sharded (``shards``): when capacity or f_i need
        them, every rank's choices are gathered (``TokenShards.gather``) and the queues run in token order;
        otherwise (dropless, no load-balancing loss) the counts are this rank's alone."""
        E, size = self.n_expert, 1 if self.shards is None else self.shards.size
        if size > 1 and self.capacity_factor is not None and self.drop_policy != "position":
            raise ValueError(f"drop_policy={self.drop_policy!r} with the global capacity over {size} ranks: the "
                             f"global queues run in token order; use capacity_scope='local'")
        if size > 1 and (self.capacity_factor is not None or self.aux_loss_coef):
            every, index = self.shards.gather(chosen.view(*lead, self.top_k))
        else:
            every, index = chosen, None
        cap = self.capacity(chosen.shape[0] * size)
        keep_all = (torch.ones_like(every, dtype=torch.bool) if cap is None
                    else expert_positions(every, E) < cap)
        keep = keep_all if index is None else keep_all[index]
        routed = torch.bincount(every.reshape(-1), minlength=E)
        kept = torch.bincount(every[keep_all], minlength=E)
        return routed, kept, keep, chosen.shape[0] * size, size

    def local_routing(self, r: Routing, lead: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                        torch.Tensor]:
        """Local capacity for tokens shaped ``lead`` (the class docstring): this forward's routed and kept counts
        per expert [E], the keep mask [T, k] and the router loss. Each rank's share (``local.split``; without
        ``local`` one share, the whole forward) queues by ``drop_policy`` into C = ``capacity(T_r)`` slots; each
        data rank's group gets the loss of its micro-batch (``router_loss`` with the group's counts), and the
        groups' losses are averaged, as data parallelism averages its ranks'."""
        T, dev = r.chosen.shape[0], r.chosen.device
        groups = [[torch.arange(T, device=dev)]] if self.local is None else self.local.split(lead, dev)
        keep = torch.zeros_like(r.chosen, dtype=torch.bool)
        loss = r.logits.new_zeros(())
        for group in groups:
            for idx in group:
                cap = self.capacity(idx.numel())
                keep[idx] = (True if cap is None else
                             queue_positions(r.chosen[idx], r.weights[idx], self.n_expert, self.drop_policy) < cap)
            tokens = torch.cat(group)
            counts = torch.bincount(r.chosen[tokens].reshape(-1), minlength=self.n_expert)
            if self.local is not None and self.aux_loss_coef:  # f_i: the whole group's (the z-loss needs none)
                counts = self.local.group_counts(counts)
            n_group = int(counts.sum()) // self.top_k
            loss = loss + self.router_loss(r.rows(tokens), counts, n_group, n_group // tokens.numel()) / len(groups)
        return (torch.bincount(r.chosen.reshape(-1), minlength=self.n_expert),
                torch.bincount(r.chosen[keep], minlength=self.n_expert), keep, loss)

    def add_shared(self, routed: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """y_t = shared(x_t) + sum_j w_tj E_j(x_t): the shared experts' output, once per token and unweighted, plus
        the routed sum ``routed`` [T, h] (DeepSeekMoE, eq. 9). Without shared experts: ``routed``."""
        return routed if self.shared is None else routed + self.shared(flat)

    def router_loss_in_backward(self, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """``out`` unchanged, its backward also back-propagating ``loss`` x ``backward_scale``; the value is kept
        in ``reported`` (the pipeline's stages report their layers' router losses from there)."""
        self.reported.append(float(loss.detach()) * self.backward_scale)
        return _RouterLossInBackward.apply(out, loss, self.backward_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        r = self.route(flat)
        if self.capacity_scope == "local" or self.shards is None:  # one process: one share, the whole batch
            counts, kept, keep, loss = self.local_routing(r, tuple(x.shape[:-1]))
        else:
            counts, kept, keep, n_tokens, size = self.batch_routing(r.chosen, tuple(x.shape[:-1]))
            loss = self.router_loss(r, counts, n_tokens, replicas=size)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = ((r.chosen == e) & keep).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, r.weights[token, slot, None] * expert(flat[token]))
        self.stats = RoutingStats(counts.tolist(), kept.tolist(), int(counts.sum() - kept.sum()),
                                  routing_entropy(r.probs.detach()))
        return self.attach_router_loss(self.add_shared(out, flat).view_as(x), loss)

    def attach_router_loss(self, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """The layer's output, its router ``loss`` either kept in ``aux_loss`` for ``moe_aux_loss`` (one process,
        data parallelism) or, under a pipeline (``backward_scale`` set), back-propagated through ``out``
        (``router_loss_in_backward``)."""
        if self.backward_scale is None or not (self.aux_loss_coef or self.z_loss_coef):
            self.aux_loss = loss
            return out
        self.aux_loss = None
        return self.router_loss_in_backward(out, loss)


def moe_aux_loss(model: nn.Module) -> torch.Tensor | float:
    """Sum of the router losses every MoE layer of ``model`` computed in its last forward (0.0 without MoE):
    what a training loop adds to the LM loss."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    return sum(losses) if losses else 0.0
