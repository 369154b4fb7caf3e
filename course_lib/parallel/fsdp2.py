"""FSDP2-style per-parameter sharding: the module's parameters *are* their dim-0 shards, as ``fully_shard`` has it.

The flat-parameter form (``zero``; FSDP1, DeepSpeed) concatenates a unit's parameters into one buffer and gives
rank r a contiguous slice of it: a slice that may start in the middle of one weight and end in the middle of
another, so the optimizer sees one flat vector per unit and no parameter keeps its shape. PyTorch's FSDP2
(``fully_shard``; its design is in PyTorch issue #114299, "Per-Parameter-Sharding FSDP") shards *each parameter*
on dim 0 instead and **replaces the module's parameter by its shard** (a ``DTensor`` with ``Shard(0)``). A
[d0, ...] weight is cut into chunks of c = ceil(d0 / N) rows (``torch.chunk``'s rule): rank r holds rows
[r c, min((r+1) c, d0)) -- the last ranks fewer, possibly none -- stored in a buffer padded to c rows so that
every rank's chunk has the same size for the collectives. This module does the same with plain tensors (and
``tests/test_zero_fsdp2.py`` finds its parameters and gradient shards bit for bit equal to ``fully_shard``'s):

* after wrapping, ``model.named_parameters()`` are the shards: ``nn.Parameter`` s of the chunk's shape (a view
  of the padded buffer), fp32, registered under the model's own names, each recorded ``Shard(0)`` on ``"dp"``
  (``course_lib.parallel.placement``). The optimizer is built on ``model.parameters()`` (or the wrapper's
  ``parameters()``: the same tensors);
* before a unit's forward its shards are all-gathered into full ``nn.Parameter`` s of the compute dtype, which
  are put *in place of* the shards in the module (``module._parameters[name]``, what FSDP2's
  ``FSDPParam.to_unsharded`` does) so that the model code runs unchanged; after the forward the full weights'
  storage is freed and the shards are put back (``reshard_after_forward=True``), or both stay until the unit's
  backward is done (``False``; ``None``, FSDP2's default, keeps only the root's, which backward needs first);
* after backward every shard has a ``.grad`` of its own shape in the master dtype (fp32): the reduce-scatter of
  the full gradients, averaged over the group. The full weights have ``.grad`` None again;
* ``full_state_dict()`` all-gathers the whole fp32 tensors, by the model's names.

What that buys: the optimizer, gradient clipping and the checkpoints see ordinary named parameters of their own
(shard) shape -- no flat-to-parameter bookkeeping; it composes with tensor parallelism (a TP-sharded weight is
sharded again on dim 0, each parameter on its own, where a flat buffer mixes weights TP split differently); per
parameter dtypes and ``requires_grad`` are no problem.

What it costs: the collectives still work on one buffer per unit (one all-gather, one reduce-scatter, as in
the flat form), laid out rank-major -- for each rank r the r-th chunk of every parameter, back to back -- so rank
r sends its chunks without a copy, but the gathered buffer must be *copied out* into each full parameter (its
rows are spread over N segments) and the gradients *copied in* before the reduce-scatter: two copies of the
unit per step that the flat form avoids (FSDP2's "all-gather copy-out" and "reduce-scatter copy-in"), plus up
to N - 1 padding rows per parameter instead of N - 1 elements per unit.

Mixed precision (FSDP2's ``MixedPrecisionPolicy``): ``param_dtype`` (bf16 or fp16) is the compute dtype -- the
shards are cast before the all-gather, so the gathered weights and their gradients are 16-bit -- while the
shards stay fp32 (the master weights the optimizer updates). ``reduce_dtype`` is the dtype of the gradient
reduce-scatter: ``None`` (the policy's default) reduces in ``param_dtype``, ``torch.float32`` casts the 16-bit
gradients up first; either way the reduced shard is cast to fp32 for the optimizer. The mean over N is a
division by N after the sum in fp32 and bf16 (whose range holds the sum); in fp16 it is split into a division
before and one after the sum (``divide_factors``), as FSDP2 does against fp16's overflow.

**HSDP** (hybrid sharding; PyTorch's ``fully_shard`` on a 2-D mesh, placements ``(Replicate(), Shard(0))``):
on a mesh with ``dp_replicate`` = R > 1 the shards live on the ``dp_shard`` group (S = dp / R ranks; with
``cp`` too, "dp_shard+cp") and are replicated over the ``dp_replicate`` group. The gradient of a unit is
reduce-scattered over the shard group, then its shard all-reduced over the replicate group, and divided by
S x R: the mean over all dp x cp ranks, on 1/S of the bytes for the cross-replica (often cross-node) step
(FSDP2's ``foreach_reduce``: pre-divide, reduce-scatter, all-reduce, post-divide). Recorded placements:
``{"dp_replicate": Replicate(), "dp_shard": Shard(0)}``, DTensor's order.

``PerParameterUnit`` is a ``zero`` unit of this kind (stage 3), run by the same hook engine:
``FSDP2DataParallel`` is ``ZeroDataParallel`` with these units.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.parallel.contract import ParallelWrapper
from course_lib.parallel.placement import (
    Partial,
    Replicate,
    Shard,
    clear_placement,
    copy_placements,
    placements_of,
    set_placement,
)
from course_lib.parallel.zero import ZeroDataParallel
from course_lib.parallel.zero_unit import FlatLayout, FlatParamUnit, UnitState

MIXED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dim0_chunk(size: int, world_size: int, index: int) -> tuple[int, int]:
    """Rows [lo, hi) of chunk ``index`` when ``size`` rows are cut into ``world_size`` chunks of
    c = ceil(size / N) rows: the last chunks shorter or empty (``torch.chunk``'s rule, which ``fully_shard``
    follows)."""
    c = -(-size // world_size)
    lo = min(index * c, size)
    return lo, min(lo + c, size)


class PerParameterUnit(FlatParamUnit):
    """One unit whose parameters are sharded one by one on dim 0 (see the module docstring).

    Per parameter i (shape [d0, *rest], c_i = ceil(d0 / N) rows, k_i = c_i x prod(rest) elements):

    * ``padded[i]``: fp32 [c_i, *rest], this rank's chunk padded with zero rows;
    * ``shards[i]``: the ``nn.Parameter`` the module and the optimizer see, ``padded[i]``'s first rows (a view:
      the optimizer updates the padded buffer in place, and the all-gather reads from it);
    * ``params[i]``: the full ``nn.Parameter`` in ``param_dtype`` the forward computes with (its storage has 0
      bytes while the unit is sharded); autograd accumulates the full gradient on it;
    * ``offsets[i]``: where its k_i elements start in a rank's S-element segment of the rank-major buffer.

    Seams: ``chunk_rows`` (which rows this rank keeps) and ``divide_factors`` (how the sum becomes a mean)."""

    flat = False

    def __init__(self, name: str, module: nn.Module, named_params: Sequence[tuple[str, nn.Parameter]], stage: int,
                 group: comm.Group = None, param_dtype: torch.dtype = torch.float32,
                 events: list[tuple[str, str]] | None = None) -> None:
        if stage != 3:
            raise ValueError(f"per-parameter sharding is ZeRO stage 3 (FSDP); got stage={stage}")
        if param_dtype not in MIXED_DTYPES:
            raise ValueError(f"param_dtype must be one of {MIXED_DTYPES}, got {param_dtype}")
        if not named_params:
            raise ValueError(f"unit {name!r} has no parameters of its own (all belong to units below it)")
        scalars = [n for n, p in named_params if p.dim() == 0]
        if scalars:
            raise ValueError(f"unit {name!r}: {scalars} are 0-d; dim-0 sharding needs at least one dimension "
                             "(make them shape [1], as fully_shard also requires)")
        self.name, self.module, self.stage, self.group = name, module, stage, group
        self.param_dtype = param_dtype
        self.reduce_dtype: torch.dtype | None = None  # None: reduce in param_dtype (MixedPrecisionPolicy's default)
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.shard_rank = self.rank
        self.replicate_group: comm.Group = None  # HSDP: the replicas of this rank's shards (set_replicate)
        self.replicas = 1
        self._placed: tuple[str, ...] = ()  # the axes record_placements wrote
        self.events = events if events is not None else []
        self.device = named_params[0][1].device
        originals = [p for _, p in named_params]
        self.shapes = [tuple(p.shape) for p in originals]
        self.rows = [math.ceil(s[0] / self.world_size) for s in self.shapes]
        self.chunks = [c * math.prod(s[1:]) for c, s in zip(self.rows, self.shapes, strict=True)]
        self.offsets = [sum(self.chunks[:i]) for i in range(len(self.chunks))]
        self.segment = sum(self.chunks)  # S: elements each rank holds of this unit
        self.slots = [self._slots(p) for p in originals]
        self.padded: list[torch.Tensor] = []
        self.shards: list[nn.Parameter] = []
        self.params: list[nn.Parameter] = []
        with torch.no_grad():
            for i, p in enumerate(originals):
                lo, hi = self.chunk_rows(i)
                pad = torch.zeros(self.rows[i], *self.shapes[i][1:], dtype=torch.float32, device=self.device)
                pad[:hi - lo] = p.detach()[lo:hi]
                shard = nn.Parameter(pad[:hi - lo])
                full = nn.Parameter(torch.empty(self.shapes[i], dtype=param_dtype, device=self.device))
                for t in (shard, full):
                    copy_placements(p, t)
                self.padded.append(pad)
                self.shards.append(shard)
                self.params.append(full)
        self.layout = FlatLayout(tuple(n for n, _ in named_params), tuple(self.shapes), tuple(self.offsets),
                                 sum(math.prod(s) for s in self.shapes), self.world_size * self.segment,
                                 self.world_size)
        self.reshard_after_forward = True
        self.grads_ready, self.backward_started, self.reduced = 0, False, False
        self._pending: tuple[Any, torch.Tensor, torch.Tensor] | None = None
        self.state = UnitState.UNSHARDED
        self.reshard()  # frees the full weights and registers the shards in the module

    def record_placements(self, axis: str, replicate_axis: str | None = None) -> None:
        """Record every shard ``Shard(0, size=d0)`` on ``axis`` (the key of the group it is sharded over: "dp",
        or "dp+cp" when context-parallel ranks shard with it), on top of what other axes recorded: a TP shard
        [d0/t, ...] is cut again on its dim 0 (``placement``: the records nest in order). HSDP:
        ``Replicate()`` on ``replicate_axis`` first, as DTensor's ``(Replicate(), Shard(0))``. Called again, it
        replaces its own earlier records."""
        for shard, shape in zip(self.shards, self.shapes, strict=True):
            for old in self._placed:
                clear_placement(shard, old)
            if replicate_axis is not None:
                set_placement(shard, replicate_axis, Replicate())
            set_placement(shard, axis, Shard(0, shape[0]))
        self.axis, self._placed = axis, (axis,) if replicate_axis is None else (replicate_axis, axis)

    def set_replicate(self, group: comm.Group) -> None:
        """HSDP: the shards are replicated over ``group``; the reduced gradient shard is all-reduced over it."""
        self.replicate_group, self.replicas = group, dist.get_world_size(group)

    def _slots(self, p: nn.Parameter) -> list[tuple[nn.Module, str]]:
        """Every (submodule, attribute) of the unit's module that registers ``p`` (a tied weight has several)."""
        return [(m, k) for m in self.module.modules() for k, q in m._parameters.items() if q is p]

    def _install(self, tensors: Sequence[nn.Parameter]) -> None:
        """Register ``tensors[i]`` in the module in place of parameter i (no hooks, no copy)."""
        for slots, t in zip(self.slots, tensors, strict=True):
            for m, k in slots:
                m._parameters[k] = t

    # ---- the seams

    def chunk_rows(self, i: int) -> tuple[int, int]:
        """The rows [lo, hi) of parameter i this rank keeps: chunk r of ``dim0_chunk``."""
        return dim0_chunk(self.shapes[i][0], self.world_size, self.shard_rank)

    def divide_factors(self, dtype: torch.dtype) -> tuple[int, int]:
        """(pre, post): the summed gradient is divided by ``pre`` before the reduce-scatter and by ``post`` after,
        pre x post = N (the mean over the ranks: each rank's loss is the mean over its B/N rows; HSDP: N = S x R,
        every data-parallel rank, FSDP2's ``data_parallel_size``). fp32 and bf16:
        (1, N); fp16: pre the power of two nearest sqrt(N) from below, so that neither the sum overflows nor
        the pre-divided gradients underflow (FSDP2's ``_get_gradient_divide_factors``)."""
        n = self.world_size * self.replicas
        if dtype != torch.float16:
            return 1, n
        pre = 1
        while n % pre == 0 and n / pre > pre:
            pre *= 2
        return pre, n // pre

    # ---- what the engine and the memory accounting see

    def optimizer_params(self) -> list[nn.Parameter]:
        """The shards: the module's own parameters while the unit is sharded."""
        return list(self.shards)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The full compute-dtype weights (0 bytes of storage while sharded)."""
        return list(self.params)

    def _all_gather(self, sources: Sequence[torch.Tensor], dtype: torch.dtype,
                    async_op: bool = False) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Send this rank's padded chunks back to back (cast to ``dtype``), receive every rank's: [N x S]."""
        send = torch.cat([s.reshape(-1) for s in sources]).to(dtype)
        recv = torch.empty(self.world_size * self.segment, dtype=dtype, device=self.device)
        work = comm.all_gather(recv, send, group=self.group, async_op=async_op)
        self.events.append(("all_gather", self.name))
        return work, recv, send

    def _full(self, gathered: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i, read out of the rank-major buffer (segment r holds its chunk r; padding rows dropped)."""
        o, k = self.offsets[i], self.chunks[i]
        rows = gathered.view(self.world_size, self.segment)[:, o:o + k].reshape(-1, *self.shapes[i][1:])
        return rows[:self.shapes[i][0]]

    def gather_full(self) -> dict[str, torch.Tensor]:
        """Every parameter of the unit, full, fp32 (the master shards), on the CPU, by name (a collective)."""
        _, gathered, _ = self._all_gather(self.padded, torch.float32)
        return {name: self._full(gathered, i).cpu().clone() for i, name in enumerate(self.layout.names)}

    # ---- parameters

    def unshard(self, async_op: bool = False) -> None:
        """All-gather the shards (cast to ``param_dtype``) and put the full weights in the module.
        ``async_op``: start the all-gather only (a prefetch); ``wait`` finishes it."""
        if self.state is UnitState.UNSHARDED:
            return
        if self.state is UnitState.GATHERING:
            if not async_op:
                self.wait()
            return
        work, gathered, send = self._all_gather(self.padded, self.param_dtype, async_op)
        self._pending = (work, gathered, send)  # keep the input alive until the collective has read it
        self.state = UnitState.GATHERING
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Finish a pending all-gather: copy out into each full parameter's storage (given back its bytes
        first; ``.data``, so autograd's saved references to the weight stay valid), register the full weights."""
        if self.state is not UnitState.GATHERING:
            return
        assert self._pending is not None
        work, gathered, _ = self._pending
        if work is not None:
            work.wait()
        self._pending = None
        with torch.no_grad():
            for i, p in enumerate(self.params):
                p.data.untyped_storage().resize_(p.numel() * p.element_size())
                p.data.copy_(self._full(gathered, i))
        self._install(self.params)
        self.state = UnitState.UNSHARDED

    def reshard(self) -> None:
        """Free every full weight (storage resized to 0 bytes) and register the shards in the module again."""
        if self.state is UnitState.SHARDED:
            return
        self.wait()
        for p in self.params:
            p.data.untyped_storage().resize_(0)
        self._install(self.shards)
        self.state = UnitState.SHARDED

    def refresh_full(self) -> None:
        pass  # stage 3: the next forward gathers the updated shards

    def restore_full(self) -> None:
        """Put full fp32 ``nn.Parameter`` s (the gathered master weights) back in the module for good, the
        unit's own tensors freed: the module runs on its own afterwards (``FSDP2DataParallel.remove_hooks``)."""
        full = self.gather_full()
        self.reshard()
        self._install([nn.Parameter(full[n].to(self.device)) for n in self.layout.names])

    # ---- gradients

    def install_grad_views(self) -> None:
        pass  # autograd writes each full parameter's .grad; reduce_gradients copies it in

    def reduce_gradients(self) -> torch.Tensor:
        """Copy-in: chunk r of every full gradient into rank r's segment of an [N, S] buffer in the reduce dtype
        (zero padding rows; zeros for a parameter without a gradient); reduce-scatter (sum) over the shard
        group; HSDP: all-reduce (sum) of the shard over the replicate group; divide by N (``divide_factors``).
        Returns this rank's S reduced elements in fp32, chunk i for shard i."""
        n, dtype = self.world_size, self.reduce_dtype or self.param_dtype
        buf = torch.zeros(n, self.segment, dtype=dtype, device=self.device)
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            segments = buf[:, self.offsets[i]:self.offsets[i] + self.chunks[i]].view(n, self.rows[i], -1)
            g = p.grad.reshape(self.shapes[i][0], -1)
            for r in range(n):
                lo, hi = dim0_chunk(self.shapes[i][0], n, r)
                segments[r, :hi - lo] = g[lo:hi]
        pre, post = self.divide_factors(dtype)
        if pre != 1:
            buf.div_(pre)
        out = torch.empty(self.segment, dtype=dtype, device=self.device)
        comm.reduce_scatter(out, buf.view(-1), group=self.group)
        self.events.append(("reduce_scatter", self.name))
        if self.replicas > 1:
            self.all_reduce_replicas(out)
        if post != 1:
            out.div_(post)
        self.reduced = True
        return out.float()  # the master dtype (no copy in fp32)

    def all_reduce_replicas(self, out: torch.Tensor) -> None:
        """HSDP's second step (a seam): sum the reduce-scattered shard over the replicas of this rank's shard."""
        comm.all_reduce(out, group=self.replicate_group)
        self.events.append(("all_reduce", self.name))

    def accept_shard_grad(self, g: torch.Tensor) -> None:
        """Give shard i its gradient: chunk i of ``g``, viewed in the shard's shape (added under accumulation)."""
        for i, s in enumerate(self.shards):
            o, k = self.offsets[i], self.chunks[i]
            piece = g[o:o + k].view(self.rows[i], *self.shapes[i][1:])[:s.shape[0]]
            if s.grad is None:
                s.grad = piece
            else:  # gradient accumulation over several backward passes
                s.grad += piece

    def free_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def zero_flat_grad(self) -> None:
        pass


def partial_shards(units: Sequence[PerParameterUnit], has_mesh: bool, owner: str) -> dict[str, list[nn.Parameter]]:
    """Axis -> the shards whose gradient is partial over it (recorded ``Partial()`` there: GQA's replicated K/V,
    a norm under sequence parallelism). Without a mesh there is no group to sum them over: a ``ValueError``."""
    partial: dict[str, list[nn.Parameter]] = {}
    for unit in units:
        for name, s in zip(unit.layout.names, unit.shards, strict=True):
            for axis in (a for a, where in placements_of(s).items() if isinstance(where, Partial)):
                if not has_mesh:
                    raise ValueError(f"rank {dist.get_rank()}: {name!r} has a partial gradient over axis {axis!r}; "
                                     f"pass mesh= so that {owner} can sum it over that axis's group")
                partial.setdefault(axis, []).append(s)
    return partial


def sum_partial_shards(partial: dict[str, list[nn.Parameter]], mesh: Any) -> None:
    """Sum the partial gradient shards over their axis's group (``mesh.group(axis)``): one all-reduce per axis,
    in one flat buffer; a shard without a gradient counts as zeros, so that every rank sends the same bytes."""
    for axis, shards in partial.items():
        grads = [s.grad if s.grad is not None else torch.zeros_like(s) for s in shards]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group=mesh.group(axis))
        for s, g in zip(shards, flat.split([g.numel() for g in grads]), strict=True):
            s.grad = g.view_as(s)


class FSDP2DataParallel(ZeroDataParallel):
    """ZeRO-3 / FSDP with per-parameter dim-0 shards (``PerParameterUnit``), FSDP2's contract: the module's
    parameters are the shards, the optimizer is built on ``model.parameters()``. ``param_dtype`` /
    ``reduce_dtype``: the mixed-precision policy (module docstring). Everything else is ``ZeroDataParallel``'s
    (hooks, prefetch order, ``reshard_after_forward``, ``no_sync``, ``full_state_dict``).

    On a model another axis has already transformed (FSDP + TP, "2D": ``TensorParallel`` first, then this over
    ``mesh``'s dp group) every local tensor is sharded again on dim 0, and a parameter recorded ``Partial()`` on
    an axis (a replicated weight whose gradient is each TP rank's share: GQA's K/V, a norm under sequence
    parallelism) has its gradient shard summed over that axis's group in ``finish_gradient_sync`` -- after the
    dp reduce-scatter, on 1/N of the bytes (both are sums, so the order does not matter).

    HSDP (module docstring): on a ``mesh`` with ``dp_replicate`` > 1 the wrapper's ``group`` is the shard group
    (``mesh.group("dp_shard", "cp")``, torchtitan's ``dp_shard_cp``) and ``replicate_group`` the replicas'
    (``mesh.group("dp_replicate")``); ``broadcast`` then also copies the first replica's shards to the others,
    and ``reduce_losses`` averages over both groups."""

    unit_class = PerParameterUnit

    def __init__(self, module: nn.Module, stage: int = 3, *, reduce_dtype: torch.dtype | None = None,
                 **kwargs: Any) -> None:
        if stage != 3:
            raise ValueError(f"per-parameter sharding is ZeRO stage 3 (FSDP); got stage={stage}")
        if reduce_dtype not in (None, *MIXED_DTYPES):
            raise ValueError(f"reduce_dtype must be None or one of {MIXED_DTYPES}, got {reduce_dtype}")
        mesh = kwargs.get("mesh")
        hybrid = mesh is not None and hasattr(mesh, "size") and mesh.size("dp_replicate") > 1
        if hybrid:
            self.axes = ("dp_shard", "cp")  # the group the shards live on (ParallelWrapper resolves it)
        super().__init__(module, 3, **kwargs)
        self.reduce_dtype = reduce_dtype
        for unit in self.units:
            unit.reduce_dtype = reduce_dtype
        self.replicate_group: comm.Group = None
        if hybrid:
            self._hybrid(mesh, kwargs.get("broadcast", True))
        self.partial = partial_shards(self.units, mesh is not None, type(self).__name__)
        self._mesh = mesh

    def _hybrid(self, mesh: Any, broadcast: bool) -> None:
        """HSDP: every unit's shards replicated over ``mesh.group("dp_replicate")``, recorded so."""
        self.replicate_group = mesh.group("dp_replicate")
        self.axis = "dp_shard+cp" if mesh.size("cp") > 1 else "dp_shard"
        for unit in self.units:
            unit.set_replicate(self.replicate_group)
            unit.record_placements(self.axis, "dp_replicate")
            if broadcast:  # the shard groups agree with their first rank; now the replicas with the first's
                for pad in unit.padded:
                    comm.broadcast(pad, comm.global_rank(self.replicate_group, 0), group=self.replicate_group)

    def reduce_losses(self, local: torch.Tensor) -> torch.Tensor:
        """The mean over the shard group, then (HSDP) over the replicas: every data-parallel rank's."""
        losses = super().reduce_losses(local)
        if self.replicate_group is None:
            return losses
        comm.all_reduce(losses, group=self.replicate_group)
        return losses / dist.get_world_size(self.replicate_group)

    def finish_gradient_sync(self) -> None:
        """Sum the partial gradient shards over their axis (``sum_partial_shards``)."""
        sum_partial_shards(self.partial, self._mesh)

    def remove_hooks(self) -> None:
        """Remove every hook and give the module full fp32 parameters again (a collective: the master shards
        are all-gathered), so that it runs on its own with the current weights; the wrapper is spent."""
        for unit in self.units:
            unit.restore_full()
        ParallelWrapper.remove_hooks(self)
