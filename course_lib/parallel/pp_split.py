"""The backward split in two for zero-bubble schedules: ``I`` (input gradient), ``W`` (weights').

``I`` computes only the stage input's gradient, the one the previous stage waits for
(``torch.autograd.grad(output, inputs=[input], retain_graph=True)``); ``W`` the weight gradients
later, in a gap of the schedule. ``I`` keeps, for every weight, the graph nodes where its gradient
branches off the input-gradient path and the gradient that reached each (a pre-hook); ``W``
restarts back-propagation from those nodes (``GradientEdge``), so it does only the weight part
(g^T x per linear), as ``torch.distributed.pipelining``'s ``stage_backward_input`` /
``stage_backward_weight`` do. The micro-batch's graph lives until ``W`` (``peak_in_flight`` counts
it). Stage 0's embedding has no input gradient: its whole backward is weight work, in ``W``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


def _grad_node(t: torch.Tensor) -> Node:
    """The node a tensor's gradient flows into: its ``grad_fn``, or a leaf's ``AccumulateGrad``."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


@dataclass(eq=False)  # compared by identity (it holds tensors)
class _WeightGroup:
    """Weights whose gradients branch off the input-gradient path at ``nodes``; ``grads[i]``: what
    reached ``nodes[i]`` (one gradient per output of the forward op) during ``I``."""

    params: list[torch.Tensor]
    nodes: list[Node]
    grads: list[tuple[torch.Tensor | None, ...] | None] = field(default_factory=list)


def _weight_groups(output: torch.Tensor, x: torch.Tensor,
                   params: Sequence[torch.Tensor]) -> list[_WeightGroup]:
    """Where each parameter's gradient leaves the path output -> x (nodes ``I`` runs anyway),
    grouped so that parameters sharing such a node are computed together (none counted twice)."""
    parents: defaultdict[Node, list[Node]] = defaultdict(list)  # reverse edges (child -> parents)
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
        while stack:  # up from the weight to the path; weight-only nodes (transposes...) are W's
            node = stack.pop()
            for parent in parents[node]:
                if parent in on_path:
                    hits.append(parent)
                elif parent not in visited:
                    visited.add(parent)
                    stack.append(parent)
        if not hits:
            continue  # no influence on the output (e.g. an expert no token chose): no gradient
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
    """``I``: the gradient of the stage input ``x`` only (``x`` must influence ``output``), and what
    ``backward_weight`` needs: per group of weights, the nodes where their gradients leave the input
    path and the gradients that reached them (caught by pre-hooks while this pass runs them anyway).
    The graph is retained: W still needs the stored layer inputs."""
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
    """``W``: accumulate the weight gradients into ``.grad``, from the nodes ``I`` captured."""
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
        if len(group.nodes) > 1:  # a node below another of the group: only its captured gradient
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
