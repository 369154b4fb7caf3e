"""Expert parallelism among the other axes: which ranks hold which experts, and over which group each gradient and
each optimizer shard lives.

The mesh (``course_lib.runtime.mesh``) re-reads the dp x cp ranks of one (tp, pp) coordinate as ep x edp: the tokens of
an MoE layer travel over ``"ep"`` (the all-to-alls of ``ExpertParallelMoE``), and an expert is replicated over
``"edp"`` (edp = dp x cp / ep, Megatron-Core's "expert data parallel" group). Per axis:

* **PP** (DeepSeek-V3: PP 16 x EP 64 x ZeRO-1, no TP): each stage's MoE layers are expert-parallel over the ep
  ranks of that stage (apply EP before the pipeline cut, so a stage holds the global experts its ep coordinate
  gives it, E/ep per layer, named by their global index). The ranks of one ep group run the same stage, so they
  meet in the same order at every all-to-all of the schedule. After the schedule, ``ExpertParallel`` reduces the
  gradients of this rank's stages only (``ExpertParallel.hold``): dense ones summed over dp x cp, the experts'
  over edp, both divided by dp x cp (every rank's loss is the mean of its own rows). The pipeline's own
  ``REDUCE_GRAD`` over dp x cp is not used: it would average different experts of the same slot (ranks of one
  dp x cp group hold different experts). Router losses back-propagate through each layer's output
  (``moe_mesh``), with the refusal there for capacity / the load-balancing loss under a pipeline with dp > 1.
* **TP**: attention, embeddings, norms and the LM head tensor-parallel (``tp_plan``: ``tp.gpt_plan`` without the
  MoE layers); the router and the experts replicated over tp, no expert tensor parallelism (Megatron-Core's
  ``expert_tensor_parallel_size=1``): every tp rank of a (dp, cp) coordinate routes the same tokens, runs the
  same experts (its ep group lies inside its tp coordinate), and gets the same expert gradients, so nothing is
  reduced over tp for them; their gradients are reduced over edp of that tp coordinate. Sequence parallelism is
  refused (the MoE would see s/tp tokens per rank: another batch order for the queues and router partial sums).
* **CP**: the cp ranks hold other tokens of the same rows: for the experts they are data-parallel ranks like dp
  (ep divides dp x cp). Dropless routing and the load-balancing loss (f_i from the exchanged counts, a sum) are
  unchanged; capacity queues follow the single-process token order, which the layout interleaves over the cp
  ranks, so with capacity every rank's choices are gathered in that order (``ExpertParallelMoE.token_order_keep``,
  through ``moe_mesh.RoutingShards``) and the kept counts of every rank taken from there.
* **ZeRO-1** (``ExpertShardedOptimizer``): Megatron's distributed optimizer keeps the expert parameters in their
  own buffers, sharded over the expert-data-parallel group: here the dense parameters' optimizer state is
  partitioned over dp x cp and the experts' over edp (one ``ShardedOptimizer`` each; with edp = 1 each rank
  steps its own experts). A single partition over dp x cp would broadcast one rank's expert into the slot of
  another's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from course_lib.model_config import GPTConfig
from course_lib.parallel.ep import ExpertParallel
from course_lib.parallel.sharded_optimizer import ShardedOptimizer
from course_lib.parallel.tp import Style, gpt_plan
from course_lib.runtime.mesh import Mesh


def tp_plan(config: GPTConfig) -> dict[str, Style]:
    """The tensor-parallel plan of a GPT on a mesh with experts: ``tp.gpt_plan`` without ``blocks.*.mlp`` when
    the blocks hold MoE layers (router, experts and shared experts stay replicated over tp)."""
    plan = gpt_plan(config)
    if config.n_expert:
        del plan["blocks.*.mlp"]
    return plan


class ExpertShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 with experts: ``optimizer_cls`` over the dense parameters partitioned over dp x cp and over the
    expert parameters partitioned over edp (the module docstring). ``dense`` and ``experts`` are the two
    ``ShardedOptimizer``\\ s (``experts`` a plain ``optimizer_cls`` when edp = 1). Gradients must already be
    reduced (``ExpertParallel.finish_gradient_sync``)."""

    def __init__(self, params: list[nn.Parameter], ep: ExpertParallel, mesh: Mesh,
                 optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        expert_ids = {id(p) for p in ep.expert_params}
        mine = [p for p in params if p.requires_grad]
        dense, experts = [p for p in mine if id(p) not in expert_ids], [p for p in mine if id(p) in expert_ids]
        self.dense = ShardedOptimizer(dense, optimizer_cls, group=mesh.group("dp", "cp"), average_gradients=False,
                                      broadcast=False, **kwargs)
        self.experts: torch.optim.Optimizer | None = None
        if experts:
            self.experts = (ShardedOptimizer(experts, optimizer_cls, group=mesh.group("edp"),
                                             average_gradients=False, broadcast=False, **kwargs)
                            if mesh.size("edp") > 1 else optimizer_cls(experts, **kwargs))
        super().__init__(mine, {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("ExpertShardedOptimizer.step takes no closure")
        self.dense.step()
        if self.experts is not None:
            self.experts.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none)
        if self.experts is not None:
            self.experts.zero_grad(set_to_none)
