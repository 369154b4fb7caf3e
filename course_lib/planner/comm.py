"""The planner's communication: which ranks a group spans (how many GPUs, on how many nodes) and the alpha-beta
time of a collective or an all-to-all on the links it really crosses (``cost.collective_time``)."""

from __future__ import annotations

from functools import lru_cache

from course_lib.estimates import cost
from course_lib.estimates.hardware import Link
from course_lib.planner.candidate import Cluster
from course_lib.runtime.mesh import DEFAULT_ORDER, MeshShape


def _time(link: Link, op: cost.Collective, nbytes: float, n: int) -> float:
    """A collective of ``nbytes`` over ``n`` ranks on ``link``: the alpha-beta ring time of ``cost.collective_time``."""
    return cost.collective_time(op, nbytes, n, link.alpha, link.beta)


@lru_cache(maxsize=10_000)
def group_span(shape: MeshShape, axes: tuple[str, ...], gpus_per_node: int) -> tuple[int, int]:
    """(ranks, nodes) of rank 0's group along ``axes``: how many GPUs talk, on how many nodes."""
    if shape.order != DEFAULT_ORDER:
        ranks = shape.group_ranks(0, *axes)
        return len(ranks), len({r // gpus_per_node for r in ranks})
    return _strided_span(_strides(shape, axes), gpus_per_node)


def _strides(shape: MeshShape, axes: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    """(stride, degree) of each axis of rank 0's group in Megatron's order (tp-cp-ep-dp-pp: dense strides 1, tp,
    tp cp, tp cp dp; the expert reading numbers the dp x cp ranks i = ep + EP edp, at rank tp i)."""
    if axes == ("ep",):
        return ((shape.tp, shape.ep),)
    if axes == ("edp",):
        return ((shape.tp * shape.ep, shape.dp * shape.cp // shape.ep),)
    strides = {"tp": 1, "cp": shape.tp, "dp": shape.tp * shape.cp, "pp": shape.tp * shape.cp * shape.dp}
    return tuple((strides[a], getattr(shape, a)) for a in axes)


def _ranks(strides: tuple[tuple[int, int], ...]) -> list[int]:
    """The ranks sum_a i_a stride_a, 0 <= i_a < degree_a."""
    ranks = [0]
    for stride, degree in strides:
        ranks = [r + i * stride for r in ranks for i in range(degree)]
    return ranks


@lru_cache(maxsize=10_000)
def _strided_span(strides: tuple[tuple[int, int], ...], gpus_per_node: int) -> tuple[int, int]:
    """``group_span`` of the group ``_ranks(strides)``: shared by every mesh whose group has the same strides."""
    ranks = _ranks(strides)
    return len(ranks), len({r // gpus_per_node for r in ranks})


def _group_of_rank0(shape: MeshShape, axes: tuple[str, ...]) -> list[int]:
    """``shape.group_ranks(0, *axes)``, by arithmetic for Megatron's order (``_strides``)."""
    if shape.order != DEFAULT_ORDER:
        return shape.group_ranks(0, *axes)
    return sorted(_ranks(_strides(shape, axes)))


def group_time(cl: Cluster, op: cost.Collective, nbytes: float, span: tuple[int, int]) -> float:
    """``op`` over the group ``ranks``, hierarchical as NCCL's multi-rail rings and trees behave: within each node
    (k ranks of the group there) on ``cl.intra``, then across the N nodes with V/k bytes per GPU on ``cl.inter``
    (every GPU its own NIC); one node: a ring on ``cl.intra``. all_reduce = reduce_scatter + all_gather."""
    n, nodes = span
    if n == 1:
        return 0.0
    if op == "all_reduce":
        return 2 * group_time(cl, "reduce_scatter", nbytes, span)
    if nodes == 1:
        return _time(cl.intra, op, nbytes, n)
    k = n // nodes
    return (_time(cl.intra, op, nbytes, k) if k > 1 else 0.0) + _time(cl.inter, op, nbytes / k, nodes)


def _all_to_all(cl: Cluster, span: tuple[int, int], token_bytes: float, tokens: float, top_k: int,
                node_limit: int | None, dedup: bool = False) -> float:
    """One dispatch (or combine) of ``tokens`` tokens per rank to ``top_k`` experts each, spread evenly over the
    group: the share for ranks of this node over NVLink, the rest over the network, both at once (the slower
    sets the time). A dispatcher that de-duplicates (``dedup``: DeepEP's internode kernels, NVIDIA's HybridEP;
    always so under node-limited routing) sends a token once per destination node and forwards it inside the
    node over NVLink: E[distinct other nodes] of top_k uniform picks over N nodes, N (1 - (1 - 1/N)^k) (N - 1)/N,
    capped at the node limit M; without it, each of the top_k copies bound for another node crosses the network."""
    n, nodes = span
    k = n // nodes
    intra = tokens * top_k * (k - 1) / n * token_bytes
    if node_limit is None and not dedup:
        inter = tokens * top_k * (n - k) / n * token_bytes
    else:
        distinct = nodes * (1 - (1 - 1 / nodes) ** top_k) * (nodes - 1) / nodes
        inter = tokens * min(distinct, node_limit or nodes) * token_bytes
    t_intra = (k - 1) * cl.intra.alpha + intra / cl.intra.beta if k > 1 else 0.0
    t_inter = (nodes - 1) * cl.inter.alpha + inter / cl.inter.beta if nodes > 1 else 0.0
    return max(t_intra, t_inter)
