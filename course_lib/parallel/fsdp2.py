"""FSDP2's per-parameter sharding, from scratch: the module's parameters *are* their dim-0 shards.

The flat form (``zero``) gives rank r a contiguous slice of a unit's concatenated parameters, which
may start inside one weight and end inside another. PyTorch's FSDP2 (``fully_shard``, PyTorch issue
#114299) shards *each parameter* on dim 0 and replaces it by its shard: a [d0, ...] weight is cut
into chunks of c = ceil(d0 / N) rows (``torch.chunk``'s rule), kept padded to c rows. Before a
unit's forward the shards are all-gathered into full weights put in their place; after it those are
freed and the shards put back; after backward each shard gets a gradient of its own shape, the
reduce-scatter of the full gradients averaged over the group. The optimizer, clipping and
checkpoints see ordinary named parameters, and a TP shard is simply sharded again (FSDP + TP, "2D").
Mixed precision (``MixedPrecisionPolicy``): ``param_dtype`` for the gathered weights,
``reduce_dtype`` for the reduce-scatter, fp32 master shards.

Parameters in no unit (default: every block, then the root) stay whole, their gradients all-reduced
(``fully_shard`` on sub-modules, ``replicate`` on the root). **HSDP** (``dp_replicate`` > 1): shards
over ``dp_shard`` (x cp), replicated over ``dp_replicate``: reduce-scatter, then all-reduce of the
shard, divided by every data rank (FSDP2's ``foreach_reduce``). Chapter 03 derives it;
``tests/test_zero_fsdp2.py`` matches ``fully_shard`` bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.parallel import dp_reduce as R
from course_lib.parallel import placement as P
from course_lib.parallel.contract import HasGroups, ParallelWrapper, broadcast_from_first
from course_lib.parallel.sharding import UnitSchedule, UnitState, model_state_bytes

MIXED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dim0_chunk(size: int, world_size: int, index: int) -> tuple[int, int]:
    """Rows [lo, hi) of chunk ``index`` of ``size`` rows cut in ``world_size`` chunks of ceil(size /
    N): the last shorter or empty (``torch.chunk``'s rule, as ``fully_shard``)."""
    c = -(-size // world_size)
    lo = min(index * c, size)
    return lo, min(lo + c, size)


class PerParameterUnit:
    """One unit whose parameters are sharded one by one on dim 0 (see the module docstring). Per
    parameter i (shape [d0, *rest], c_i = ceil(d0 / N) rows, k_i = c_i x prod(rest) elements):

    * ``padded[i]``: fp32 [c_i, *rest], this rank's chunk padded with zero rows;
    * ``shards[i]``: the ``nn.Parameter`` the module and the optimizer see, ``padded[i]``'s first
      rows (a view: the optimizer updates the padded buffer in place, the all-gather reads it);
    * ``params[i]``: the full ``nn.Parameter`` in ``param_dtype`` the forward computes with (0 bytes
      of storage while sharded); autograd accumulates the full gradient on it;
    * ``offsets[i]``: its k_i elements' start in a rank's S elements of the rank-major buffer.

    Seams: ``chunk_rows`` (the rows this rank keeps), ``divide_factors`` (sum -> mean)."""

    flat = False
    """Not one flat buffer: each parameter is its own dim-0 shard (what checkpoints read)."""

    def __init__(self, name: str, module: nn.Module,
                 named_params: Sequence[tuple[str, nn.Parameter]], stage: int,
                 group: comm.Group = None, param_dtype: torch.dtype = torch.float32,
                 events: list[tuple[str, str]] | None = None) -> None:
        if stage != 3:
            raise ValueError(f"per-parameter sharding is ZeRO stage 3 (FSDP); got stage={stage}")
        if param_dtype not in MIXED_DTYPES:
            raise ValueError(f"param_dtype must be one of {MIXED_DTYPES}, got {param_dtype}")
        if not named_params:
            raise ValueError(f"unit {name!r} has no parameters of its own (all belong to units "
                             "below it)")
        scalars = [n for n, p in named_params if p.dim() == 0]
        if scalars:
            raise ValueError(f"unit {name!r}: {scalars} are 0-d; dim-0 sharding needs at least one "
                             "dimension (make them shape [1], as fully_shard also requires)")
        self.name, self.module, self.stage, self.group = name, module, stage, group
        self.param_dtype = param_dtype
        self.reduce_dtype: torch.dtype | None = None  # None: param_dtype (the policy's default)
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.shard_rank = self.rank
        self.replicate_group: comm.Group = None  # HSDP: this rank's shards' replicas
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
                pad = torch.zeros(self.rows[i], *self.shapes[i][1:], dtype=torch.float32,
                                  device=self.device)
                pad[:hi - lo] = p.detach()[lo:hi]
                shard = nn.Parameter(pad[:hi - lo])
                full = nn.Parameter(torch.empty(self.shapes[i], dtype=param_dtype,
                                                device=self.device))
                for t in (shard, full):
                    P.copy_placements(p, t)
                self.padded.append(pad)
                self.shards.append(shard)
                self.params.append(full)
        self.names = [n for n, _ in named_params]
        self.axis = "dp"
        self.reshard_after_forward = True
        self.grads_ready, self.backward_started, self.reduced = 0, False, False
        self._pending: tuple[Any, torch.Tensor, torch.Tensor] | None = None
        self.state = UnitState.UNSHARDED
        self.reshard()  # frees the full weights and registers the shards in the module

    @property
    def label(self) -> str:
        return self.name or "(root)"

    def record_placements(self, axis: str, replicate_axis: str | None = None) -> None:
        """Record every shard ``Shard(0, size=d0)`` on ``axis`` (its group's key: "dp", or "dp+cp"
        when context-parallel ranks shard with it) on top of other axes' records: a TP shard [d0/t,
        ...] is cut again on its dim 0 (the records nest in order). HSDP: ``Replicate()`` on
        ``replicate_axis`` first, as DTensor's ``(Replicate(), Shard(0))``. Called again, it
        replaces its own earlier records."""
        for shard, shape in zip(self.shards, self.shapes, strict=True):
            for old in self._placed:
                P.clear_placement(shard, old)
            if replicate_axis is not None:
                P.set_placement(shard, replicate_axis, P.Replicate())
            P.set_placement(shard, axis, P.Shard(0, shape[0]))
        self._placed = (axis,) if replicate_axis is None else (replicate_axis, axis)
        self.axis = axis

    def set_replicate(self, group: comm.Group) -> None:
        """HSDP: shards replicated (their reduced gradients all-reduced) over ``group``."""
        self.replicate_group, self.replicas = group, dist.get_world_size(group)

    def _slots(self, p: nn.Parameter) -> list[tuple[nn.Module, str]]:
        """Every (submodule, attribute) of the unit's module registering ``p`` (tied: several)."""
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
        """(pre, post): the summed gradient is divided by ``pre`` before the reduce-scatter and by
        ``post`` after, pre x post = N (the mean over the ranks: each rank's loss is the mean over
        its B/N rows; HSDP: N = S x R, every data-parallel rank, FSDP2's ``data_parallel_size``).
        fp32 and bf16: (1, N); fp16: pre the power of two nearest sqrt(N) from below, so that
        neither the sum overflows nor the pre-divided gradients underflow (FSDP2's
        ``_get_gradient_divide_factors``)."""
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
        """Send this rank's padded chunks (cast to ``dtype``) back to back; receive all: [N x S]."""
        send = torch.cat([s.reshape(-1) for s in sources]).to(dtype)
        recv = torch.empty(self.world_size * self.segment, dtype=dtype, device=self.device)
        work = comm.all_gather(recv, send, group=self.group, async_op=async_op)
        self.events.append(("all_gather", self.name))
        return work, recv, send

    def _full(self, gathered: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i read from the rank-major buffer (segment r: chunk r; padding dropped)."""
        o, k = self.offsets[i], self.chunks[i]
        segments = gathered.view(self.world_size, self.segment)[:, o:o + k]
        return segments.reshape(-1, *self.shapes[i][1:])[:self.shapes[i][0]]

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The unit's parameters, full, fp32 (master shards), on the CPU, by name (a collective)."""
        _, gathered, _ = self._all_gather(self.padded, torch.float32)
        return {name: self._full(gathered, i).cpu().clone() for i, name in enumerate(self.names)}

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
        self._pending = (work, gathered, send)  # the input lives until the collective read it
        self.state = UnitState.GATHERING
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Finish a pending all-gather: copy into each full parameter's re-grown storage (via
        ``.data``: autograd's saved references to it stay valid), install the full weights."""
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
        """Free the full weights (storage resized to 0 bytes); put the shards back in the module."""
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
        """Put full fp32 ``nn.Parameter`` s (the gathered master weights) back in the module for
        good, the unit's own tensors freed: the module runs on its own afterwards
        (``FSDP2DataParallel.remove_hooks``)."""
        full = self.full_parameters()
        self.reshard()
        self._install([nn.Parameter(full[n].to(self.device)) for n in self.names])

    # ---- gradients

    def install_grad_views(self) -> None:
        pass  # autograd writes each full parameter's .grad; reduce_gradients copies it in

    def reduce_gradients(self) -> torch.Tensor:
        """Copy-in: chunk r of every full gradient into rank r's segment of an [N, S] buffer in the
        reduce dtype (zero padding rows; zeros for a parameter without a gradient); reduce-scatter
        over the shard group; HSDP: all-reduce over the replicate group (sums); divide by N
        (``divide_factors``). Returns rank r's S reduced fp32 elements: chunk i is shard i's."""
        n, dtype = self.world_size, self.reduce_dtype or self.param_dtype
        buf = torch.zeros(n, self.segment, dtype=dtype, device=self.device)
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            o, k = self.offsets[i], self.chunks[i]
            segments = buf[:, o:o + k].view(n, self.rows[i], -1)
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
        """HSDP's second step (a seam): sum the reduce-scattered shard over its replicas."""
        comm.all_reduce(out, group=self.replicate_group)
        self.events.append(("all_reduce", self.name))

    def accept_shard_grad(self, g: torch.Tensor) -> None:
        """Give shard i chunk i of ``g``, viewed in the shard's shape (added under accumulation)."""
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


def default_units(model: nn.Module) -> list[nn.Module]:
    """Every block (``model.blocks``), then the root: ``fully_shard`` on each, bottom-up."""
    blocks = getattr(model, "blocks", None)
    return [*blocks, model] if isinstance(blocks, nn.ModuleList) else [model]


class FSDP2DataParallel(ParallelWrapper):
    """FSDP2 of ``module`` over ``mesh.group("dp", "cp")`` (HSDP: ``"dp_shard", "cp"``) or
    ``group``: its parameters become their shards (build the optimizer after it).

    ``units``: the modules sharded, bottom-up (default ``default_units``); the parameters of none
    stay replicated. ``reshard_after_forward``: None frees every unit but the root after forward,
    True every unit, False none. ``param_dtype`` / ``reduce_dtype``: the mixed-precision policy.
    ``unit``: the unit factory (``PerParameterUnit``; a variant overrides ``chunk_rows`` or
    ``divide_factors``). On a model another axis transformed (TP first), each local tensor is
    sharded again and a ``Partial()`` gradient is summed over its axis after the reduce-scatter
    (``dp_reduce``), which needs ``mesh``."""

    def __init__(self, module: nn.Module, stage: int = 3, *, mesh: HasGroups | None = None,
                 group: comm.Group = None, units: Iterable[nn.Module] | None = None,
                 prefetch: bool = False, reshard_after_forward: bool | None = None,
                 param_dtype: torch.dtype = torch.float32, reduce_dtype: torch.dtype | None = None,
                 broadcast: bool = True, unit: type[PerParameterUnit] = PerParameterUnit) -> None:
        if stage != 3:
            raise ValueError(f"per-parameter sharding is ZeRO stage 3 (FSDP); got stage={stage}")
        if reduce_dtype not in (None, *MIXED_DTYPES):
            raise ValueError(f"reduce_dtype must be None or one of {MIXED_DTYPES}, "
                             f"got {reduce_dtype}")
        hybrid = mesh is not None and hasattr(mesh, "size") and mesh.size("dp_replicate") > 1
        if hybrid:
            self.axes = ("dp_shard", "cp")  # the group the shards live on
        super().__init__(module, mesh=mesh, group=group)
        self.param_dtype, self.mesh = param_dtype, mesh
        self.groups = mesh if mesh is not None else {R.DATA: self.group}
        if broadcast:
            broadcast_from_first(module, self.group)
        self.events: list[tuple[str, str]] = []
        modules = list(default_units(module) if units is None else units)
        paths = {m: name for name, m in module.named_modules()}
        owned: set[int] = set()
        self.units: list[PerParameterUnit] = []
        for m in modules:
            if m not in paths:
                raise ValueError(f"unit {type(m).__name__} is not a submodule of the model")
            prefix = paths[m] + "." if paths[m] else ""
            named = [(prefix + n, p) for n, p in m.named_parameters()
                     if p.requires_grad and id(p) not in owned]
            if not named:
                continue
            owned.update(id(p) for _, p in named)
            self.units.append(unit(paths[m], m, named, 3, self.group, param_dtype, self.events))
            self.units[-1].reduce_dtype = reduce_dtype
            owned.update(id(s) for s in self.units[-1].shards)  # the shards it registered in m
        self.replicated = [p for p in module.parameters() if p.requires_grad and id(p) not in owned]
        """The trainable parameters in no unit: whole on every rank, their gradients all-reduced."""
        self.root = self.units[-1] if self.units and self.units[-1].module is module else None
        self.axis = "dp+cp" if mesh is not None and mesh.size("cp") > 1 else "dp"
        self.replicate_group: comm.Group = None
        if hybrid:
            self._hybrid(mesh, broadcast)
        else:
            for u in self.units:
                u.record_placements(self.axis)
        for u in self.units:
            u.reshard_after_forward = (u is not self.root) if reshard_after_forward is None \
                else bool(reshard_after_forward)
        replicas = dist.get_world_size(self.replicate_group) if hybrid else 1
        self.data_size = self.world_size * replicas
        self.peak_bytes = {"parameters": 0, "gradients": 0}
        self.schedule = UnitSchedule(self.units, self.root, 3, prefetch,
                                     lambda: self._require_sync, self._sample)
        self._sample()

    def _hybrid(self, mesh: Any, broadcast: bool) -> None:
        """HSDP: every unit's shards replicated over ``mesh.group("dp_replicate")``, recorded so."""
        group = self.replicate_group = mesh.group("dp_replicate")
        self.axis = "dp_shard+cp" if mesh.size("cp") > 1 else "dp_shard"
        for u in self.units:
            u.set_replicate(group)
            u.record_placements(self.axis, "dp_replicate")
            if broadcast:  # the shard groups agree already; now each replica takes the first's
                for pad in u.padded:
                    comm.broadcast(pad, comm.global_rank(group, 0), group=group)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The shards and the replicated parameters: the module's own trainable parameters."""
        return iter([*[s for u in self.units for s in u.shards], *self.replicated])

    def after_step(self) -> None:
        self._sample()

    def finish_gradient_sync(self) -> None:
        """Average the replicated parameters' gradients (``dp_reduce``), sum the partial shards."""
        R.reduce_gradients(self.replicated, self.groups, self.data_size)
        R.sum_partials([s for u in self.units for s in u.shards], self.groups)

    def reduce_losses(self, local: torch.Tensor) -> torch.Tensor:
        """The mean over the shard group, then (HSDP) the replicas: over every data rank."""
        losses = super().reduce_losses(local)
        if self.replicate_group is None:
            return losses
        comm.all_reduce(losses, group=self.replicate_group)
        return losses / dist.get_world_size(self.replicate_group)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, full and fp32, by the model's names (a collective)."""
        out: dict[str, torch.Tensor] = {}
        for u in self.units:
            out.update(u.full_parameters())
        for name, p in self.module.named_parameters():
            if name not in out:
                out[name] = p.detach().float().cpu().clone()
        return {name: out[name] for name, _ in self.module.named_parameters()}

    def remove_hooks(self) -> None:
        """Remove every hook, give the module full fp32 parameters back (a collective): spent."""
        for u in self.units:
            u.restore_full()
        self.schedule.remove()
        super().remove_hooks()

    def _sample(self) -> None:
        now = model_state_bytes(self.units, self.param_dtype)
        for k in self.peak_bytes:
            self.peak_bytes[k] = max(self.peak_bytes[k], now[k])
