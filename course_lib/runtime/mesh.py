"""One grid of ranks for every parallelism: DP x CP x TP x PP, with EP carved out of the data-parallel ranks.

A training job on ``world = tp * cp * dp * pp`` ranks gives every rank one coordinate per axis. The **order**
says which axis varies fastest as the rank id grows; Megatron-LM's default ``"tp-cp-ep-dp-pp"`` puts tensor
parallelism fastest, so the t ranks of a TP group are consecutive ids and land on one node, where the fast
links are (TP talks twice per layer; PP only at stage edges). With the default order:

    rank = tp_coord + tp * (cp_coord + cp * (dp_coord + dp * pp_coord))

**Expert parallelism** does not multiply the world size. As in Megatron Core and DeepSpeed-MoE, the dense model
is replicated over the dp x cp ranks that share a (tp, pp) coordinate, and the experts re-use those same ranks:
they are split ``ep`` ways (each rank holds n_expert / ep experts) and every expert is replicated
``edp = dp * cp / ep`` times. Reading the dp x cp ranks in order (the earlier axis of the order fastest), a rank's
index i among them gives ``ep_coord = i % ep`` and ``edp_coord = i // ep``. So there are two groups for data
parallelism: the dense parameters' gradients are averaged over ``("dp", "cp")`` (ZeRO shards over it too, like
Megatron's distributed optimizer and torchtitan's ``dp_shard_cp``), the experts' over ``"edp"``; tokens travel
between experts over ``"ep"``.

**Hybrid sharded data parallelism** (HSDP; PyTorch's ``fully_shard`` on a 2-D ``DeviceMesh``
("replicate", "shard"), torchtitan's ``dp_replicate`` x ``dp_shard``) splits the dp axis in two:
``dp = dp_replicate x dp_shard``. FSDP shards over the ``dp_shard`` ranks (those with the same replicate index)
and the shards are replicated over the ``dp_replicate`` ranks (those with the same shard index). As in torchtitan
(mesh dims ``pp, dp_replicate, dp_shard, cp, tp``, slowest first) the shard index is the faster one:

    dp_coord = dp_shard_coord + dp_shard * dp_replicate_coord

so a shard group is dp_shard consecutive dp coordinates (on one node when the dp stride allows) and a replicate
group strides by dp_shard. ``dp_replicate`` = 1 (the default) is plain FSDP: the ``"dp_shard"`` group is the dp
group. The sub-axes are dense axes: ``group_ranks(r, "dp_shard", "cp")`` is torchtitan's ``dp_shard_cp``.

``MeshShape`` is the arithmetic alone (no processes: the estimator, the planner and the figures use it);
``Mesh`` is that shape inside a running job, with one ``torch.distributed`` process group per set of axes,
each named in the comm log by its axes ("tp", "dp+cp"). Groups are plain ``new_group`` groups rather than a
``DeviceMesh`` so the rank arithmetic stays in view; ``Mesh.device_mesh`` builds PyTorch's ``DeviceMesh`` of
the same grid for its native APIs (DTensor, ``fully_shard``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.model_config import GPTConfig

DENSE_AXES = ("tp", "cp", "dp", "pp")
EXPERT_AXES = ("tp", "ep", "edp", "pp")
DP_SUB_AXES = ("dp_replicate", "dp_shard")  # HSDP: dp = dp_replicate x dp_shard, dp_shard the faster
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
_LABEL_ORDER = ("dp", "dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "edp")  # group names in the comm log


class MeshError(ValueError):
    """A mesh that does not fit the world, the model or the batch. ``problems`` lists every violated constraint,
    each with what to change."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("the mesh does not fit:\n" + "\n".join(f"  - {p}" for p in problems))


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (O(sqrt n): vocabularies have 10^5 entries)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass(frozen=True)
class MeshShape:
    """Degrees of each axis and their order; rank <-> coordinates and the groups of every set of axes."""

    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    order: str = DEFAULT_ORDER
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        problems = []
        for name in ("dp", "cp", "tp", "pp", "ep", "dp_replicate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r}: every degree must be an int >= 1")
        names = self.order.split("-")
        if sorted(names) != sorted((*DENSE_AXES, "ep")):
            problems.append(f"order={self.order!r} must name each of tp, cp, ep, dp, pp once, joined by '-' "
                            f"(fastest first, e.g. {DEFAULT_ORDER!r})")
        if problems:
            raise MeshError(problems)
        if self.dp % self.dp_replicate:
            raise MeshError([f"dp_replicate={self.dp_replicate} does not divide dp={self.dp}: HSDP replicates over "
                             f"dp_replicate ranks and shards over dp / dp_replicate (choose dp_replicate in "
                             f"{divisors(self.dp)}, or dp a multiple of {self.dp_replicate})"])
        if (self.dp * self.cp) % self.ep:
            raise MeshError([f"ep={self.ep} must divide dp x cp = {self.dp * self.cp}: experts are spread over the "
                             f"data-parallel ranks (choose ep in {divisors(self.dp * self.cp)})"])

    # ---------------------------------------------------------------------------------------------- arithmetic

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        """How many times each expert is replicated: dp x cp / ep."""
        return self.dp * self.cp // self.ep

    @property
    def dp_shard(self) -> int:
        """The ranks FSDP shards over inside dp (HSDP: dp / dp_replicate; plain FSDP: dp)."""
        return self.dp // self.dp_replicate

    def size(self, *axes: str) -> int:
        """Ranks in one group over ``axes`` (the product of their degrees)."""
        return math.prod(self._degree(a) for a in self._check_axes(axes))

    @cached_property
    def dense_order(self) -> tuple[str, ...]:
        """The four dense axes, fastest first."""
        return tuple(a for a in self.order.split("-") if a != "ep")

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` on every axis, the expert ones (ep, edp) included, and with dp_replicate > 1
        the HSDP sub-axes (dp_replicate, dp_shard)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the mesh of {self.world_size} ranks")
        c, rest = {}, rank
        for axis in self.dense_order:
            rest, c[axis] = divmod(rest, self._degree(axis))
        i = self._data_index(c)
        c["ep"], c["edp"] = i % self.ep, i // self.ep
        if self.dp_replicate > 1:
            c["dp_replicate"], c["dp_shard"] = divmod(c["dp"], self.dp_shard)
        return c

    def rank_of(self, **coords: int) -> int:
        """The rank at the given dense coordinates (missing axes are 0): ``rank_of(tp=1, pp=1)``."""
        unknown = set(coords) - set(DENSE_AXES)
        if unknown:
            raise ValueError(f"rank_of takes dense coordinates {DENSE_AXES}, got {sorted(unknown)}")
        rank, stride = 0, 1
        for axis in self.dense_order:
            value = coords.get(axis, 0)
            if not 0 <= value < self._degree(axis):
                raise ValueError(f"{axis}={value} is outside 0..{self._degree(axis) - 1}")
            rank += value * stride
            stride *= self._degree(axis)
        return rank

    def group_ranks(self, rank: int, *axes: str) -> list[int]:
        """The ranks in ``rank``'s group over ``axes``: those whose other coordinates equal ``rank``'s."""
        axes = self._check_axes(axes)
        subs = [a for a in axes if a in DP_SUB_AXES]
        if subs:  # the dp group's ranks whose other sub-coordinate equals rank's
            fixed = next(iter(set(DP_SUB_AXES) - set(subs)), None)
            same = [r for r in self.group_ranks(rank, "dp", *(a for a in axes if a not in DP_SUB_AXES))
                    if fixed is None or self._sub_coord(r, fixed) == self._sub_coord(rank, fixed)]
            return same
        system, mine = self._system(axes), self.coords(rank)
        varying = [a for a in self._axis_order(system) if a in axes]  # fastest first: ranks come out in order
        ranks = []
        for values in itertools.product(*(range(self._degree(a)) for a in reversed(varying))):
            c = {a: mine[a] for a in system} | dict(zip(reversed(varying), values, strict=True))
            ranks.append(self._rank_in(system, c))
        return sorted(ranks)

    def _axis_order(self, system: tuple[str, ...]) -> list[str]:
        if system == DENSE_AXES:
            return list(self.dense_order)
        return ["tp", "ep", "edp", "pp"]

    def _rank_in(self, system: tuple[str, ...], c: dict[str, int]) -> int:
        """The rank at coordinates ``c`` of the dense or the expert reading of the mesh."""
        if system == EXPERT_AXES:
            first, second = [a for a in self.dense_order if a in ("cp", "dp")]
            i = c["ep"] + self.ep * c["edp"]
            c = {"tp": c["tp"], "pp": c["pp"], first: i % self._degree(first), second: i // self._degree(first)}
        return self.rank_of(**c)

    def all_groups(self, *axes: str) -> list[list[int]]:
        """Every group over ``axes``, a partition of the ranks, ordered by their first rank."""
        seen: set[int] = set()
        groups = []
        for r in range(self.world_size):
            if r not in seen:
                g = self.group_ranks(r, *axes)
                seen.update(g)
                groups.append(g)
        return groups

    def table(self) -> list[dict[str, int]]:
        """One row per rank: its id and its coordinates (for printing and drawing the mesh)."""
        return [{"rank": r, **self.coords(r)} for r in range(self.world_size)]

    # ---------------------------------------------------------------------------------------------- validation

    def validate(self, cfg: GPTConfig | None = None, *, global_batch: int | None = None, micro_batch: int = 1,
                 seq_len: int | None = None, v: int = 1, sp: bool = False, world_size: int | None = None,
                 uneven_layers: bool = False) -> None:
        """Raise ``MeshError`` listing every constraint this mesh breaks for the model, batch and sequence, and
        what to change; return None when it fits.

        * world size = tp x cp x dp x pp;
        * TP splits attention heads, the FFN and the vocabulary (column/row parallel layers, vocab-parallel
          loss): tp divides n_head, d_ff and vocab; K/V heads are split when tp divides n_kv_head and
          replicated when n_kv_head divides tp;
        * PP: pp x v divides n_layer (v model chunks per rank, interleaved schedules); with ``uneven_layers``
          (stages of unequal block counts, ``pp_layers.ends_split``) pp x v <= n_layer is enough;
        * CP: zig-zag load balance cuts the sequence into 2 x cp chunks; SP cuts each rank's tokens by tp;
        * EP: ep divides n_expert, and needs a mixture-of-experts model;
        * DP: the global batch is dp x micro_batch x (micro-batches per step).
        """
        problems = []
        if world_size is not None and world_size != self.world_size:
            problems.append(f"tp x cp x dp x pp = {self.tp} x {self.cp} x {self.dp} x {self.pp} = "
                            f"{self.world_size}, but the job has {world_size} ranks: change a degree so the "
                            f"product is {world_size}")
        if cfg is not None:
            problems += self._model_problems(cfg, v, uneven_layers)
        seq = seq_len if seq_len is not None else (cfg.seq_len if cfg is not None else None)
        if seq is not None:
            if self.cp > 1 and seq % (2 * self.cp):
                problems.append(f"sequence length {seq} is not divisible by 2 x cp = {2 * self.cp} (zig-zag "
                                f"chunks): use a length that is a multiple of {2 * self.cp}, or cp in "
                                f"{[c for c in divisors(seq) if c == 1 or seq % (2 * c) == 0]}")
            if sp and self.tp > 1 and (seq // self.cp) % self.tp:
                problems.append(f"sequence parallelism splits each rank's {seq // self.cp} tokens over tp="
                                f"{self.tp}: use a sequence length divisible by cp x tp = {self.cp * self.tp}")
        if micro_batch < 1:
            problems.append(f"micro_batch={micro_batch} must be >= 1")
        elif global_batch is not None and global_batch % (self.dp * micro_batch):
            fits = [b for b in divisors(global_batch) if global_batch % (self.dp * b) == 0]
            problems.append(f"global batch {global_batch} is not divisible by dp x micro_batch = {self.dp} x "
                            f"{micro_batch}: use a global batch that is a multiple of {self.dp * micro_batch}"
                            + (f", or micro_batch in {fits}" if fits else f" (no micro-batch fits dp={self.dp})"))
        if problems:
            raise MeshError(problems)

    def _model_problems(self, c: GPTConfig, v: int, uneven_layers: bool = False) -> list[str]:
        t, problems = self.tp, []

        def fit(n: int) -> list[int]:
            return divisors(n)[:8]

        if c.n_head % t:
            problems.append(f"tp={t} does not divide n_head={c.n_head}: attention is split by heads "
                            f"(choose tp in {fit(c.n_head)})")
        if c.kv_heads % t and t % c.kv_heads:
            problems.append(f"tp={t} and n_kv_head={c.kv_heads}: K/V heads are split when tp divides them and "
                            f"replicated when they divide tp; neither holds (choose tp in {fit(c.kv_heads)} or a "
                            f"multiple of {c.kv_heads})")
        if c.ffn_dim % t:
            problems.append(f"tp={t} does not divide d_ff={c.ffn_dim}: the MLP's column-parallel layer splits it "
                            f"(choose tp in {fit(c.ffn_dim)})")
        if c.padded_vocab_size % t:
            problems.append(f"tp={t} does not divide vocab_size={c.padded_vocab_size}: the embedding and the loss "
                            f"are vocab-parallel (pad the vocabulary: GPTConfig(make_vocab_size_divisible_by=k*{t}),"
                            f" or choose tp in {fit(c.padded_vocab_size)})")
        if v < 1:
            problems.append(f"v={v} model chunks per rank must be >= 1")
        elif uneven_layers and c.n_layer < self.pp * v:
            problems.append(f"pp x v = {self.pp} x {v} stages need at least one block each, but n_layer={c.n_layer}: "
                            f"use pp x v <= {c.n_layer}")
        elif not uneven_layers and c.n_layer % (self.pp * v):
            problems.append(f"pp x v = {self.pp} x {v} does not divide n_layer={c.n_layer}: every (virtual) "
                            f"stage needs the same number of blocks (choose pp x v in {fit(c.n_layer)})")
        if self.ep > 1 and not c.n_expert:
            problems.append(f"ep={self.ep} needs a mixture-of-experts model (n_expert > 0): expert parallelism "
                            f"is part of an MoE architecture, not a knob for dense models; use ep=1")
        elif c.n_expert and c.n_expert % self.ep:
            problems.append(f"ep={self.ep} does not divide n_expert={c.n_expert} (choose ep in "
                            f"{[e for e in divisors(c.n_expert) if (self.dp * self.cp) % e == 0]})")
        return problems

    # ---------------------------------------------------------------------------------------------- helpers

    def _degree(self, axis: str) -> int:
        return self.edp if axis == "edp" else getattr(self, axis)

    def _sub_coord(self, rank: int, axis: str) -> int:
        """``rank``'s coordinate on an HSDP sub-axis (defined for dp_replicate = 1 too: the shard index is dp's)."""
        replicate, shard = divmod(self.coords(rank)["dp"], self.dp_shard)
        return replicate if axis == "dp_replicate" else shard

    def _check_axes(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        if not axes:
            raise ValueError("name at least one axis")
        unknown = [a for a in axes if a not in (*DENSE_AXES, "ep", "edp", *DP_SUB_AXES)]
        if unknown:
            raise ValueError(f"unknown axes {unknown}: the mesh has {(*DENSE_AXES, 'ep', 'edp', *DP_SUB_AXES)}")
        if "dp" in axes and set(axes) & set(DP_SUB_AXES):
            raise ValueError(f"axes {list(axes)}: dp already holds dp_replicate x dp_shard; name dp or its "
                             f"sub-axes, not both")
        self._system(axes)
        return tuple(dict.fromkeys(axes))

    @staticmethod
    def _system(axes: tuple[str, ...]) -> tuple[str, ...]:
        """Dense axes (tp, cp, dp, pp) and expert axes (tp, ep, edp, pp) are two readings of the same ranks;
        a group is taken in one of them."""
        if set(axes) <= {*DENSE_AXES, *DP_SUB_AXES}:
            return DENSE_AXES
        if set(axes) <= set(EXPERT_AXES):
            return EXPERT_AXES
        raise ValueError(f"axes {list(axes)} mix cp/dp with ep/edp: the experts re-split the dp x cp ranks into "
                         f"ep x edp, so a group is over dense axes or over expert axes")

    def _data_index(self, c: dict[str, int]) -> int:
        """Index of a rank among the dp x cp ranks of its (tp, pp) coordinate, the earlier axis fastest."""
        first, second = [a for a in self.dense_order if a in ("cp", "dp")]
        return c[first] + self._degree(first) * c[second]


class Mesh:
    """A ``MeshShape`` inside a running job: this rank's coordinates and one process group per set of axes.

    Build it on every rank after ``init_process_group`` (``launch`` does that), with the same arguments:
    ``mesh = Mesh(dp=2, tp=2)``; HSDP: ``Mesh(dp=4, dp_replicate=2)``, then ``mesh.group("dp_shard")`` (FSDP's)
    and ``mesh.group("dp_replicate")`` (the replicas'). Groups are created here, on every rank in the same order
    (``new_group`` is collective over the world); sets of axes that split the ranks the same way share one group.
    """

    def __init__(self, dp: int = 1, cp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1,
                 order: str = DEFAULT_ORDER, dp_replicate: int = 1) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs torch.distributed: build it inside a launched rank "
                               "(course_lib.runtime.launch or torchrun); "
                               "MeshShape does the arithmetic without processes")
        self.shape = MeshShape(dp=dp, cp=cp, tp=tp, pp=pp, ep=ep, order=order, dp_replicate=dp_replicate)
        self.shape.validate(world_size=dist.get_world_size())
        self.rank = dist.get_rank()
        self._groups: dict[tuple[str, ...], dist.ProcessGroup] = {}
        by_label: dict[str, dist.ProcessGroup] = {}
        for axes in self._axis_sets():
            label = self.label(*axes)
            if label not in by_label:  # axes of degree 1 add nothing: ("dp", "cp") with cp=1 is the dp group
                mine = None
                for ranks in self.shape.all_groups(*axes):  # every rank creates every group, in the same order
                    g = dist.new_group(ranks)
                    if self.rank in ranks:
                        mine = g
                by_label[label] = comm.name_group(mine, label)
            self._groups[axes] = by_label[label]

    def label(self, *axes: str) -> str:
        """The name of the group over ``axes`` in the comm log: its axes of degree > 1 ("dp+cp"), or "self".
        An HSDP sub-axis that is all of dp (the other of degree 1) is named "dp": the same group."""
        s = self.shape
        axes = tuple("dp" if a in DP_SUB_AXES and s.size(a) == s.dp else a for a in s._check_axes(axes))
        return "+".join(a for a in _LABEL_ORDER if a in axes and s.size(a) > 1) or "self"

    def _axis_sets(self) -> list[tuple[str, ...]]:
        sets = [s for n in range(1, 5) for s in itertools.combinations(DENSE_AXES, n)]
        sets += [("ep",), ("edp",), ("tp", "ep"), ("ep", "edp")]
        sets += [("dp_replicate",), ("dp_shard",), ("dp_shard", "cp")]  # HSDP (the dp group when dp_replicate=1)
        return sets

    def group(self, *axes: str) -> dist.ProcessGroup:
        """This rank's process group over ``axes``: ``mesh.group("tp")``, ``mesh.group("dp", "cp")``."""
        key = self.shape._check_axes(axes)
        canonical = next((s for s in self._axis_sets() if set(s) == set(key)), None)
        if canonical is None:
            raise ValueError(f"no group over {list(axes)}; groups exist for {['+'.join(s) for s in self._axis_sets()]}")
        return self._groups[canonical]

    def ranks(self, *axes: str) -> list[int]:
        """Global ranks of this rank's group over ``axes``, in group-rank order."""
        return self.shape.group_ranks(self.rank, *axes)

    def coord(self, axis: str) -> int:
        """This rank's coordinate on ``axis`` (its rank inside that axis's group)."""
        return self.shape.coords(self.rank)[axis]

    def size(self, *axes: str) -> int:
        return self.shape.size(*axes)

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    def device_mesh(self, *axes: str, device_type: str | None = None):
        """PyTorch's ``DeviceMesh`` of the same grid (dense axes, slowest first as DeviceMesh wants), or its
        sub-mesh over ``axes``, for the native references (DTensor ``parallelize_module``, ``fully_shard``).
        With dp_replicate > 1 its dp dimension is two, ``("dp_replicate", "dp_shard")``: ``fully_shard`` on
        ``device_mesh("dp_replicate", "dp_shard")`` is PyTorch's HSDP. Collective: every rank calls it with the
        same arguments."""
        from torch.distributed.device_mesh import DeviceMesh

        from course_lib.runtime.launch import device

        hsdp = self.shape.dp_replicate > 1
        known = (*DENSE_AXES, *DP_SUB_AXES) if hsdp else DENSE_AXES
        if not set(axes) <= set(known) or (hsdp and "dp" in axes):
            raise ValueError(f"device_mesh takes dense axes {tuple(a for a in known if not hsdp or a != 'dp')}, got "
                             f"{list(axes)}" + (" (with dp_replicate > 1 dp is dp_replicate x dp_shard)" if hsdp
                                                else ""))
        names = tuple(x for a in reversed(self.shape.dense_order) for x in (DP_SUB_AXES if hsdp and a == "dp"
                                                                             else (a,)))
        grid = torch.empty([self.shape.size(a) for a in names], dtype=torch.int64)
        for r in range(self.world_size):
            c = self.shape.coords(r)
            grid[tuple(c[a] for a in names)] = r
        full = DeviceMesh(device_type or device().type, grid, mesh_dim_names=names)
        return full[axes] if axes else full

    def __repr__(self) -> str:
        s = self.shape
        hsdp = f", dp_replicate={s.dp_replicate}" if s.dp_replicate > 1 else ""
        return (f"Mesh(rank={self.rank}, dp={s.dp}, cp={s.cp}, tp={s.tp}, pp={s.pp}, ep={s.ep}, "
                f"order={s.order!r}{hsdp}, coords={s.coords(self.rank)})")
