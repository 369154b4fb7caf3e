"""Checkpoints across meshes: save a composed run at one mesh, resume it at another (DP 4 -> DP 2 x TP 2,
PP 2 -> PP 1, ...), and the resumed run equals the uninterrupted one.

The checkpoint holds **whole** tensors by the single-process model's names: every parameter and its optimizer
state (AdamW's m and v, SGD's momentum; the step count), independent of the mesh that wrote it -- the idea of
PyTorch's Distributed Checkpoint (``torch.distributed.checkpoint``) and Megatron's ``dist_checkpointing``, which
store each shard with its place in the global tensor so that any mesh can read it back; here, on tiny models, the
shards are simply gathered first.

* ``save_checkpoint`` (every rank calls it: it gathers over the axes that shard what it trains): each rank
  gathers every parameter and state tensor as the parameter's placements say (``placement.full_tensor``); one
  rank per pipeline stage (dp = cp = tp = 0) writes them to ``stage<k>.pt``; rank 0 writes the step.
* ``load_checkpoint`` reads every stage file into one name -> tensor map.
* Resuming: load the whole parameters into the single-process model *before* ``parallelize`` (tensor
  parallelism slices the weights it finds, so the new mesh cuts them itself), then ``restore_optimizer`` cuts each
  state tensor the way its parameter is placed on the new mesh (``placement.shard_like``).

The optimizer must be one replicated over the data-parallel group (``ParallelConfig(zero_stage=0)``); a ZeRO
run's sharded state has its own resharding checkpoint (``zero_checkpoint``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel.placement import full_tensor, shard_like


class Parallelized(Protocol):
    """What a checkpoint needs of ``compose.Parallelized`` (a protocol, so this module does not import compose):
    the model, its mesh and the parameters this rank trains (placed on the mesh's axes)."""

    module: nn.Module
    mesh: Any

    def parameters(self) -> Iterator[nn.Parameter]: ...

STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
"""The per-element optimizer states of AdamW and SGD (shaped like the parameter); ``step`` is a scalar."""


def _names(composed: Parallelized) -> dict[int, str]:
    return {id(p): n for n, p in composed.module.named_parameters()}


def _gather(composed: Parallelized, p: nn.Parameter, t: torch.Tensor) -> torch.Tensor:
    return full_tensor(p, composed.mesh, t).cpu()


def _cut(composed: Parallelized, p: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    return shard_like(full, p, composed.mesh)


def save_checkpoint(composed: Parallelized, optimizer: torch.optim.Optimizer, step: int, path: str | Path) -> None:
    """Write the whole parameters and optimizer state of the run after ``step`` steps to folder ``path`` (every
    rank calls it)."""
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.SGD)):
        raise ValueError(f"save_checkpoint takes the replicated AdamW or SGD of ParallelConfig(zero_stage=0), got "
                         f"{type(optimizer).__name__}: a ZeRO run's sharded state is zero_checkpoint's")
    path = Path(path)
    names = _names(composed)
    params: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    for p in composed.parameters():
        params[names[id(p)]] = _gather(composed, p, p)
        state = optimizer.state.get(p, {})
        states[names[id(p)]] = {k: (_gather(composed, p, v) if k in STATE_KEYS else v.detach().cpu().clone())
                                for k, v in state.items() if v is not None}
    shape = composed.mesh.shape
    coords = shape.coords(composed.mesh.rank)
    if coords["dp"] == coords["cp"] == coords["tp"] == 0:
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"params": params, "optimizer": states}, path / f"stage{coords['pp']}.pt")
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        meta = {"step": step, "mesh": {a: getattr(shape, a) for a in ("dp", "cp", "tp", "pp", "ep")},
                "order": shape.order}
        (path / "meta.json").write_text(json.dumps(meta))
    dist.barrier()


def load_checkpoint(path: str | Path) -> tuple[int, dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(steps done, whole parameters by name, optimizer state by parameter name) from folder ``path``."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    params: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    files = sorted(path.glob("stage*.pt"))
    if len(files) != meta["mesh"]["pp"]:
        raise ValueError(f"{path}: {len(files)} stage files for a run with pp = {meta['mesh']['pp']}")
    for f in files:
        part = torch.load(f, weights_only=True)
        params |= part["params"]
        states |= part["optimizer"]
    return meta["step"], params, states


def load_parameters(model: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Copy whole checkpoint parameters into a single-process model (before ``parallelize``)."""
    own = dict(model.named_parameters())
    missing = sorted(n for n, p in own.items() if p.requires_grad and n not in params)
    if missing:
        raise ValueError(f"the checkpoint has no {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    with torch.no_grad():
        for name, t in params.items():
            own[name].copy_(t)


def restore_optimizer(composed: Parallelized, optimizer: torch.optim.Optimizer,
                      states: dict[str, dict[str, torch.Tensor]]) -> None:
    """Give each parameter this rank trains its optimizer state, cut for the new mesh like the parameter."""
    names = _names(composed)
    for p in composed.parameters():
        state = states[names[id(p)]]
        optimizer.state[p] = {k: (_cut(composed, p, v) if k in STATE_KEYS else v.clone()) for k, v in state.items()}
