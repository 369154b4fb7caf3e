"""Pipeline parallelism from scratch: cut the GPT into stages, run any schedule of ``course_lib.schedules`` on real
ranks, and measure it.

Stages. The model is cut into ``n = p * v`` contiguous (virtual) stages: stage 0 has the embeddings, the last stage
the final norm, the LM head and the loss, each stage a run of blocks (``split``: the number of blocks of each stage,
equal counts by default; any counts >= 1 summing to ``n_layer``). Stage ``s`` lives on rank ``s % p``: with
``v = 1`` stage s is rank s; with ``v > 1`` (interleaved 1F1B) rank r holds model chunks r, r + p, r + 2p, ...
(Megatron-LM's placement, the one ``schedules.py`` uses). Parameters keep their global names
(``blocks.3.attn.q_proj.weight``), so a stage's parameters line up with ``GPT.named_parameters()``.

Micro-batches and the loss. The global batch B is split into m micro-batches of b = B / m rows. The last stage
computes each micro-batch's mean loss L_j and back-propagates ``L_j / m``: the m backward passes accumulate
sum_j grad(L_j) / m = grad(mean over the batch) -- the single-process gradient. Without the ``/ m`` the gradients
are m times too large (an easy bug to write; Adam's update is nearly scale-invariant and hides it, SGD
does not). The reported loss is the mean of the unscaled L_j.

Transfers. The executor runs this rank's list of ``schedules.add_send_recv(schedule)``: ``RECV_F`` / ``RECV_B`` post
an ``irecv`` that the compute action needing the data waits for; ``SEND_F`` / ``SEND_B`` post an ``isend`` waited
for at the end of the step. A receive is posted one compute action ahead (as torch's runtime batches it with the
previous action), so the message travels while this rank computes; posting it only when needed cost up to 150 ms
of extra idle per message on a loaded 2-core machine. All go through ``course_lib.comm`` (logged). Every message
is one activation (forward) or one activation gradient (backward) of shape [b, s, h], fp32, so per optimizer
step (n = p v stages)::

    messages   = 2 (n - 1) m  sends (and as many receives) over all ranks: n - 1 boundaries, both ways
    bytes each = b * s * h * 4 = (B / m) * seq_len * d_model * 4

With v = 1 that is 2 (p - 1) m; interleaving crosses (p v - 1) boundaries instead of (p - 1), about v times the
point-to-point traffic, which is what buys its v times smaller bubble.

Split backward (zero-bubble, ``I`` and ``W``). ``B`` is one ``backward`` (input and weight gradients together).
``I`` computes only the gradient of the stage input -- the one the previous stage waits for -- with
``torch.autograd.grad(output, inputs=[input], retain_graph=True)``; ``W`` computes the weight gradients later,
when the schedule has a gap. What ``I`` keeps for ``W`` (as ``torch.distributed.pipelining``'s
``stage_backward_input`` / ``stage_backward_weight`` do): for every weight, the graph nodes where its gradient
branches off the input-gradient path (a linear layer's matmul, a LayerNorm) and the gradient that arrived at each
of them during ``I`` (captured by a pre-hook). ``W`` restarts back-propagation from those nodes with those
gradients (``torch.autograd.grad`` from ``GradientEdge`` s), so it only does the weight part (g^T x per linear
layer), not the whole backward again. Memory: until ``W`` the micro-batch's graph and its stored layer inputs stay
alive (the ``W`` needs them), which is why ``schedules.peak_in_flight`` counts a micro-batch until its ``W``; the
nodes above the captured points are freed after ``I``. Stage 0's embedding lookup has no input gradient: its whole
backward is weight work and runs in ``W``.

Timeline. Each compute action records its start and end (``time.perf_counter``, one clock for every process of a
machine) and how long it waited for its input first; ``measured_bubble_fraction`` turns the ranks' records into
1 - busy / (p x makespan), the quantity ``schedules.simulate`` predicts, and ``measured_timeline`` gives them in the
simulator's format for the Gantt chart. On a 2-core laptop ranks time-slice; for timing lessons pass
``emulate=(t_f, t_b, t_w)``: every action then also sleeps that long (an emulated device: the host waits as it
waits for a GPU kernel), so ranks run side by side and the measured bubble follows the schedule, not the OS.

Balancing. Equal layer counts are not equal stages: stage 0 also embeds and the last stage runs the head and the
loss (with a 256-token vocabulary and tiny blocks the head is a big share). ``balance_stages`` returns the
contiguous split minimizing the slowest stage from per-layer costs, ideally measured (``measure_layer_costs``),
optionally under a memory limit per stage (Dubrov: balance from measurements, not from layer counts).

Checked (tests/test_pp.py): every schedule at p = 2 and 4, and uneven splits, give bit-for-bit the parameters of
one process accumulating the same m micro-batches, and of ``torch.distributed.pipelining`` on the same stages
(``train_torch_pp``); and match ``train_baseline`` within the default tolerance (AdamW at lr 5e-4 -- at larger lr,
AdamW turns the rounding noise of *any* micro-batching into visible differences; the test module says why).

Left out compared with Megatron-LM / torchtitan: tied embeddings across first and last stage (they would need an
all-reduce of the shared weight's gradient between the two ranks), activation recomputation, overlapping the
point-to-point transfers with compute through batched ``isend``/``irecv`` on separate streams, building only the
local layers (each rank here builds the full tiny model once, for identical initial weights, and keeps its part).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import GradientEdge, Node

from course_lib import comm
from course_lib import schedules as S
from course_lib.data import global_batch, micro_batches
from course_lib.model import GPT, GPTConfig, lm_loss
from course_lib.schedules import Action, Kind, Schedule
from course_lib.train import TrainConfig, TrainResult, full_params, make_optimizer

SCHEDULES: dict[str, str] = {  # accepted names -> the builder in course_lib.schedules
    "gpipe": "gpipe", "afab": "gpipe",
    "1f1b": "one_f_one_b", "one_f_one_b": "one_f_one_b",
    "interleaved": "interleaved_one_f_one_b", "interleaved_1f1b": "interleaved_one_f_one_b",
    "interleaved_one_f_one_b": "interleaved_one_f_one_b",
    "zb_h1": "zb_h1", "zbh1": "zb_h1", "zero_bubble": "zb_h1",
}

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ------------------------------------------------------------------------------------------------ the plan


def layer_split(n_layer: int, n_stages: int, split: Sequence[int] | None = None) -> list[int]:
    """Blocks per (virtual) stage: ``split`` checked, or equal counts (``n_layer`` must then divide evenly)."""
    if split is None:
        if n_layer % n_stages:
            raise ValueError(
                f"n_layer={n_layer} blocks do not divide into {n_stages} equal stages (p x v = {n_stages}): "
                f"choose n_layer divisible by {n_stages}, or give split=[blocks per stage] (e.g. from balance_stages)"
            )
        return [n_layer // n_stages] * n_stages
    split = list(split)
    if len(split) != n_stages:
        raise ValueError(f"split needs one block count per (virtual) stage, {n_stages} = p x v, got {len(split)}: "
                         f"{split}")
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in split):
        raise ValueError(f"every stage needs a whole number >= 1 of blocks, got split={split}")
    if sum(split) != n_layer:
        raise ValueError(f"split={split} sums to {sum(split)} blocks, but the model has n_layer={n_layer}")
    return split


def stage_layers(split: Sequence[int]) -> list[range]:
    """The global block indices of each stage: [2, 1, 3] -> range(0, 2), range(2, 3), range(3, 6)."""
    starts = [sum(split[:s]) for s in range(len(split))]
    return [range(a, a + c) for a, c in zip(starts, split, strict=True)]


@dataclass(frozen=True)
class PipelinePlan:
    """Everything every rank must agree on: degree p, chunks per rank v, micro-batches m, the layers of each
    stage and the schedule, with its transfers (``actions[r]`` is rank r's list)."""

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


def plan_pipeline(cfg: GPTConfig, p: int, schedule: str | Schedule = "1f1b", microbatches: int = 4, v: int = 1,
                  split: Sequence[int] | None = None, global_batch: int | None = None) -> PipelinePlan:
    """Check the arguments (clear ``ValueError`` s) and build the plan. ``schedule`` is a name of ``SCHEDULES`` or
    a compute-only schedule (``list[list[Action]]``) of p ranks, m micro-batches, v chunks per rank."""
    for name, value in (("p", p), ("microbatches", microbatches), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    m = microbatches
    if isinstance(schedule, str):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}: use one of {sorted(SCHEDULES)}")
        name = SCHEDULES[schedule]
        if name != "interleaved_one_f_one_b" and v != 1:
            raise ValueError(f"{name} has one stage per rank, so v must be 1 (got v={v}); interleaving v model chunks "
                             f"per rank needs schedule='interleaved'")
        if name == "interleaved_one_f_one_b" and m % p:
            raise ValueError(f"interleaved 1F1B sends micro-batches through each model chunk in groups of p, so m must "
                             f"be a multiple of p (m >= p): got m={m} micro-batches for p={p} stages")
        compute = getattr(S, name)(p, m, v) if name == "interleaved_one_f_one_b" else getattr(S, name)(p, m)
    else:
        name, compute = "custom", [list(rank) for rank in schedule]
        S.validate(compute, p, m, v)
    if cfg.tie_embeddings and p * v > 1:
        raise ValueError("tie_embeddings=True puts one weight on the first and the last stage: its gradient would need "
                         "an all-reduce between those ranks (Megatron's embedding group), which this executor does not "
                         "do; use an untied model")
    if global_batch is not None and global_batch % m:
        raise ValueError(f"the global batch of {global_batch} rows does not split into m={m} equal micro-batches: "
                         f"choose m dividing {global_batch}")
    counts = layer_split(cfg.n_layer, p * v, split)
    actions = S.add_send_recv(compute) if p > 1 else compute
    micro = global_batch // m if global_batch is not None else 0
    return PipelinePlan(p, v, m, name, counts, stage_layers(counts), micro, actions)


# ---------------------------------------------------------------------------------------------- the stages


class Stage(nn.Module):
    """One (virtual) stage: [embeddings] -> its blocks -> [final norm + head]. ``named_parameters()`` gives the
    global names of ``GPT`` (``blocks`` is a ``ModuleDict`` keyed by the global block index).

    ``forward(x)`` is the whole stage (token ids in on stage 0, logits out on the last): what
    ``torch.distributed.pipelining.PipelineStage`` wraps. The executor calls ``embed`` and ``body`` separately.
    """

    def __init__(self, model: GPT, index: int, n_stages: int, layers: range) -> None:
        super().__init__()
        self.index, self.n_stages, self.layers = index, n_stages, layers
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        if self.is_first:
            self.tok_emb = model.tok_emb
            self.pos_emb = model.pos_emb
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if self.is_last:
            self.norm_f = model.norm_f
            self.lm_head = model.lm_head

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return GPT.embed(self, idx)  # the same code as the full model (it only reads tok_emb and pos_emb)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        """Blocks, then (last stage) final norm + head: hidden states in, hidden states or logits out."""
        for block in self.blocks.values():
            x = block(x)
        return GPT.head(self, x) if self.is_last else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(x) if self.is_first else x)

    def embedding_parameters(self) -> list[nn.Parameter]:
        if not self.is_first:
            return []
        return [p for m in (self.tok_emb, self.pos_emb) if m is not None for p in m.parameters() if p.requires_grad]

    def body_parameters(self) -> list[nn.Parameter]:
        emb = {id(p) for p in self.embedding_parameters()}
        return [p for p in self.parameters() if p.requires_grad and id(p) not in emb]


def build_stages(cfg: GPTConfig, plan: PipelinePlan, rank: int, seed: int = 0) -> dict[int, Stage]:
    """This rank's stages, by stage index, cut from ``GPT(cfg, seed)`` (same initial weights as the baseline)."""
    model = GPT(cfg, seed=seed)
    return {s: Stage(model, s, plan.n_stages, plan.layers[s]) for s in plan.stages_of(rank)}


# ------------------------------------------------------------------------------- backward split in I and W


def _grad_node(t: torch.Tensor) -> Node:
    """The autograd node a tensor's gradient flows into: its ``grad_fn``, or a leaf's ``AccumulateGrad``."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


@dataclass(eq=False)  # compared by identity (it holds tensors)
class _WeightGroup:
    """Weights whose gradients branch off the input-gradient path at ``nodes``; ``grads[i]``: what reached
    ``nodes[i]`` (one gradient per output of the forward op) during ``I``."""

    params: list[torch.Tensor]
    nodes: list[Node]
    grads: list[tuple[torch.Tensor | None, ...] | None] = field(default_factory=list)


def _weight_groups(output: torch.Tensor, x: torch.Tensor, params: Sequence[torch.Tensor]) -> list[_WeightGroup]:
    """Where each parameter's gradient leaves the path output -> x (the nodes ``I`` runs anyway), grouped so that
    parameters sharing such a node are computed together (then none is counted twice)."""
    parents: defaultdict[Node, list[Node]] = defaultdict(list)  # reverse edges: node -> nodes that feed it a grad
    seen, stack = {output.grad_fn}, [output.grad_fn]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is not None:
                parents[child].append(node)
                if child not in seen:
                    seen.add(child)
                    stack.append(child)
    on_path, stack = set(), [_grad_node(x)]  # every node between the output and x
    while stack:
        node = stack.pop()
        for parent in parents[node]:
            if parent not in on_path:
                on_path.add(parent)
                stack.append(parent)
    groups: list[_WeightGroup] = []
    owner: dict[Node, _WeightGroup] = {}
    for p in params:
        hits, visited, stack = [], set(), [_grad_node(p)]
        while stack:  # walk up from the weight until the path: weight-only nodes (transposes, ...) are W's work
            node = stack.pop()
            for parent in parents[node]:
                if parent in on_path:
                    hits.append(parent)
                elif parent not in visited:
                    visited.add(parent)
                    stack.append(parent)
        if not hits:
            continue  # the weight does not influence the output (e.g. an expert no token chose): no gradient
        merged = list({id(owner[n]): owner[n] for n in hits if n in owner}.values())
        group = _WeightGroup([p], list(dict.fromkeys(hits)))
        for other in merged:
            group.params += other.params
            group.nodes += [n for n in other.nodes if n not in group.nodes]
            groups.remove(other)
        groups.append(group)
        for n in group.nodes:
            owner[n] = group
    return groups


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None, x: torch.Tensor,
                   params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[_WeightGroup]]:
    """``I``: the gradient of the stage input ``x`` only (``x`` must influence ``output``); returns it and what
    ``backward_weight`` needs: for each group of weights, the nodes where their gradients leave the input path and
    the gradients that reached those nodes (captured by pre-hooks while this pass runs them anyway). The graph is
    retained (``retain_graph=True``): W still needs the stored layer inputs."""
    if grad_output is None:
        grad_output = torch.ones_like(output)
    groups = _weight_groups(output, x, params)
    hooks = []
    for group in groups:
        group.grads = [None] * len(group.nodes)
        for i, node in enumerate(group.nodes):
            def capture(grad_outputs, group=group, i=i):
                group.grads[i] = tuple(grad_outputs)
            hooks.append(node.register_prehook(capture))
    try:
        (dx,) = torch.autograd.grad(output, inputs=[x], grad_outputs=grad_output, retain_graph=True)
    finally:
        for h in hooks:
            h.remove()
    return dx, groups


def backward_weight(groups: list[_WeightGroup]) -> None:
    """``W``: accumulate the weight gradients into ``.grad``, restarting from the nodes ``I`` captured."""
    for group in groups:
        edges, grads = [], []
        for node, captured in zip(group.nodes, group.grads, strict=True):
            for i, g in enumerate(captured or ()):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            continue
        hooks = []
        if len(group.nodes) > 1:  # a captured node below another one of the group: use only its captured gradient
            for node, captured in zip(group.nodes, group.grads, strict=True):
                hooks.append(node.register_prehook(lambda _, saved=captured: saved))
        try:
            dws = torch.autograd.grad(edges, group.params, grad_outputs=grads, allow_unused=True)
        finally:
            for h in hooks:
                h.remove()
        for p, dw in zip(group.params, dws, strict=True):
            if dw is not None:
                p.grad = dw if p.grad is None else p.grad + dw
        group.grads = []


# ------------------------------------------------------------------------------------------------ executor


@dataclass(frozen=True)
class TimedAction:
    """One action as it ran: ``start``/``end`` in ``time.perf_counter`` seconds (transfers: when posted);
    ``wait``: seconds spent waiting for the action's input (a receive) before ``start``."""

    action: Action
    start: float
    end: float
    wait: float = 0.0


@dataclass
class StepRecord:
    """One optimizer step on one rank: its actions as they ran, its communication, the unscaled loss of each
    micro-batch (last stage only), and the step's wall-clock span including the optimizer."""

    step: int
    actions: list[TimedAction] = field(repr=False)
    comm: list[comm.CommRecord] = field(repr=False)
    losses: list[float]
    start: float
    end: float


class PipelineExecutor:
    """Runs this rank's action list for one batch: ``run(x, y)``. Subclass to change a piece (a test breaks
    ``scale_loss`` on purpose). ``emulate=(t_f, t_b, t_w)`` adds that many seconds of sleep to each F, B, W
    (I: t_b - t_w): the emulated-device mode for timing on a small CPU."""

    def __init__(self, stages: dict[int, Stage], plan: PipelinePlan, rank: int, group: comm.Group = None,
                 loss_fn: LossFn = lm_loss, emulate: tuple[float, float, float] | None = None) -> None:
        self.stages, self.plan, self.rank, self.group = stages, plan, rank, group
        self.loss_fn, self.emulate = loss_fn, emulate
        self.actions = plan.actions[rank]
        self.prefetch = True  # post each compute action's receives one compute action early
        block = next(iter(next(iter(stages.values())).blocks.values()))
        self.d_model = block.attn.q_proj.in_features

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What each micro-batch back-propagates: its mean loss / m, so the m backwards sum to the batch mean."""
        return loss / self.plan.m

    def _peer(self, stage: int) -> int:
        r = self.plan.rank_of(stage)
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def _sleep(self, kind: Kind) -> None:
        if self.emulate:
            t_f, t_b, t_w = self.emulate
            time.sleep({Kind.F: t_f, Kind.B: t_b, Kind.I: t_b - t_w, Kind.W: t_w}[kind])

    def run(self, x: torch.Tensor, y: torch.Tensor) -> tuple[list[float], list[TimedAction]]:
        """One pass of the schedule over the micro-batches of (x, y); gradients accumulate into ``.grad``.
        Returns the unscaled micro-batch losses (on the rank of the last stage, else []) and the timeline."""
        plan = self.plan
        micro = micro_batches(x, y, plan.m)
        self._shape = (x.shape[0] // plan.m, x.shape[1], self.d_model)  # every message: one [b, s, h] tensor
        self._ctx: dict[tuple[int, int], dict[str, Any]] = {}
        self._inbox: dict[tuple[Kind, int, int], tuple[torch.Tensor, Any]] = {}  # (F|B, j, stage) -> data, work
        self._outbox: dict[tuple[Kind, int, int], torch.Tensor] = {}
        self._sends: list[tuple[Any, torch.Tensor]] = []
        self._losses: dict[int, float] = {}
        actions, timed = self.actions, {}
        for i, a in enumerate(actions):
            if i in timed:
                continue  # a receive already posted ahead of time
            if not a.is_compute:
                start = time.perf_counter()
                self._transfer(a)
                timed[i] = TimedAction(a, start, time.perf_counter())
                continue
            if self.prefetch:  # post the next compute action's receives now: its data arrives while this one runs
                k = i + 1
                while k < len(actions) and not actions[k].is_compute:
                    k += 1
                for q in range(i + 1, k):
                    if actions[q].kind in (Kind.RECV_F, Kind.RECV_B):
                        start = time.perf_counter()
                        self._transfer(actions[q])
                        timed[q] = TimedAction(actions[q], start, time.perf_counter())
            wait = self._wait_inputs(a)
            start = time.perf_counter()
            {Kind.F: self._forward, Kind.B: self._backward, Kind.I: self._backward_input,
             Kind.W: self._backward_weight}[a.kind](a, micro)
            self._sleep(a.kind)
            timed[i] = TimedAction(a, start, time.perf_counter(), wait)
        timeline = [timed[i] for i in range(len(actions))]
        for work, _ in self._sends:
            work.wait()
        if self._inbox or self._outbox or self._ctx:
            raise RuntimeError(f"rank {self.rank}: data left after the schedule (a schedule without every transfer?): "
                               f"{sorted(self._inbox)} {sorted(self._outbox)} {sorted(self._ctx)}")
        return [self._losses[j] for j in sorted(self._losses)], timeline

    # -- transfers
    def _transfer(self, a: Action) -> None:
        j, s = a.microbatch, a.stage
        if a.kind is Kind.RECV_F:
            buf = torch.empty(self._shape)
            self._inbox[Kind.F, j, s] = (buf, comm.irecv(buf, self._peer(s - 1), self.group))
        elif a.kind is Kind.RECV_B:
            buf = torch.empty(self._shape)
            self._inbox[Kind.B, j, s] = (buf, comm.irecv(buf, self._peer(s + 1), self.group))
        elif a.kind is Kind.SEND_F:
            t = self._outbox.pop((Kind.F, j, s))
            self._sends.append((comm.isend(t, self._peer(s + 1), self.group), t))
        else:  # SEND_B
            t = self._outbox.pop((Kind.B, j, s))
            self._sends.append((comm.isend(t, self._peer(s - 1), self.group), t))

    def _wait_inputs(self, a: Action) -> float:
        """Wait for the receive the action needs (if any); return the seconds waited."""
        key = (Kind.F, a.microbatch, a.stage) if a.kind is Kind.F else (Kind.B, a.microbatch, a.stage)
        if a.kind is Kind.W or key not in self._inbox:
            return 0.0
        t0 = time.perf_counter()
        data, work = self._inbox[key]
        if work is not None:
            work.wait()
            self._inbox[key] = (data, None)
        return time.perf_counter() - t0

    def _deliver(self, kind: Kind, j: int, to_stage: int, tensor: torch.Tensor) -> None:
        """Output of a compute action for stage ``to_stage``: same rank -> its inbox; else -> the SEND's outbox."""
        if self.plan.rank_of(to_stage) == self.rank:
            self._inbox[kind, j, to_stage] = (tensor, None)
        else:
            self._outbox[kind, j, to_stage - 1 if kind is Kind.F else to_stage + 1] = tensor  # key: the sender

    # -- compute
    def _forward(self, a: Action, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        j, s = a.microbatch, a.stage
        stage, ctx = self.stages[s], {}
        if stage.is_first:
            ctx["h"] = stage.embed(micro[j][0])  # its backward is weight work only (no input gradient)
            x = ctx["h"].detach().requires_grad_(True)
        else:
            x = self._inbox.pop((Kind.F, j, s))[0].requires_grad_(True)
        out = stage.body(x)
        if stage.is_last:
            loss = self.loss_fn(out, micro[j][1])
            self._losses[j] = loss.item()
            out = self.scale_loss(loss)
        else:
            self._deliver(Kind.F, j, s + 1, out.detach())
        ctx["x"], ctx["out"] = x, out
        self._ctx[j, s] = ctx

    def _grad_output(self, j: int, s: int) -> torch.Tensor | None:
        return None if self.stages[s].is_last else self._inbox.pop((Kind.B, j, s))[0]

    def _backward(self, a: Action, micro: Any) -> None:
        j, s = a.microbatch, a.stage
        ctx = self._ctx.pop((j, s))
        torch.autograd.backward(ctx["out"], self._grad_output(j, s))
        if self.stages[s].is_first:
            if "h" in ctx and ctx["h"].requires_grad:
                ctx["h"].backward(ctx["x"].grad)
        else:
            self._deliver(Kind.B, j, s - 1, ctx["x"].grad)

    def _backward_input(self, a: Action, micro: Any) -> None:
        j, s = a.microbatch, a.stage
        ctx, stage = self._ctx[j, s], self.stages[s]
        dx, ctx["groups"] = backward_input(ctx.pop("out"), self._grad_output(j, s), ctx["x"], stage.body_parameters())
        if stage.is_first:
            ctx["dh"] = dx
        else:
            self._deliver(Kind.B, j, s - 1, dx)
        del ctx["x"]

    def _backward_weight(self, a: Action, micro: Any) -> None:
        ctx = self._ctx.pop((a.microbatch, a.stage))
        backward_weight(ctx["groups"])
        if "h" in ctx and ctx["h"].requires_grad:
            ctx["h"].backward(ctx["dh"])


# ------------------------------------------------------------------------------------------------ training


@dataclass
class PPResult(TrainResult):
    """``TrainResult`` of one rank: losses (the global-batch mean, on every rank) and **this rank's** parameters by
    global name (``merge_results`` joins the ranks'), plus its stages and the per-step records."""

    rank: int = 0
    stages: list[int] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list, repr=False)
    plan: PipelinePlan | None = field(default=None, repr=False)


def train_pp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None,
             schedule: str | Schedule = "1f1b", microbatches: int = 4, v: int = 1, split: Sequence[int] | None = None,
             group: comm.Group = None, loss_fn: LossFn = lm_loss, emulate: tuple[float, float, float] | None = None,
             executor_class: type[PipelineExecutor] = PipelineExecutor) -> PPResult:
    """Train with pipeline parallelism over ``group`` (a ``launch`` target: ``launch(train_pp, 2, cfg, tc)``).

    p = the group's size; the model is cut into p * v stages (``split`` blocks each, equal by default); each step
    runs ``schedule`` over ``microbatches`` micro-batches of ``global_batch(step, tc.global_batch, ...)`` and every
    rank steps the optimizer on its own stages' parameters. Returns the per-step losses (mean over the global
    batch, computed by the last stage and broadcast), this rank's final parameters (``merge_results`` joins them),
    and each step's timeline and communication records.
    """
    tc = tc or TrainConfig()
    p = dist.get_world_size(group) if group is not None else world_size
    me = dist.get_rank(group) if group is not None else rank
    plan = plan_pipeline(cfg, p, schedule, microbatches, v, split, tc.global_batch)
    stages = build_stages(cfg, plan, me, tc.seed)
    params = [q for st in stages.values() for q in st.parameters() if q.requires_grad]
    opt = make_optimizer(params, tc)
    executor = executor_class(stages, plan, me, group, loss_fn, emulate)
    records, step_losses = [], []
    for step in range(tc.steps):
        x, y = global_batch(step, tc.global_batch, cfg.seq_len, tc.seed)
        opt.zero_grad(set_to_none=True)
        with comm.recording() as log:
            start = time.perf_counter()
            losses, timeline = executor.run(x, y)
        opt.step()
        records.append(StepRecord(step, timeline, list(log.records), losses, start, time.perf_counter()))
        step_losses.append(sum(losses) / len(losses) if losses else 0.0)
    last = dist.get_global_rank(group, plan.rank_of(plan.n_stages - 1)) if group is not None else \
        plan.rank_of(plan.n_stages - 1)
    losses_t = torch.tensor(step_losses, dtype=torch.float64)
    if p > 1:
        comm.broadcast(losses_t, src=last, group=group)  # one call after training: only the last stage has them
    named = {}
    for st in stages.values():
        named.update(full_params(st))
    return PPResult(losses_t.tolist(), named, rank=me, stages=sorted(stages), steps=records, plan=plan)


def merge_results(results: Sequence[TrainResult]) -> TrainResult:
    """Join the ranks' ``PPResult`` s (as ``launch`` returns them) into one ``TrainResult`` with every parameter,
    comparable with ``train_baseline`` by ``course_lib.train.compare``."""
    if not results:
        raise ValueError("no results to merge")
    params: dict[str, torch.Tensor] = {}
    for r in results:
        if r.losses != results[0].losses:
            raise ValueError(f"ranks report different losses: {r.losses} vs {results[0].losses}")
        twice = sorted(set(params) & set(r.params))
        if twice:
            raise ValueError(f"parameters held by two ranks: {twice}")
        params.update(r.params)
    return TrainResult(list(results[0].losses), params)


def measured_timeline(results: Sequence[PPResult], step: int = -1) -> S.Timeline:
    """The compute actions of one step on every rank, as (start, end, action) in seconds from the step's first
    start: the format of ``schedules.simulate(...).timeline``, for the same Gantt chart. ``results``: the
    pipeline's ranks in (group) rank order, as ``launch`` returns them."""
    per_rank = [[t for t in r.steps[step].actions if t.action.is_compute] for r in results]
    t0 = min(t.start for rank in per_rank for t in rank)
    return [[(t.start - t0, t.end - t0, t.action) for t in rank] for rank in per_rank]


def measured_bubble_fraction(results: Sequence[PPResult], step: int = -1) -> float:
    """1 - busy / (p x makespan) for one step: the idle share of rank-time, as ``Simulation.bubble_fraction``.
    Busy = the compute actions' durations; makespan = first compute start to last compute end over all ranks."""
    timeline = measured_timeline(results, step)
    makespan = max(end for rank in timeline for _, end, _ in rank)
    busy = sum(end - start for rank in timeline for start, end, _ in rank)
    return 1 - busy / (len(timeline) * makespan)


# ---------------------------------------------------------------------------------------- torch's version


def train_torch_pp(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig | None = None,
                   schedule: str = "1f1b", microbatches: int = 4, v: int = 1, split: Sequence[int] | None = None,
                   group: comm.Group = None) -> PPResult:
    """The same training with ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe`` /
    ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble``) on the same stages: the
    production API, as a second oracle. Its loss_fn returns each micro-batch's mean loss and the schedule divides
    the accumulated gradients by m (``scale_grads=True``, the default): the same 1/m. Its transfers are not logged.
    """
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    tc = tc or TrainConfig()
    p = dist.get_world_size(group) if group is not None else world_size
    me = dist.get_rank(group) if group is not None else rank
    plan = plan_pipeline(cfg, p, schedule, microbatches, v, split, tc.global_batch)
    stages = build_stages(cfg, plan, me, tc.seed)
    pipe_stages = [PipelineStage(st, s, plan.n_stages, torch.device("cpu"), group=group) for s, st in stages.items()]
    single = {"gpipe": ScheduleGPipe, "one_f_one_b": Schedule1F1B}
    multi = {"interleaved_one_f_one_b": ScheduleInterleaved1F1B, "zb_h1": ScheduleInterleavedZeroBubble}
    if plan.schedule in single:
        runner = single[plan.schedule](pipe_stages[0], plan.m, loss_fn=lm_loss)
    elif plan.schedule in multi:
        runner = multi[plan.schedule](pipe_stages, plan.m, loss_fn=lm_loss)
    else:
        raise ValueError(f"no torch schedule for {schedule!r}")
    params = [q for st in stages.values() for q in st.parameters() if q.requires_grad]
    opt = make_optimizer(params, tc)
    has_first, has_last = 0 in stages, plan.n_stages - 1 in stages
    step_losses = []
    for step in range(tc.steps):
        x, y = global_batch(step, tc.global_batch, cfg.seq_len, tc.seed)
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        args = (x,) if has_first else ()
        runner.step(*args, target=y if has_last else None, losses=losses if has_last else None)
        opt.step()
        step_losses.append(float(torch.stack(losses).detach().mean()) if has_last else 0.0)
    last = dist.get_global_rank(group, plan.rank_of(plan.n_stages - 1)) if group is not None else \
        plan.rank_of(plan.n_stages - 1)
    losses_t = torch.tensor(step_losses, dtype=torch.float64)
    dist.broadcast(losses_t, src=last, group=group)
    named = {}
    for st in stages.values():
        named.update(full_params(st))
    return PPResult(losses_t.tolist(), named, rank=me, stages=sorted(stages), plan=plan)


# --------------------------------------------------------------------------------------------- balancing


def stage_costs(costs: Sequence[float], split: Sequence[int], first_extra: float = 0.0,
                last_extra: float = 0.0) -> list[float]:
    """The cost of each stage of ``split`` (blocks per stage): its blocks' costs, plus ``first_extra`` (embedding)
    on the first stage and ``last_extra`` (final norm, head, loss) on the last."""
    if sum(split) != len(costs):
        raise ValueError(f"split {list(split)} covers {sum(split)} layers, costs has {len(costs)}")
    out = [float(sum(costs[r.start:r.stop])) for r in stage_layers(list(split))]
    out[0] += first_extra
    out[-1] += last_extra
    return out


def balance_stages(costs: Sequence[float], n_stages: int, first_extra: float = 0.0, last_extra: float = 0.0,
                   memory: Sequence[float] | None = None, memory_limit: float | None = None) -> list[int]:
    """The contiguous split of the layers into ``n_stages`` stages (>= 1 layer each) that minimizes the slowest
    stage's cost (the pipeline's clock: every step of the schedule waits for it).

    ``costs[i]``: layer i's cost (e.g. measured forward + backward seconds, ``measure_layer_costs``); the first
    stage also pays ``first_extra`` and the last ``last_extra``. With ``memory`` (per layer) and ``memory_limit``,
    only splits whose every stage fits are allowed. Exact (dynamic programming over split points, O(n_stages L^2)).
    Among equally good splits it returns the one with the earliest cuts.
    """
    n = len(costs)
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"n_stages must be a positive integer, got {n_stages!r}")
    if n_stages > n:
        raise ValueError(f"cannot cut {n} layers into {n_stages} stages of at least one layer each")
    if any(c < 0 for c in costs):
        raise ValueError(f"costs must be >= 0, got {list(costs)}")
    if (memory is None) != (memory_limit is None):
        raise ValueError("give both memory (per layer) and memory_limit, or neither")
    if memory is not None and len(memory) != n:
        raise ValueError(f"memory needs one value per layer ({n}), got {len(memory)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    mprefix = [0.0]
    for mem in memory or []:
        mprefix.append(mprefix[-1] + mem)
    inf = float("inf")

    def segment(k: int, i: int, j: int) -> float:  # stage k (0-based) = layers i..j-1
        if memory_limit is not None and mprefix[j] - mprefix[i] > memory_limit:
            return inf
        return prefix[j] - prefix[i] + (first_extra if k == 0 else 0.0) + (last_extra if k == n_stages - 1 else 0.0)

    # best[k][j]: the smallest max stage cost putting layers 0..j-1 into stages 0..k; cut[k][j]: where stage k starts
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n + 1):
        best[0][j] = segment(0, 0, j)
    for k in range(1, n_stages):
        for j in range(k + 1, n + 1):
            for i in range(k, j):
                value = max(best[k - 1][i], segment(k, i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    if best[n_stages - 1][n] == inf:
        raise ValueError(f"no split into {n_stages} stages keeps every stage within memory_limit={memory_limit}")
    bounds, j = [n], n
    for k in range(n_stages - 1, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [bounds[k + 1] - bounds[k] for k in range(n_stages)]


@dataclass(frozen=True)
class LayerCosts:
    """Measured forward + backward seconds (median over repeats) of the embedding, each block, and the final
    norm + head + loss, on this process: the inputs of ``balance_stages``."""

    embed: float
    blocks: list[float]
    head: float

    def balance(self, n_stages: int) -> list[int]:
        return balance_stages(self.blocks, n_stages, first_extra=self.embed, last_extra=self.head)


def measure_layer_costs(cfg: GPTConfig, micro_batch: int = 2, repeats: int = 5, seed: int = 0) -> LayerCosts:
    """Time each piece of ``GPT(cfg)`` on a micro-batch: forward, then backward piece by piece (each piece's input
    detached, so its backward is timed alone). Run it where the stages will run (same threads, same device)."""
    model = GPT(cfg, seed=seed)
    x, y = global_batch(0, micro_batch, cfg.seq_len, seed)
    samples: list[list[float]] = [[] for _ in range(cfg.n_layer + 2)]
    for rep in range(repeats + 1):  # the first pass warms up
        pieces, times, h = [], [], None
        t = time.perf_counter()
        out = model.embed(x)
        times.append(time.perf_counter() - t)
        pieces.append((None, out))
        for block in model.blocks:
            h = out.detach().requires_grad_(True)
            t = time.perf_counter()
            out = block(h)
            times.append(time.perf_counter() - t)
            pieces.append((h, out))
        h = out.detach().requires_grad_(True)
        t = time.perf_counter()
        loss = lm_loss(model.head(h), y)
        times.append(time.perf_counter() - t)
        pieces.append((h, loss))
        grad = None
        for i in range(len(pieces) - 1, -1, -1):
            inp, out = pieces[i]
            t = time.perf_counter()
            out.backward(grad)
            times[i] += time.perf_counter() - t
            grad = inp.grad if inp is not None else None
        if rep > 0:
            for i, ti in enumerate(times):
                samples[i].append(ti)
    med = [statistics.median(s) for s in samples]
    return LayerCosts(med[0], med[1:-1], med[-1])
