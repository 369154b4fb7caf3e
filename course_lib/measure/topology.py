"""Which bytes cross a node boundary: ranks labelled with node ids, the comm log read as flows, and the prediction.

A cluster is nodes of ``gpus_per_node`` GPUs; inside a node the links are fast (NVLink, ~450 GB/s a direction on
an H100), between nodes slow (InfiniBand, ~50 GB/s a GPU). ``torchrun --nnodes=N --nproc-per-node=G`` gives
node i the contiguous global ranks ``i*G .. i*G+G-1``, so

    node(rank) = rank // gpus_per_node

and the axis order of the mesh (``course_lib.runtime.mesh``) decides which groups stay inside a node. Megatron-LM's
default ``"tp-cp-ep-dp-pp"`` puts TP fastest: a TP group of t <= G ranks is consecutive and never leaves its node,
and TP's per-layer collectives, the heaviest traffic of a step, ride NVLink.

Bytes per step are read from a run as **flows**: (source rank, destination rank, bytes, group). Each kind of record
gives its flows its own way, and the kind stays on the flow:

* point-to-point records (``peer`` set, ``bytes_kind`` MEASURED): the message we handed to the backend goes to
  ``peer`` -- **measured**;
* a backend collective (MODELLED) has no observable peers. We use the **ring model**, as ``comm`` does for its
  bytes: the group's ranks in group order form a ring and every rank sends its ``sent_bytes`` to its successor
  (a broadcast's chain from the source follows the same order). So a rank's bytes cross a node boundary exactly
  when its ring successor lives on another node -- **modelled**, not an observation (NCCL builds rings and trees
  over the topology it detects; gloo uses its own algorithms). An all-to-all sends to every other rank: its
  bytes are split equally over the n-1 peers (exact for equal splits).

The **prediction** builds the same flows from the mesh arithmetic alone (``MeshShape.all_groups``) and message
sizes from the model config: TP's collectives of each micro-batch (``parallel.tp.step_collectives``) as rings, the
pipeline's activations and gradients between neighbouring stages, and the data-parallel gradient all-reduce of the
parameters a rank trains (``memory.params_per_rank``) as a ring. A run and its prediction give equal cross-node
bytes per group when the run is what the arithmetic says it is.

To have *measured* bytes for the gradient sync, ``RingDataParallel`` replaces ``DataParallel``'s backend
all-reduce (its ``all_reduce`` seam) by the course's own ring (``collectives.ring_all_reduce``: isend/irecv, every
message logged with its peer); ``ring_data_parallel`` is the composition's data-parallel step with it.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.estimates.accounting import PlannedCollective, step_collectives
from course_lib.estimates.layout import ParallelLayout, params_per_rank
from course_lib.model_config import GPTConfig
from course_lib.parallel.compose import Parallelized
from course_lib.parallel.dp import DataParallel
from course_lib.parallel.pp_layers import layer_split
from course_lib.runtime.collectives import ring_all_reduce
from course_lib.runtime.mesh import MeshShape

NodeOf = Callable[[int], int]
RING_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def node_of(rank: int, gpus_per_node: int) -> int:
    """The node of a global rank when each node runs ``gpus_per_node`` contiguous ranks (torchrun's layout)."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return rank // gpus_per_node


def nodes(world_size: int, gpus_per_node: int) -> list[int]:
    """``node_of`` of every rank: the fake node ids a run on one machine is labelled with."""
    if world_size % gpus_per_node:
        raise ValueError(f"{world_size} ranks do not fill nodes of {gpus_per_node} GPUs: use a world size that is "
                         f"a multiple of gpus_per_node")
    return [node_of(r, gpus_per_node) for r in range(world_size)]


@dataclass(frozen=True)
class Flow:
    """``nbytes`` that rank ``src`` sends to rank ``dst`` in the group named ``group`` ("tp", "dp+cp");
    ``kind``: ``comm.MEASURED`` (our own point-to-point message) or ``comm.MODELLED`` (the ring model)."""

    src: int
    dst: int
    nbytes: int
    group: str
    kind: str


# ----------------------------------------------------------------------------------------------------------------
# Flows from a run's comm log


def group_members(label: str, rank: int, shape: MeshShape) -> list[int]:
    """The global ranks, in group order, of ``rank``'s group named ``label`` in the comm log: mesh axes joined by
    '+' ("dp+cp", the names ``Mesh`` gives), "world", "self", or "ranks[0, 2]" (an unnamed group)."""
    if label == "world":
        return list(range(shape.world_size))
    if label == "self":
        return [rank]
    found = re.fullmatch(r"ranks\[([\d, ]*)\]", label)
    if found:
        return [int(r) for r in found.group(1).split(",") if r.strip()]
    return shape.group_ranks(rank, *label.split("+"))


def record_flows(record: comm.CommRecord, rank: int, shape: MeshShape) -> list[Flow]:
    """The flows of one record of ``rank`` (see the module docstring): a send to its peer (measured); a ring
    collective to the ring successor, an all-to-all equally to every other member (modelled)."""
    if record.sent_bytes == 0:
        return []
    if record.peer is not None:
        return [Flow(rank, record.peer, record.sent_bytes, record.group, record.bytes_kind)]
    members = group_members(record.group, rank, shape)
    if rank not in members:
        raise ValueError(f"rank {rank} logged a {record.op} in group {record.group!r}, whose ranks under {shape} "
                         f"are {members}: the shape is not the one the run used (degrees or order)")
    n, pos = len(members), members.index(rank)
    if record.op in RING_OPS:
        return [Flow(rank, members[(pos + 1) % n], record.sent_bytes, record.group, comm.MODELLED)]
    if record.op == "all_to_all":
        share = record.sent_bytes // (n - 1)
        return [Flow(rank, dst, share, record.group, comm.MODELLED) for dst in members if dst != rank]
    raise ValueError(f"no flow model for {record.op!r} records")


def flows_from_log(step_comm: Sequence[Sequence[comm.CommRecord]], shape: MeshShape) -> list[Flow]:
    """Every flow of one step: ``step_comm[r]`` holds rank r's records of that step (``result.step_comm[k]``)."""
    if len(step_comm) != shape.world_size:
        raise ValueError(f"step_comm has the records of {len(step_comm)} ranks, the mesh has {shape.world_size}")
    return [f for rank, records in enumerate(step_comm) for rec in records for f in record_flows(rec, rank, shape)]


def cross_node_bytes(flows: Iterable[Flow], gpus_per_node: int, node: NodeOf | None = None) -> dict[str, int]:
    """Bytes per group that leave their source's node: the sum over flows whose ``dst`` is on another node.
    ``node``: rank -> node id (default ``node_of(rank, gpus_per_node)``). Every group of the flows is a key."""
    where = node or (lambda r: node_of(r, gpus_per_node))
    out: dict[str, int] = defaultdict(int)
    for f in flows:
        out[f.group] += f.nbytes if where(f.src) != where(f.dst) else 0
    return dict(out)


def busiest_rank_bytes(flows: Iterable[Flow], gpus_per_node: int, node: NodeOf | None = None) -> dict[str, int]:
    """Per group, the most bytes one rank sends across nodes: what a ring's slowest hop carries. A ring collective
    runs at the pace of its slowest link, so its time is about this / the inter-node bandwidth (every rank of a
    ring sends the same bytes, but only the ranks whose successor is remote send them over the slow link)."""
    where = node or (lambda r: node_of(r, gpus_per_node))
    per_rank: dict[tuple[str, int], int] = defaultdict(int)
    groups = set()
    for f in flows:
        groups.add(f.group)
        if where(f.src) != where(f.dst):
            per_rank[f.group, f.src] += f.nbytes
    return {g: max((b for (h, _), b in per_rank.items() if h == g), default=0) for g in groups}


def bytes_kinds(flows: Iterable[Flow]) -> dict[str, str]:
    """Group -> the kind of its bytes ("measured", "modelled", or "measured+modelled" when both occur)."""
    kinds: dict[str, set[str]] = defaultdict(set)
    for f in flows:
        kinds[f.group].add(f.kind)
    return {g: "+".join(sorted(k)) for g, k in kinds.items()}


# ----------------------------------------------------------------------------------------------------------------
# The prediction, from the mesh arithmetic and the model config


def ring_flows(shape: MeshShape, axes: tuple[str, ...], sent: Callable[[int, int, int], int],
               kind: str) -> list[Flow]:
    """Every group over ``axes`` as a ring in group order: rank r at position i of n sends ``sent(r, i, n)`` bytes
    to the member after it. The group is named as ``Mesh`` names it (its axes of degree > 1)."""
    label = "+".join(a for a in ("dp", "cp", "tp", "pp", "ep", "edp") if a in axes and shape.size(a) > 1)
    flows = []
    for members in shape.all_groups(*axes):
        n = len(members)
        if n > 1:
            flows += [Flow(r, members[(i + 1) % n], sent(r, i, n), label, kind) for i, r in enumerate(members)]
    return flows


def _stage_collectives(cfg: GPTConfig, micro_batch: int, t: int, stage: int, pp: int,
                       element_bytes: int) -> tuple[list[PlannedCollective], list[PlannedCollective]]:
    """TP's collectives of one micro-batch on pipeline ``stage`` (its blocks; the embedding on the first stage,
    the head and the loss on the last), and those of the once-a-step sync."""
    first = sum(layer_split(cfg.n_layer, pp)[:stage])
    mine = {f"blocks.{i}.{part}" for i in range(first, first + layer_split(cfg.n_layer, pp)[stage])
            for part in ("attn", "mlp")}
    mine |= {"tok_emb"} if stage == 0 else set()
    mine |= {"lm_head", "loss"} if stage == pp - 1 else set()
    planned = step_collectives(cfg, micro_batch, t, element_bytes=element_bytes)
    sync = [c for c in planned if c.phase == "sync"]
    if sync and pp > 1:
        raise ValueError("TP's partial-gradient sync (replicated GQA K/V heads) is counted for the whole model; "
                         "with pp > 1 each stage syncs only its own: not modelled, use tp | n_kv_head")
    return [c for c in planned if c.where in mine], sync


def predicted_flows(cfg: GPTConfig, shape: MeshShape, global_batch: int, *, microbatches: int = 1,
                    element_bytes: int = 4, dp_kind: str = comm.MEASURED) -> list[Flow]:
    """The flows of one training step of a DP x TP x PP run of ``cfg`` from arithmetic alone. Each replica takes
    B/d sequences in ``microbatches`` m micro-batches of b = B/(d m) (the pipeline's m, or gradient accumulation):

    * TP (modelled ring): for each micro-batch, the collectives of ``parallel.tp.step_collectives`` that the
      rank's pipeline stage issues (2 all-reduces of b*s*h a block forward, 2 backward; the embedding's on the
      first stage, the head's and the loss's 3 small ones on the last), plus the once-a-step sync of partial
      gradients (replicated GQA K/V heads; refused with pp > 1); rank i of t sends
      ``comm.ring_bytes(op, V, e, t, i)`` of each;
    * PP (measured p2p, one stage per rank): for each micro-batch, stage i sends its output activation b*s*h
      to stage i+1 and the gradient of its input, the same size, back to stage i-1;
    * DP: one ring all-reduce of the gradients of the parameters the rank trains, Psi =
      ``memory.params_per_rank(cfg, ParallelLayout(tp=t, pp=p), stage)`` (one bucket), 2(d-1)/d x Psi x e a
      rank; ``dp_kind`` MEASURED for ``RingDataParallel``'s own ring, MODELLED for the backend's.

    Context and expert parallelism are not modelled here: the shape must have cp = ep = 1.
    """
    if (shape.cp, shape.ep) != (1, 1):
        raise ValueError(f"predicted_flows models DP x TP x PP runs; got cp={shape.cp}, ep={shape.ep}")
    d, t, p, m = shape.dp, shape.tp, shape.pp, microbatches
    if global_batch % (d * m):
        raise ValueError(f"global batch {global_batch} does not split into dp x microbatches = {d} x {m}")
    b = global_batch // (d * m)
    stage_of = {r: shape.coords(r)["pp"] for r in range(shape.world_size)}
    per_stage = {s: _stage_collectives(cfg, b, t, s, p, element_bytes) for s in range(p)}

    def ring(c: PlannedCollective, i: int, n: int) -> int:
        return comm.ring_bytes(c.op, c.tensor_bytes // element_bytes, element_bytes, n, i)[0]

    def tp_sent(r: int, i: int, n: int) -> int:
        micro, sync = per_stage[stage_of[r]]
        return m * sum(ring(c, i, n) for c in micro) + sum(ring(c, i, n) for c in sync)

    def dp_sent(r: int, i: int, n: int) -> int:
        psi = int(sum(params_per_rank(cfg, ParallelLayout(tp=t, pp=p), stage_of[r]).values()))
        return comm.ring_bytes("all_reduce", psi, element_bytes, n, i)[0]

    act = m * b * cfg.seq_len * cfg.d_model * element_bytes
    edges = [pair for g in shape.all_groups("pp") for pair in itertools.pairwise(g)]  # stage i -> stage i+1
    pp_flows = [Flow(src, dst, act, "pp", comm.MEASURED) for lo, hi in edges for src, dst in ((lo, hi), (hi, lo))]
    return ring_flows(shape, ("tp",), tp_sent, comm.MODELLED) + pp_flows + ring_flows(shape, ("dp",), dp_sent, dp_kind)


def cross_node_table(measured: Mapping[str, int], predicted: Mapping[str, int],
                     kinds: Mapping[str, str]) -> list[dict[str, Any]]:
    """One row per group: bytes across nodes from the log, the prediction, their kind, and whether they agree."""
    return [{"group": g, "from the log": measured.get(g, 0), "predicted": predicted.get(g, 0),
             "bytes": kinds.get(g, "-"), "equal": measured.get(g, 0) == predicted.get(g, 0)}
            for g in sorted(set(measured) | set(predicted))]


# ----------------------------------------------------------------------------------------------------------------
# Data parallelism whose bytes are measured


class RingDataParallel(DataParallel):
    """``DataParallel`` whose ``all_reduce`` seam is the course's ring (``collectives.ring_all_reduce``): every
    message is a logged isend/irecv with its peer, so the gradient sync's bytes across nodes are *measured*.
    Blocking (the ring runs when the bucket is launched); use ``mode="bucketed"``."""

    def all_reduce(self, tensor: torch.Tensor, group: comm.Group, async_op: bool) -> None:
        if dist.get_world_size(group) > 1:
            ring_all_reduce(tensor, group=group)


def ring_data_parallel(run: Parallelized) -> None:
    """The composition's data-parallel step with ``RingDataParallel`` (every gradient byte measured):
    ``train_tracked(..., steps=compose.with_step(compose.STEPS, compose.data_parallel, ring_data_parallel))``."""
    run.dp = RingDataParallel(run.module, mesh=run.mesh, mode="bucketed")
