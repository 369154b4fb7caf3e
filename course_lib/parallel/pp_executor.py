"""The pipeline executor: runs one rank's action list (``schedules``) for one batch on real ranks
and records when each action ran.

``RECV_F`` / ``RECV_B`` post an ``irecv`` the consuming compute action waits for (one compute
action ahead, as torch's runtime batches it with the previous one, so the message travels while
this rank computes); ``SEND_F`` / ``SEND_B`` post an ``isend`` waited for at the end of the step;
all through ``course_lib.comm`` (logged). Each message is one activation or its gradient, [b, s, h]:
per step 2 (n - 1) m messages of b s h x 4 bytes (n = p v stages: interleaving crosses about v
times as many boundaries, the price of its v times smaller bubble). ``REDUCE_GRAD`` calls
``grad_reduce(stage)``, the data-parallel step; under ZeRO-3 an ``engine`` (``fsdp2_pipeline``)
gathers the stage's shards before each compute action and frees them after.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from course_lib import comm
from course_lib.model import lm_loss
from course_lib.parallel.pp_split import backward_input, backward_weight
from course_lib.parallel.pp_stages import PipelinePlan, Stage
from course_lib.parallel.schedules import Action, Kind

__all__ = ["LossFn", "PipelineExecutor", "StageEngine", "StepRecord", "TimedAction"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class StageEngine(Protocol):
    """What runs around each compute action of a stage (``fsdp2_pipeline.StageSharding``)."""

    def before(self, action: Action) -> None: ...

    def after(self, action: Action) -> None: ...


@dataclass(frozen=True)
class TimedAction:
    """One action as it ran: ``start``/``end`` in ``time.perf_counter`` seconds (transfers: when
    posted); ``wait``: seconds spent waiting for the action's input (a receive) before ``start``."""

    action: Action
    start: float
    end: float
    wait: float = 0.0


@dataclass
class StepRecord:
    """One optimizer step of one rank: its actions as run, its communication, each micro-batch's
    unscaled loss (last stage only), the step's wall-clock span (optimizer included)."""

    step: int
    actions: list[TimedAction] = field(repr=False)
    comm: list[comm.CommRecord] = field(repr=False)
    losses: list[float]
    start: float
    end: float


class PipelineExecutor:
    """Runs this rank's action list for one batch: ``run(x, y)``. Subclass to change a piece (a test
    breaks ``scale_loss`` on purpose). ``emulate=(t_f, t_b, t_w)`` adds that many seconds of sleep
    to each F, B, W (I: t_b - t_w): the emulated-device mode for timing on a small CPU."""

    def __init__(self, stages: dict[int, Stage], plan: PipelinePlan, rank: int,
                 group: comm.Group = None, loss_fn: LossFn = lm_loss,
                 emulate: tuple[float, float, float] | None = None,
                 hidden_shape: Sequence[int] | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.stages, self.plan, self.rank, self.group = stages, plan, rank, group
        self.loss_fn, self.emulate = loss_fn, emulate
        self.actions = plan.actions[rank]
        self.prefetch = True  # post each compute action's receives one compute action early
        first = next(iter(stages.values()))
        self.device = next(first.parameters()).device
        self.dtype = dtype
        if hidden_shape is None:  # a GPT block: one d_model vector per token
            attn = getattr(next(iter(first.blocks.values()), None), "attn", None)
            hidden_shape = (attn.q_proj.in_features,) if attn is not None else None
        self.hidden_shape = tuple(hidden_shape) if hidden_shape is not None else None
        """Each message's shape after [rows, tokens] (GPT: [d_model]); ``PipelineParallel`` sets it
        otherwise."""
        self.sequence_shards = 1
        """Each message holds 1 / sequence_shards of the tokens (tp under sequence parallelism: a
        stage sends its s/tp tokens, a tp-th of the traffic)."""
        self.grad_reduce: Callable[[int], None] | None = None
        """The data-parallel step a stage's ``REDUCE_GRAD`` calls (``PipelineParallel.connect``)."""
        self.engine: StageEngine | None = None
        """What runs around each compute action (``fsdp2_pipeline.StageSharding``: gather the
        stage's shards before, free them after); set by ``connect``."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Back-propagate a micro-batch's mean loss / m: the m backwards sum to the batch mean."""
        return loss / self.plan.m

    def reduce_grad(self, stage: int) -> None:
        """``REDUCE_GRAD``: the weight gradients of ``stage`` are complete; start their
        data-parallel reduction (``grad_reduce(stage)``). A seam: a test skips it on purpose."""
        if self.grad_reduce is not None:
            self.grad_reduce(stage)

    def _peer(self, stage: int) -> int:
        return comm.global_rank(self.group, self.plan.rank_of(stage))

    def _sleep(self, kind: Kind) -> None:
        if self.emulate:
            t_f, t_b, t_w = self.emulate
            time.sleep({Kind.F: t_f, Kind.B: t_b, Kind.I: t_b - t_w, Kind.W: t_w}[kind])

    def run(self, x: torch.Tensor, y: torch.Tensor) -> tuple[list[float], list[TimedAction]]:
        """One pass of the schedule over (x, y)'s micro-batches, gradients accumulating in
        ``.grad``: the unscaled micro-batch losses (last stage's rank, else []) and the timeline."""
        plan = self.plan
        if x.shape[0] % plan.m:
            raise ValueError(f"a batch of {x.shape[0]} rows does not split into m={plan.m} "
                             "micro-batches")
        micro = list(zip(x.chunk(plan.m), y.chunk(plan.m), strict=True))
        # every message: one [b, s / sequence_shards, h] tensor (SP: each TP rank's s/tp tokens)
        self._shape = (x.shape[0] // plan.m, x.shape[1] // self.sequence_shards, *self.hidden_shape)
        self._ctx: dict[tuple[int, int], dict[str, Any]] = {}
        # (F|B, j, stage) -> data, work
        self._inbox: dict[tuple[Kind, int, int], tuple[torch.Tensor, Any]] = {}
        self._outbox: dict[tuple[Kind, int, int], torch.Tensor] = {}
        self._sends: list[tuple[Any, torch.Tensor]] = []
        self._losses: dict[int, float] = {}
        actions, timed = self.actions, {}
        for i, a in enumerate(actions):
            if i in timed:
                continue  # a receive already posted ahead of time
            if not a.is_compute:
                start = time.perf_counter()
                self.reduce_grad(a.stage) if a.kind is Kind.REDUCE_GRAD else self._transfer(a)
                timed[i] = TimedAction(a, start, time.perf_counter())
                continue
            if self.prefetch:  # post the next compute's receives now, to arrive while this one runs
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
            if self.engine is not None:
                self.engine.before(a)
            {Kind.F: self._forward, Kind.B: self._backward, Kind.I: self._backward_input,
             Kind.W: self._backward_weight}[a.kind](a, micro)
            if self.engine is not None:
                self.engine.after(a)
            self._sleep(a.kind)
            timed[i] = TimedAction(a, start, time.perf_counter(), wait)
        timeline = [timed[i] for i in range(len(actions))]
        for work, _ in self._sends:
            work.wait()
        if self._inbox or self._outbox or self._ctx:
            raise RuntimeError(f"rank {self.rank}: data left after the schedule (a schedule "
                               f"without every transfer?): {sorted(self._inbox)} "
                               f"{sorted(self._outbox)} {sorted(self._ctx)}")
        return [self._losses[j] for j in sorted(self._losses)], timeline

    # -- transfers
    def _transfer(self, a: Action) -> None:
        key = (Kind.F if a.kind in (Kind.RECV_F, Kind.SEND_F) else Kind.B, a.microbatch, a.stage)
        peer = self._peer(a.peer_stage)
        if a.kind in (Kind.RECV_F, Kind.RECV_B):
            buf = torch.empty(self._shape, dtype=self.dtype, device=self.device)
            self._inbox[key] = (buf, comm.irecv(buf, peer, self.group))
        else:
            t = self._outbox.pop(key)
            self._sends.append((comm.isend(t, peer, self.group), t))

    def _wait_inputs(self, a: Action) -> float:
        """Wait for the receive the action needs (if any); return the seconds waited."""
        key = (Kind.F if a.kind is Kind.F else Kind.B, a.microbatch, a.stage)
        if a.kind is Kind.W or key not in self._inbox:
            return 0.0
        t0 = time.perf_counter()
        data, work = self._inbox[key]
        if work is not None:
            work.wait()
            self._inbox[key] = (data, None)
        return time.perf_counter() - t0

    def _deliver(self, kind: Kind, j: int, to_stage: int, tensor: torch.Tensor) -> None:
        """Output for stage ``to_stage``: on this rank -> its inbox, else -> the outbox."""
        if self.plan.rank_of(to_stage) == self.rank:
            self._inbox[kind, j, to_stage] = (tensor, None)
        else:
            sender = to_stage - 1 if kind is Kind.F else to_stage + 1
            self._outbox[kind, j, sender] = tensor.contiguous()  # SP: a strided slice of the batch

    # -- compute
    def _forward(self, a: Action, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        j, s = a.microbatch, a.stage
        stage, ctx = self.stages[s], {}
        if stage.is_first:
            ctx["h"] = stage.embed(micro[j][0])  # its backward is weight work only
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
        dx, ctx["groups"] = backward_input(ctx.pop("out"), self._grad_output(j, s), ctx["x"],
                                           stage.body_parameters())
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
