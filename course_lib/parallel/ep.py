"""Expert parallelism from scratch: the experts of every MoE layer spread over the ranks of an ``ep`` group, tokens
sent to their experts and back by two uneven all-to-alls that autograd differentiates.

A mixture-of-experts layer (``course_lib.moe.MoE``) holds E expert MLPs but each token uses only k of them:
parameters grow with E, FLOPs per token with k. Expert parallelism stores E/ep experts per rank and moves the
*tokens* instead of the weights (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021). Per MoE
layer, on every rank of the ep group, with its own T_r tokens (its shard of the batch)::

    route        logits -> top-k experts and combine weights of each token            (local, router replicated)
    count        all_gather the routed counts per expert over every rank of the batch  (W x E int64)
                 -> global capacity C = ceil(cf * T * k / E), each rank's place in every expert's queue, the
                    kept counts of every (rank, expert), f_i of the load-balancing loss
                 all_to_all the kept counts per expert to the experts' owners (E int64) -- the receive splits
    dispatch     all_to_all_single with uneven splits: each kept (token, expert) row goes to the expert's owner
    experts      each local expert runs on the rows it received
    combine      all_to_all_single back (the transposed splits); each token sums weight x expert output

Bytes (h = d_model, s = bytes per element, T = tokens of the whole batch): dispatch and combine each carry the
T*k*h*s bytes of the kept assignments per layer forward, summed over the ranks (T*k*h*s when nothing is dropped),
and the same again in backward, where the gradient of each all-to-all is the all-to-all with the splits swapped.
The fraction that leaves a rank is what it routes to other ranks' experts: (ep-1)/ep under uniform routing. The
count exchange adds W*E*8 (all_gather, modelled ring bytes) and E*8 (all_to_all) per layer forward.

Why the counts are exchanged *globally*: the single-process MoE computes its capacity over the T tokens of the
whole batch and queues assignments in token order. For the same router decisions (parity), every rank uses the
global T and starts its queue positions after the assignments of the ranks before it (their shards come first
in the batch). Each rank also derives, from the gathered counts, how many rows each peer will send it, and checks
that against what the peers announce: a rank that computed its capacity from its own counts only raises a clear
error instead of leaving its peers waiting in a mismatched all-to-all.

Gradients. Each rank back-propagates its own local-mean loss; the backward all-to-alls bring every peer's
gradient to the experts, so an expert's gradient is the *sum* over the ep ranks' losses. The dense part (attention,
norms, embeddings, router) is replicated on all W = ep x dp ranks and averaged over them as data parallelism;
the experts are replicated over the dp ranks that hold the same shard and summed over those, then both are
divided by W: the gradient of the mean loss over the global batch. An expert that no token of the whole batch
reached keeps ``.grad = None`` (as on one process, where the optimizer then skips it). With tensor, pipeline or
context parallelism as well, every group is the one of this rank's (tp, pp) coordinate (``ep_mesh``).

The auxiliary losses under data parallelism and accumulation ("per global micro-batch"): f_i and the mean P_i
are over every token of one forward across all the ranks (f_i from the count exchange; each rank sums its own
tokens' probabilities, scaled so the mean over ranks is the whole batch's loss). With m accumulation steps the
loss of a step is the mean of the m micro-batches' losses, as ``train_baseline(..., accumulation=m)`` computes
it: f_i * P_i is not linear in the batch, so m micro-batches of B/m do *not* give the aux loss of one batch of B.

Production versions of the same steps: Megatron-Core's ``MoEAlltoAllTokenDispatcher`` (and its all-gather and
"flex" dispatchers), torchtitan's MoE with ``all_to_all_single_autograd``, DeepSpeed-MoE, DeepEP's kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.model import lm_loss
from course_lib.model_config import GPTConfig, param_count
from course_lib.moe import MoE, RoutingStats, expert_positions, moe_aux_loss, routing_entropy
from course_lib.parallel import placement as P
from course_lib.parallel.contract import ParallelWrapper, require_member
from course_lib.parallel.loop import ModelFn, StepTime, build_model, train_loop
from course_lib.runtime.mesh import Mesh
from course_lib.train import TrainConfig, TrainResult, make_optimizer

EP_AXIS = "ep"
"""The mesh axis the experts of every MoE layer are split over."""

# ----------------------------------------------------------------------------------------------------------------
# The differentiable all-to-all and the capacity arithmetic


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``in_splits`` go to the ranks of ``group``; ``out_splits`` rows come back from each.
    Its gradient is the same all-to-all with the splits swapped (both logged in the comm log)."""

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
    """Uneven ``all_to_all_single`` of the rows of ``x`` through autograd (every rank must call it, also with 0
    rows, in forward and -- through the graph -- in backward)."""
    return _AllToAll.apply(x, list(map(int, out_splits)), list(map(int, in_splits)), group)


def kept_counts(counts: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """Assignments each rank's tokens keep at each expert, from the routed ``counts`` [W, E] in batch order:
    kept[s, e] = clamp(C - offset[s, e], 0, counts[s, e]) with offset[s, e] = sum_{s' < s} counts[s', e]."""
    if capacity is None:
        return counts.clone()
    offset = counts.cumsum(0) - counts
    return (capacity - offset).clamp(min=0).minimum(counts)


def group_ranks(group: comm.Group) -> list[int]:
    """Global ranks of ``group`` in group order (None: the whole world)."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


# ----------------------------------------------------------------------------------------------------------------
# The expert-parallel layer


@dataclass
class EPRoutingStats(RoutingStats):
    """``RoutingStats`` over the whole batch (counts from the exchange; entropy over this rank's tokens) plus this
    rank's forward dispatch + combine all-to-alls: bytes it sent and seconds they took. With expert groups
    (``n_group`` G > 1, a group = the experts of ep/G ranks, "a node"), for this rank's kept assignments:
    ``cross_group_rows``, the rows its dispatch sends to another group (one per assignment, what our all-to-all
    moves); ``cross_group_pairs``, the distinct (token, other group) pairs -- the rows a node-level dispatcher
    that sends a token once per node and fans it out inside (DeepEP's internode kernels) would send; and
    ``groups_per_token``, the mean number of groups a token's kept experts span (tokens that kept any)."""

    a2a_sent_bytes: int = 0
    a2a_seconds: float = 0.0
    cross_group_rows: int = 0
    cross_group_pairs: int = 0
    groups_per_token: float = 1.0


class ExpertParallelMoE(MoE):
    """An ``MoE`` layer that keeps only this rank's E/ep experts (global ids ``expert_ids``, contiguous) and moves
    tokens to the experts by all-to-all over ``ep_group``; ``batch_group`` (default: the world) is every rank whose
    shard belongs to the same batch, in batch order. Built from a full ``MoE`` (router and local experts shared).

    Seams a variant overrides: those of ``MoE`` plus ``exchange_counts``, ``keep_mask``, ``expert_owner``,
    ``all_to_all`` (the differentiable row exchange), ``run_experts`` and ``combine``.
    """

    def __init__(self, moe: MoE, ep_group: comm.Group = None, batch_group: comm.Group = None) -> None:
        nn.Module.__init__(self)  # not MoE.__init__: the router and experts come from ``moe``
        self.n_expert, self.top_k, self.router_kind = moe.n_expert, moe.top_k, moe.router_kind
        self.n_group, self.topk_group = moe.n_group, moe.topk_group
        self.capacity_factor, self.aux_loss_coef, self.z_loss_coef = (moe.capacity_factor, moe.aux_loss_coef,
                                                                        moe.z_loss_coef)
        self.ep_group, self.batch_group = ep_group, batch_group
        self.ep_size, self.ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        if self.n_expert % self.ep_size:
            raise ValueError(f"n_expert={self.n_expert} is not divisible by ep={self.ep_size}: choose ep among "
                             f"{[d for d in range(1, self.n_expert + 1) if self.n_expert % d == 0]}")
        self.n_local = self.n_expert // self.ep_size
        if self.ep_size % self.n_group:
            raise ValueError(f"rank {dist.get_rank()}: n_group={self.n_group} groups of experts over ep={self.ep_size} "
                             f"ranks: a group must be the experts of whole ranks (a node); choose n_group dividing "
                             f"ep, e.g. {[d for d in range(1, self.ep_size + 1) if self.ep_size % d == 0]}")
        self.expert_ids = list(range(self.ep_rank * self.n_local, (self.ep_rank + 1) * self.n_local))
        self.router, self.shared = moe.router, moe.shared  # dense: replicated like attention
        self.experts = nn.ModuleList(moe.experts[e] for e in self.expert_ids)
        # the list of experts is split over ep: rank r holds entries [r E/ep, (r+1) E/ep) (placement docstring)
        P.set_placement(self.experts, EP_AXIS, P.Shard(0, size=self.n_expert))
        if self.router_kind == "sigmoid":
            self.register_buffer("expert_bias", moe.expert_bias)
        batch = group_ranks(batch_group)
        self.batch_size, self.batch_rank = len(batch), batch.index(dist.get_rank())
        self.peer_pos = [batch.index(g) for g in group_ranks(ep_group)]  # ep peers' places in the batch
        self.step_kept = torch.zeros(self.n_expert, dtype=torch.long)  # kept per expert, whole batch, this step
        self.step_routed = torch.zeros(self.n_expert, dtype=torch.long)  # routed (before capacity), the same
        self.aux_loss: torch.Tensor | None = None
        self.stats: EPRoutingStats | None = None
        # its own count exchange (no ``shards``); ``backward_scale``: set by ``moe_mesh.share_routing`` under a pipeline
        self.shards, self.backward_scale, self.reported = None, None, []

    # -- seams ------------------------------------------------------------------------------------------------

    def exchange_counts(self, local: torch.Tensor) -> torch.Tensor:
        """All-gather every rank's routed counts per expert: [W, E] in batch order."""
        out = local.new_empty(self.batch_size * local.numel())
        comm.all_gather(out, local, group=self.batch_group)
        return out.view(self.batch_size, -1)

    def keep_mask(self, chosen: torch.Tensor, counts: torch.Tensor, capacity: int | None) -> torch.Tensor:
        """[T_r, k] bool: which of this rank's assignments its experts keep. The queue of expert e starts after
        the assignments that the ranks before this one in the batch route to e (``counts`` [W, E])."""
        if capacity is None:
            return torch.ones_like(chosen, dtype=torch.bool)
        return expert_positions(chosen, self.n_expert, counts[:self.batch_rank].sum(0)) < capacity

    def token_order_keep(self, chosen: torch.Tensor, lead: tuple[int, ...], capacity: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Under context parallelism the ranks' batch order is not the token order (the layout interleaves each
        row's positions over the cp ranks): the queues run on every rank's choices gathered in single-process
        token order (``shards``, a ``moe_mesh.RoutingShards`` over the same group as the counts). Returns this
        rank's keep mask [T_r, k] and every rank's kept counts per expert [W, E]."""
        every, index, owner = self.shards.gather_with_owners(chosen.view(*lead, self.top_k))
        keep_all = expert_positions(every, self.n_expert) < capacity
        kept = torch.zeros(self.batch_size, self.n_expert, dtype=torch.long, device=chosen.device)
        rows = owner[:, None].expand_as(every)[keep_all]
        kept.index_put_((rows, every[keep_all]), torch.ones_like(rows), accumulate=True)
        return keep_all[index], kept

    def expert_owner(self, expert: torch.Tensor) -> torch.Tensor:
        """The ep rank holding each expert id: e // (E / ep)."""
        return expert // self.n_local

    def all_to_all(self, rows: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        """The dispatch (and, with the splits swapped, the combine) over the ep group, through autograd."""
        return all_to_all_rows(rows, out_splits, in_splits, self.ep_group)

    def run_experts(self, recv: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """Run the local experts on ``recv`` (rows grouped by source rank, then by local expert, ``recv_counts``
        [ep, E/ep]); return their outputs in the same row order. Rows of one expert are taken source after
        source, i.e. in batch order, as the single-process layer sees them."""
        local_of_row = torch.arange(self.n_local, device=recv.device).repeat(self.ep_size)
        local_of_row = local_of_row.repeat_interleave(recv_counts.reshape(-1).to(recv.device))
        order = torch.argsort(local_of_row, stable=True)
        chunks = recv[order].split(recv_counts.sum(0).tolist())
        # an expert with no rows is skipped (its gradient stays None); the empty chunk keeps the graph connected
        outs = torch.cat([expert(c) if c.shape[0] else c for expert, c in zip(self.experts, chunks, strict=True)])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return outs[inverse]

    def combine(self, back: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weight each returned expert output row by its router weight."""
        return back * weights[:, None]

    def group_traffic(self, token: torch.Tensor, expert: torch.Tensor, n_tokens: int) -> tuple[int, int, float]:
        """(rows to other groups, distinct (token, other group) pairs, mean groups per token that kept any) of this
        rank's kept assignments (``token``, ``expert``), a group being E / G contiguous experts (``EPRoutingStats``)."""
        if self.n_group == 1 or not n_tokens:
            return 0, 0, 1.0
        size = self.n_expert // self.n_group
        group, mine = expert // size, self.expert_ids[0] // size
        touched = torch.zeros(n_tokens, self.n_group, dtype=torch.bool, device=expert.device)
        touched[token, group] = True
        spans = touched.sum(1)
        return (int((group != mine).sum()), int(touched.sum() - touched[:, mine].sum()),
                float(spans[spans > 0].float().mean()) if bool((spans > 0).any()) else 0.0)

    # -- the layer --------------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        r = self.route(flat)
        E, k, dev = self.n_expert, self.top_k, flat.device
        counts = self.exchange_counts(torch.bincount(r.chosen.reshape(-1), minlength=E))  # [W, E]
        n_tokens = int(counts.sum()) // k
        cap = self.capacity(n_tokens)
        if self.shards is not None and cap is not None:
            keep, kept = self.token_order_keep(r.chosen, tuple(x.shape[:-1]), cap)
        else:
            keep, kept = self.keep_mask(r.chosen, counts, cap), kept_counts(counts, cap)
        loss = self.router_loss(r, counts.sum(0), n_tokens, replicas=self.batch_size)

        token, slot = keep.nonzero(as_tuple=True)  # token order
        expert = r.chosen[token, slot]
        order = torch.argsort(self.expert_owner(expert) * E + expert, stable=True)  # by owner, then expert
        token, slot, expert = token[order], slot[order], expert[order]
        send = torch.bincount(expert, minlength=E)
        owners = self.expert_owner(torch.arange(E, device=dev))
        per_dest = [send[owners == j] for j in range(self.ep_size)]
        if any(c.numel() != self.n_local for c in per_dest):
            raise ValueError(f"expert_owner must give every ep rank exactly E/ep = {self.n_local} experts")
        announced = torch.empty(E, dtype=torch.long, device=dev)
        comm.all_to_all(announced, torch.cat(per_dest), group=self.ep_group)
        recv_counts = announced.view(self.ep_size, self.n_local)
        expected = kept[self.peer_pos][:, self.expert_ids].to(dev)
        if not torch.equal(recv_counts, expected):
            raise RuntimeError(
                f"rank {dist.get_rank()}: the ep peers announce {recv_counts.tolist()} rows for experts "
                f"{self.expert_ids} but the exchanged counts imply {expected.tolist()}: the ranks disagree on the "
                f"capacity or on which rank owns which expert (capacity must come from the global counts)")
        in_splits = [int(c.sum()) for c in per_dest]
        out_splits = recv_counts.sum(1).tolist()
        with comm.recording() as lg:
            recv = self.all_to_all(flat[token], out_splits, in_splits)
            back = self.all_to_all(self.run_experts(recv, recv_counts), in_splits, out_splits)
        out = self.add_shared(torch.zeros_like(flat).index_add(0, token, self.combine(back, r.weights[token, slot])),
                              flat)

        total_kept = kept.sum(0).cpu()
        self.step_kept += total_kept
        self.step_routed += counts.sum(0).cpu()
        self.stats = EPRoutingStats(counts.sum(0).tolist(), total_kept.tolist(), int(counts.sum() - kept.sum()),
                                    routing_entropy(r.probs.detach()), lg.sent_bytes("all_to_all"),
                                    lg.seconds("all_to_all"), *self.group_traffic(token, expert, flat.shape[0]))
        return self.attach_router_loss(out.view_as(x), loss)


class TorchAllToAllMoE(ExpertParallelMoE):
    """The same layer with PyTorch's differentiable all-to-all,
    ``torch.distributed._functional_collectives.all_to_all_single_autograd`` (what torchtitan's MoE uses; a
    private module, pinned to the course's torch): the second oracle. Its traffic is not in the comm log."""

    def all_to_all(self, rows: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        group = self.ep_group if self.ep_group is not None else dist.group.WORLD
        return wait_tensor(all_to_all_single_autograd(rows.contiguous(), out_splits, in_splits, group))


# ----------------------------------------------------------------------------------------------------------------
# The wrapper


class ExpertParallel(ParallelWrapper):
    """Wrap a model with MoE layers for expert parallelism (and data parallelism of everything else).

    Every ``MoE`` of ``module`` is replaced by ``layer_class(moe, ep_group, group)``, which keeps E/ep
    experts. Groups (``course_lib.runtime.mesh``): ``mesh.group("ep")`` the all-to-all, ``mesh.group("edp")`` the ranks
    holding the same experts (their gradients are summed), ``mesh.group("dp", "cp")`` the dense data-parallel
    group (the wrapper's ``group``), whose ranks share the batch in group order. Without a mesh pass the groups:
    ``group`` (older name ``dense_group``; None: the whole world), ``ep_group`` (None: ``group``),
    ``expert_dp_group`` (None: no expert replicas). At construction the dense parameters and buffers are
    broadcast from the dense group's first rank and the experts over their expert-dp group, so every replica
    starts equal. The loss is the LM loss plus the router losses (``loss``); they depend on the whole batch of a
    forward (``batch_wide_loss``), so the loop cuts micro-batches from the global batch first.
    ``bias_update_rate`` gamma > 0 (sigmoid router): after each optimizer step every layer's selection bias moves
    by gamma * sign(mean load - load_i), the loads counted over the step's whole batch (``MoE.balance_bias_``,
    DeepSeek-V3's auxiliary-loss-free balancing): the same counts on every rank, so the bias stays replicated.

    Usage, one step::

        model = ExpertParallel(GPT(cfg), mesh=Mesh(dp=4, ep=2))
        loss = lm_loss(model(x), y) + moe_aux_loss(model); loss.backward()
        model.finish_gradient_sync(); opt.step(); model.after_step()
    """

    axes = ("dp", "cp")
    batch_wide_loss = True

    def __init__(self, module: nn.Module, *, mesh: Mesh | None = None, group: comm.Group = None,
                 ep_group: comm.Group = None, expert_dp_group: comm.Group = None, dense_group: comm.Group = None,
                 layer_class: type[ExpertParallelMoE] = ExpertParallelMoE, broadcast: bool = True,
                 bias_update_rate: float = 0.0) -> None:
        if group is not None and dense_group is not None:
            raise ValueError("ExpertParallel: group= and dense_group= are the same group: pass one")
        super().__init__(module, mesh=mesh, group=group if group is not None else dense_group)
        dense_group = self.group
        if mesh is not None:
            ep_group = mesh.group("ep")
            expert_dp_group = mesh.group("edp") if mesh.size("edp") > 1 else None
        elif ep_group is None:
            ep_group = dense_group
        for g in (ep_group, expert_dp_group):
            if g is not None:
                require_member(g, type(self).__name__)
        self.ep_group, self.expert_dp_group, self.dense_group = ep_group, expert_dp_group, dense_group
        edp = dist.get_world_size(expert_dp_group) if expert_dp_group is not None else 1
        if dist.get_world_size(ep_group) * edp != self.world_size:
            raise ValueError(f"ep x edp = {dist.get_world_size(ep_group)} x {edp} must equal the dense "
                             f"data-parallel size {self.world_size}")
        self.layers: list[ExpertParallelMoE] = []
        for name, m in list(module.named_modules()):
            if isinstance(m, MoE) and not isinstance(m, ExpertParallelMoE):
                parent, _, child = name.rpartition(".")
                layer = layer_class(m, ep_group, dense_group)
                setattr(module.get_submodule(parent) if parent else module, child, layer)
                self.layers.append(layer)
        if not self.layers:
            raise ValueError("the module has no MoE layer: expert parallelism needs GPTConfig(n_expert > 0)")
        if bias_update_rate and any(layer.router_kind != "sigmoid" for layer in self.layers):
            raise ValueError(f"bias_update_rate={bias_update_rate} needs GPTConfig(router='sigmoid'): the softmax "
                             f"router has no selection bias to move")
        self.bias_update_rate = bias_update_rate
        expert_ids = {id(p) for layer in self.layers for p in layer.experts.parameters()}
        self.expert_params = [p for p in module.parameters() if id(p) in expert_ids]
        self.dense_params = [p for p in module.parameters() if id(p) not in expert_ids]
        if broadcast:
            with torch.no_grad():
                for t in [*self.dense_params, *module.buffers()]:
                    comm.broadcast(t.detach(), group_ranks(dense_group)[0], group=dense_group)
                if expert_dp_group is not None:
                    for p in self.expert_params:
                        comm.broadcast(p.detach(), group_ranks(expert_dp_group)[0], group=expert_dp_group)

    def hold(self, params: Iterable[nn.Parameter]) -> None:
        """Reduce only the gradients of ``params`` from now on: a pipeline rank's stages (``ep_mesh``); the other
        stages' parameters are trained on other ranks."""
        held = {id(p) for p in params}
        self.dense_params = [p for p in self.dense_params if id(p) in held]
        self.expert_params = [p for p in self.expert_params if id(p) in held]

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The LM loss of this rank's rows plus the router losses of the forward (``moe_aux_loss``), as
        ``train_baseline`` computes it."""
        return lm_loss(logits, targets) + moe_aux_loss(self.module)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients are only averaged in ``finish_gradient_sync``, so every backward already accumulates locally;
        this block changes nothing. (The all-to-alls are part of forward and backward and cannot be skipped.)"""
        yield

    def _sum_then_divide(self, params: list[nn.Parameter], group: comm.Group, reduce: bool) -> None:
        """One flat all-reduce (sum) of the gradients of ``params`` over ``group``, then / W. None counts as 0."""
        if not params:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        if reduce:
            comm.all_reduce(flat, group=group)
        flat.div_(self.world_size)
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad = g.view_as(p).clone()

    def finish_gradient_sync(self) -> None:
        """After the last backward, before ``optimizer.step()``: dense gradients summed over all W ranks, expert
        gradients over the expert-dp group, both / W; experts unused by the whole batch this step get None."""
        with torch.no_grad():
            self._sum_then_divide(self.dense_params, self.dense_group, self.world_size > 1)
            self._sum_then_divide(self.expert_params, self.expert_dp_group, self.expert_dp_group is not None)
            for layer in self.layers:
                for e, expert in zip(layer.expert_ids, layer.experts, strict=True):
                    if layer.step_kept[e] == 0:
                        for p in expert.parameters():
                            p.grad = None

    def after_step(self) -> None:
        """After ``optimizer.step()``: the bias update from this step's routed counts (``bias_update_rate``), then
        start the next step's counts. (This wrapper installs no hooks -- it synchronises in
        ``finish_gradient_sync`` -- so ``remove_hooks`` has none to remove.)"""
        for layer in self.layers:
            if self.bias_update_rate:
                layer.balance_bias_(layer.step_routed, self.bias_update_rate)
            layer.step_kept.zero_()
            layer.step_routed.zero_()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the unsharded model by its single-process name: the experts all-gathered over the
        ep group (``placement.full_parameters``; a collective: every rank calls it)."""
        return P.full_parameters(self.module, {EP_AXIS: self.ep_group})

    full_params = full_parameters
    """The chapter's older name for ``full_parameters``."""


# ----------------------------------------------------------------------------------------------------------------
# The training loop


@dataclass
class EPResult(TrainResult):
    """``TrainResult`` plus, per step, this rank's communication records (``step_comm``) and the routing
    statistics of every MoE layer in the step's last micro-batch (``routing[step][layer]``)."""

    step_comm: list[list[comm.CommRecord]] = field(default_factory=list, repr=False)
    routing: list[list[EPRoutingStats]] = field(default_factory=list, repr=False)
    timeline: list[StepTime] = field(default_factory=list, repr=False)


def train_ep(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None, *, ep: int | None = None,
             mesh: Mesh | None = None, accumulation: int = 1, model_fn: ModelFn | None = None,
             freeze: Sequence[str] = (), layer_class: type[ExpertParallelMoE] = ExpertParallelMoE,
             wrapper_class: type[ExpertParallel] = ExpertParallel, bias_update_rate: float = 0.0) -> EPResult:
    """Train with expert parallelism of degree ``ep`` (default: every rank) over the data-parallel ranks: the
    mesh ``Mesh(dp=world_size, ep=ep)`` unless one is given (a ``launch`` target running ``loop.train_loop``;
    ``MeshError`` names what does not fit). Each step the global batch is split into ``accumulation``
    micro-batches and each micro-batch into one shard per rank; the loss is LM + router losses. Returns the
    global-batch mean loss per step (comparable with ``train_baseline(cfg, tc, accumulation=...)``), the full
    parameters and, per step, the routing statistics of the last micro-batch (the loop's ``on_step_end``).
    ``bias_update_rate``: the auxiliary-loss-free bias step (``ExpertParallel``)."""
    tc = tc or TrainConfig()
    mesh = mesh or Mesh(dp=world_size, ep=ep or world_size)
    if mesh.size("tp", "pp", "cp") != 1:
        raise ValueError("train_ep runs EP x DP only (tp = pp = cp = 1); composing more axes is chapter 08's")
    mesh.shape.validate(cfg)
    model = wrapper_class(build_model(cfg, tc.seed, model_fn, freeze), mesh=mesh, layer_class=layer_class,
                          bias_update_rate=bias_update_rate)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], tc)
    routing: list[list[EPRoutingStats]] = []
    out = train_loop(model, opt, cfg, tc, data_rank=model.rank, data_size=model.world_size,
                     accumulation=accumulation,
                     on_step_end=lambda step: routing.append([layer.stats for layer in model.layers]))
    return EPResult(out.losses, model.full_params(), out.step_comm, routing, out.timeline)


# ----------------------------------------------------------------------------------------------------------------
# Formulas


def dispatch_bytes(n_tokens: int, top_k: int, d_model: int, element_size: int = 4) -> int:
    """Bytes the dispatch all-to-all carries per MoE layer forward, summed over the ranks, nothing dropped:
    T * k * h * s. Combine carries the same; backward repeats both."""
    return n_tokens * top_k * d_model * element_size


def leaving_fraction(ep: int) -> float:
    """Share of a rank's dispatched rows that go to another rank under uniform routing: (ep - 1) / ep."""
    return (ep - 1) / ep


def moe_budget(cfg: GPTConfig, bytes_per_param: float = 2.0) -> dict[str, float]:
    """What an MoE stores vs what a token computes: total and active parameters (``param_count``), the bytes of
    all weights, and forward FLOPs per token of the active ones (2 per active parameter, attention scores
    excluded). For Mixtral 8x7B: 46.7B stored, 12.9B active -- not 8 x 7B = 56B, because the experts share the
    attention, embeddings and norms."""
    total, active = param_count(cfg), param_count(cfg, active_only=True)
    return {"total_params": total, "active_params": active, "weight_bytes": total * bytes_per_param,
            "forward_flops_per_token": 2 * active, "active_fraction": active / total}


def slowest_rank_load(tokens_per_expert: Sequence[int], ep: int, capacity: int | None = None) -> tuple[int, float]:
    """(rows the busiest ep rank's experts process, mean over ranks), experts placed contiguously, each expert
    capped at ``capacity``. An all-to-all step lasts as long as its slowest rank."""
    E = len(tokens_per_expert)
    if E % ep:
        raise ValueError(f"{E} experts do not divide over ep={ep} ranks")
    kept = [min(c, capacity) if capacity is not None else c for c in tokens_per_expert]
    per_rank = [sum(kept[j * E // ep:(j + 1) * E // ep]) for j in range(ep)]
    return max(per_rank), sum(per_rank) / ep

