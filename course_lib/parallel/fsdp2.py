"""FSDP2-style per-parameter sharding: every parameter sharded on its dim 0, its gradient shard on the shard.

The flat-parameter form (``zero``; FSDP1, DeepSpeed) concatenates a unit's parameters into one buffer and gives
rank r a contiguous slice of it: a slice that may start in the middle of one weight and end in the middle of
another, so the optimizer sees one flat vector per unit and no parameter keeps its shape. PyTorch's FSDP2
(``fully_shard``) shards *each parameter* on dim 0 instead (a ``DTensor`` with ``Shard(0)``): a [d0, ...]
weight is padded to N x c rows, c = ceil(d0 / N), and rank r holds rows [r c, (r+1) c). What that buys:

* the optimizer, gradient clipping and the state dict see parameters of their own (shard) shape, named as in
  the model -- no flat-to-parameter bookkeeping in checkpoints;
* it composes with tensor parallelism: a TP-sharded weight is sharded again on dim 0 by FSDP, each parameter
  independently (a flat buffer mixes weights that TP split differently);
* per-parameter dtypes and ``requires_grad`` are no problem (a flat buffer has one of each).

What it costs: the collectives still work on one buffer per unit (one all-gather, one reduce-scatter, as the
flat form), laid out rank-major -- for each rank r the r-th chunk of every parameter, back to back -- so rank r
sends its chunks without a copy, but the gathered buffer must be *copied out* into each full parameter (its
rows are spread over N segments) and the gradients *copied in* before the reduce-scatter: two copies of the
unit per step that the flat form avoids (FSDP2's "all-gather copy-out" and "reduce-scatter copy-in"), plus up
to N - 1 padding rows per parameter instead of N - 1 elements per unit.

``PerParameterUnit`` implements a ``zero`` unit this way (stage 3 only, fp32), run by the same hook engine:
``FSDP2DataParallel`` is ``ZeroDataParallel`` with these units. After backward every trainable parameter's
shard carries a ``.grad`` of the shard's own shape and dtype; the full parameters have ``.grad`` None.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from course_lib import comm
from course_lib.parallel.zero import ZeroDataParallel
from course_lib.parallel.zero_unit import FlatLayout, FlatParamUnit, UnitState


class PerParameterUnit(FlatParamUnit):
    """One unit whose parameters are sharded one by one on dim 0 (see the module docstring).

    ``shards[i]``: rank r's rows of parameter i, shape [c_i, *rest_i] (zero padding rows at the end of the last
    ranks); ``offsets[i]``: where its chunk starts in the rank's S-element segment of the rank-major buffer."""

    flat = False

    def __init__(self, name: str, module: nn.Module, named_params: Sequence[tuple[str, nn.Parameter]], stage: int,
                 group: comm.Group = None, param_dtype: torch.dtype = torch.float32,
                 events: list[tuple[str, str]] | None = None) -> None:
        if stage != 3 or param_dtype != torch.float32:
            raise ValueError("per-parameter sharding is implemented for stage 3 (FSDP) in fp32 only")
        if not named_params:
            raise ValueError(f"unit {name!r} has no parameters of its own (all belong to units below it)")
        import torch.distributed as dist

        self.name, self.module, self.stage, self.group = name, module, stage, group
        self.params = [p for _, p in named_params]
        self.param_dtype = param_dtype
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.shard_rank = self.rank
        self.events = events if events is not None else []
        self.device = self.params[0].device
        n, r = self.world_size, self.rank
        self.rows = [max(1, math.ceil(p.shape[0] / n)) if p.dim() else 1 for p in self.params]
        self.chunks = [c * (p[0].numel() if p.dim() else 1) for c, p in zip(self.rows, self.params, strict=True)]
        self.offsets = [sum(self.chunks[:i]) for i in range(len(self.chunks))]
        self.segment = sum(self.chunks)  # S: elements each rank holds of this unit
        self.shards: list[nn.Parameter] = []
        with torch.no_grad():
            for p, c in zip(self.params, self.rows, strict=True):
                full = p.detach().reshape(p.shape[0] if p.dim() else 1, -1)
                padded = torch.zeros(n * c, full.shape[1], dtype=torch.float32, device=self.device)
                padded[:full.shape[0]] = full
                self.shards.append(nn.Parameter(padded[r * c:(r + 1) * c].reshape(c, *p.shape[1:]).clone()))
        numel = sum(p.numel() for p in self.params)
        self.layout = FlatLayout(tuple(n_ for n_, _ in named_params), tuple(tuple(p.shape) for p in self.params),
                                 tuple(self.offsets), numel, n * self.segment, n)
        self.reshard_after_forward = True
        self.flat_grad = None
        self.grads_ready, self.backward_started, self.reduced = 0, False, False
        self.state = UnitState.UNSHARDED
        self.reshard()

    # ---- what the engine and the memory accounting see

    def optimizer_params(self) -> list[nn.Parameter]:
        return list(self.shards)

    def weight_tensors(self) -> list[torch.Tensor]:
        return list(self.params)

    def _gathered(self) -> torch.Tensor:
        """All-gather every rank's segment: [N, S], row r = rank r's chunks back to back."""
        send = torch.cat([s.detach().reshape(-1) for s in self.shards])
        recv = torch.empty(self.world_size * self.segment, dtype=send.dtype, device=send.device)
        comm.all_gather(recv, send, group=self.group)
        self.events.append(("all_gather", self.name))
        return recv.view(self.world_size, self.segment)

    def _full(self, gathered: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i, copied out of the rank-major buffer (its rows are spread over the N segments)."""
        p, o, k = self.params[i], self.offsets[i], self.chunks[i]
        rows = gathered[:, o:o + k].reshape(self.world_size * self.rows[i], -1)
        return rows[:p.shape[0] if p.dim() else 1].reshape(p.shape)

    def gather_full(self) -> dict[str, torch.Tensor]:
        gathered = self._gathered()
        return {name: self._full(gathered, i).cpu().clone() for i, name in enumerate(self.layout.names)}

    # ---- parameters

    def unshard(self, async_op: bool = False) -> None:
        """All-gather and copy out into every parameter's storage (given back its bytes first). Synchronous:
        a prefetch request gathers at once."""
        if self.state is UnitState.UNSHARDED:
            return
        gathered = self._gathered()
        with torch.no_grad():
            for i, p in enumerate(self.params):
                p.data.untyped_storage().resize_(p.numel() * p.element_size())
                p.data.copy_(self._full(gathered, i))
        self.state = UnitState.UNSHARDED

    def wait(self) -> None:
        pass

    def reshard(self) -> None:
        """Free every full parameter (storage resized to 0 bytes; the parameter keeps its shape)."""
        if self.state is UnitState.SHARDED:
            return
        for p in self.params:
            p.data.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED

    def refresh_full(self) -> None:
        pass  # stage 3: the next forward gathers the updated shards

    # ---- gradients

    def install_grad_views(self) -> None:
        pass  # autograd writes each parameter's full .grad; reduce_gradients copies it in

    def reduce_gradients(self) -> torch.Tensor:
        """Copy every full gradient into the rank-major buffer (zero padding rows; zeros for a parameter without
        a gradient), reduce-scatter it, average: this rank's S reduced elements, chunk i for shard i."""
        n = self.world_size
        buf = torch.zeros(n, self.segment, dtype=torch.float32, device=self.device)
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            g = p.grad.reshape(p.shape[0] if p.dim() else 1, -1)
            padded = torch.zeros(n * self.rows[i], g.shape[1], dtype=g.dtype, device=g.device)
            padded[:g.shape[0]] = g
            buf[:, self.offsets[i]:self.offsets[i] + self.chunks[i]] = padded.view(n, -1)
        out = torch.empty(self.segment, dtype=torch.float32, device=self.device)
        comm.reduce_scatter(out, buf.view(-1), group=self.group)
        self.events.append(("reduce_scatter", self.name))
        self.average(out)
        self.reduced = True
        return out

    def accept_shard_grad(self, g: torch.Tensor) -> None:
        for s, o, k in zip(self.shards, self.offsets, self.chunks, strict=True):
            piece = g[o:o + k].view(s.shape)
            if s.grad is None:
                s.grad = piece.clone()
            else:  # gradient accumulation over several backward passes
                s.grad += piece

    def free_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def zero_flat_grad(self) -> None:
        pass


class FSDP2DataParallel(ZeroDataParallel):
    """ZeRO-3 / FSDP with per-parameter dim-0 shards (``PerParameterUnit``), FSDP2's layout. ``parameters()``
    are the per-parameter shards; everything else is ``ZeroDataParallel``'s (hooks, prefetch order,
    ``reshard_after_forward``, ``no_sync``)."""

    unit_class = PerParameterUnit

    def __init__(self, module: nn.Module, stage: int = 3, **kwargs: Any) -> None:
        if stage != 3:
            raise ValueError(f"per-parameter sharding is ZeRO stage 3 (FSDP); got stage={stage}")
        super().__init__(module, 3, **kwargs)
