"""Checkpoints across meshes: save a composed run at one mesh, resume it at another (DP 4 -> DP 2 x TP 2,
PP 2 -> PP 1, ...), and the resumed run equals the uninterrupted one.

The checkpoint holds **whole** tensors by the single-process model's names: every parameter and its optimizer
state (AdamW's m and v, SGD's momentum; the step count), independent of the mesh that wrote it -- the idea of
PyTorch's Distributed Checkpoint (``torch.distributed.checkpoint``) and Megatron's ``dist_checkpointing``, which
store each shard with its place in the global tensor so that any mesh can read it back; here, on tiny models, the
shards are simply gathered first.

* ``save_checkpoint`` (every rank calls it: it gathers over the axes that shard what it trains): each rank
  gathers every parameter and state tensor as the parameter's placements say (``placement.full_tensor``: TP's
  slices, ZeRO-3 / FSDP2's dim-0 shards, both nested; HSDP's over ``dp_shard`` only, its replicas being
  equal); experts are named by their global index; each rank
  writes the tensors it is the first copy of (tp = 0 and dp = cp = 0, or edp = 0 for an expert; ZeRO-1's
  state: the rank that owns it) -- ``stage<pp>.pt`` from the stage's first rank (every tensor of a replicated
  run), ``stage<pp>-rank<k>.pt`` from any other (experts, ZeRO-1's owners); rank 0 writes the step. A folder
  saved to again is emptied of the previous save's files first, so no stale file joins the union on load.
* ``load_checkpoint`` reads every file into one name -> tensor map.
* Resuming: load the whole parameters into the single-process model *before* ``parallelize`` (tensor
  parallelism, FSDP2 and EP cut the weights they find, so the new mesh cuts them itself), then
  ``restore_optimizer`` cuts each state tensor the way its parameter is placed on the new mesh
  (``placement.shard_like``).

The optimizer: replicated (``zero_stage=0``), ZeRO-1's ``ShardedOptimizer`` (whole parameters per owner; with
experts ``ep_mesh.ExpertShardedOptimizer``, two partitions: the dense state over dp x cp, the experts' over edp,
each owner writing the states it steps, so the union holds every expert's state once, by its global index, and
a resume at another ep or edp hands each to its owner in the new partitions), ZeRO-2's flat shards (gathered
over dp, cut into their parameters by the unit's layout, and laid out again on resume) or ZeRO-3 / FSDP2's
per-parameter shards. (``zero_checkpoint`` is the other way: each rank writes only its
shard, resharded by offsets on load; the same model's units only.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel.ep_mesh import ExpertShardedOptimizer
from course_lib.parallel.placement import axis_group, full_tensor, shard_like, sharded_lists
from course_lib.parallel.sharded_optimizer import ShardedOptimizer


class Parallelized(Protocol):
    """What a checkpoint needs of ``compose.Parallelized`` (a protocol, so this module does not import compose):
    the model, its mesh and the parameters this rank trains (placed on the mesh's axes)."""

    module: nn.Module
    mesh: Any

    def parameters(self) -> Iterator[nn.Parameter]: ...

STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
"""The per-element optimizer states of AdamW and SGD (shaped like the parameter); ``step`` is a scalar."""


def _gather(composed: Parallelized, p: nn.Parameter, t: torch.Tensor) -> torch.Tensor:
    return full_tensor(p, composed.mesh, t).cpu()


def _cut(composed: Parallelized, p: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    return shard_like(full, p, composed.mesh)


def _names(composed: Parallelized) -> dict[int, str]:
    """id(parameter) -> its single-process name: a module list split over an axis (experts) names its local
    entry i of rank r by the global index r n_local + i (``placement.full_parameters`` does the same)."""
    names = {id(p): n for n, p in composed.module.named_parameters()}
    for lname, experts, axis, _ in sharded_lists(composed.module):
        first = axis_group(composed.mesh, axis)
        offset = dist.get_rank(first) * len(experts)
        for i, e in enumerate(experts):
            for pname, p in e.named_parameters():
                names[id(p)] = f"{lname}.{offset + i}.{pname}"
    return names


def _writers(composed: Parallelized) -> dict[int, bool]:
    """id(parameter) -> whether this rank writes it: the first of its copies once gathered (tp = 0 and the
    first replica: dp = cp = 0 for a dense parameter, edp = 0 for an expert, which ep splits)."""
    coords = composed.mesh.shape.coords(composed.mesh.rank)
    in_list = {id(p) for _, m, _, _ in sharded_lists(composed.module) for p in m.parameters()}
    dense = coords["dp"] == coords["cp"] == coords["tp"] == 0
    expert = coords["tp"] == coords["edp"] == 0
    return {id(p): (expert if id(p) in in_list else dense) for p in composed.module.parameters()}


def _steppers(optimizer: torch.optim.Optimizer) -> dict[int, tuple[torch.optim.Optimizer, bool, bool]]:
    """id(parameter) -> (the optimizer that holds its state, whether this rank steps it, whether its state is
    partitioned over a group). ZeRO-1's ``ShardedOptimizer`` keeps the state in its local optimizer, on the group
    rank its partition gives the parameter; ``ExpertShardedOptimizer`` has two: the dense parameters' over
    dp x cp and the experts' over edp (a plain optimizer when edp = 1)."""
    parts = ([optimizer.dense, optimizer.experts] if isinstance(optimizer, ExpertShardedOptimizer)
             else [optimizer])
    out: dict[int, tuple[torch.optim.Optimizer, bool, bool]] = {}
    for part in parts:
        if isinstance(part, ShardedOptimizer):
            out |= {id(p): (part.optimizer, r == part.rank, True) for p, r in zip(part.params, part.owner,
                                                                                    strict=True)}
        elif part is not None:
            out |= {id(p): (part, True, False) for g in part.param_groups for p in g["params"]}
    return out


def _inners(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers that hold state (``_steppers``), each once."""
    return list({id(o): o for o, _, _ in _steppers(optimizer).values()}.values())


def _flat_units(composed: Parallelized) -> list[Any]:
    """ZeRO-2's flat units (one 1-D shard over dp of a buffer holding several parameters); FSDP2's are not."""
    return [u for u in getattr(getattr(composed, "dp", None), "units", ()) if getattr(u, "flat", False)]


def _entries(composed: Parallelized, optimizer: torch.optim.Optimizer
             ) -> Iterator[tuple[nn.Parameter, torch.Tensor, dict[str, Any] | None]]:
    """(parameter, its value, its optimizer state or None where another rank steps it), each placed like the
    parameter (a collective: every rank walks them in the same order). ZeRO-2's flat shards are gathered over
    dp first and cut into their parameters (``layout.views``): each piece is then placed like its parameter on
    the other axes (TP's slices); a scalar state (AdamW's step) is the unit's, shared by its parameters."""
    steppers, flat = _steppers(optimizer), _flat_units(composed)
    shards = {id(u.shard) for u in flat}
    for p in composed.parameters():
        if id(p) not in shards:
            stepper = steppers.get(id(p))  # none: a parameter no optimizer steps
            yield p, p, (stepper[0].state.get(p, {}) if stepper and stepper[1] else None)
    for u in flat:
        group = {u.axis: u.group}
        state = steppers[id(u.shard)][0].state.get(u.shard, {})
        vectors = {k: u.layout.views(full_tensor(u.shard, group, v)) for k, v in state.items() if k in STATE_KEYS}
        scalars = {k: v for k, v in state.items() if k not in STATE_KEYS}
        values = u.layout.views(full_tensor(u.shard, group))
        for i, p in enumerate(u.params):
            yield p, values[i], {**scalars, **{k: v[i] for k, v in vectors.items()}}


def _restore_flat(composed: Parallelized, inner: torch.optim.Optimizer, u: Any,
                  states: list[dict[str, torch.Tensor]]) -> None:
    """A ZeRO-2 unit's state from its parameters' whole ones: each cut like its parameter (TP), laid out in the
    unit's flat buffer (``layout.views``), this rank's [lo, hi) kept."""
    lo, hi = u.bounds()
    state = {k: v.clone() for k, v in states[0].items() if k not in STATE_KEYS}
    for key in [k for k in states[0] if k in STATE_KEYS]:
        buf = torch.zeros(u.layout.padded_numel, dtype=u.shard.dtype, device=u.shard.device)
        for view, p, s in zip(u.layout.views(buf), u.params, states, strict=True):
            view.copy_(_cut(composed, p, s[key]))
        state[key] = buf[lo:hi].clone()
    if state:
        inner.state[u.shard] = state


def _check_optimizer(composed: Parallelized, optimizer: torch.optim.Optimizer) -> None:
    known = (torch.optim.AdamW, torch.optim.SGD)
    unknown = sorted({type(o).__name__ for o in _inners(optimizer) if not isinstance(o, known)})
    if unknown:
        raise ValueError(f"rank {composed.mesh.rank}: save_checkpoint takes AdamW or SGD (directly or in ZeRO-1's "
                         f"ShardedOptimizer or ExpertShardedOptimizer), got {', '.join(unknown)} in "
                         f"{type(optimizer).__name__}: its state keys are not known")


def save_checkpoint(composed: Parallelized, optimizer: torch.optim.Optimizer, step: int, path: str | Path) -> None:
    """Write the whole parameters and optimizer state of the run after ``step`` steps to folder ``path`` (every
    rank calls it: the gathers are collectives). Each rank writes the tensors it is the
    first copy of (``_writers``; ZeRO-1's state: its owner), so the files together hold every name once."""
    _check_optimizer(composed, optimizer)
    path = Path(path)
    names, writes = _names(composed), _writers(composed)
    partitioned = {k for k, (_, _, part) in _steppers(optimizer).items() if part}  # ZeRO-1's, written by owners
    coords = composed.mesh.shape.coords(composed.mesh.rank)
    if dist.get_rank() == 0 and path.is_dir():  # a previous save's files (another mesh, other writers)
        for old in [*path.glob("stage*.pt"), path / "meta.json"]:
            old.unlink(missing_ok=True)
    dist.barrier()
    params: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    for p, value, state in _entries(composed, optimizer):
        full = _gather(composed, p, value)
        if writes[id(p)]:
            params[names[id(p)]] = full
        if state is None:  # ZeRO-1: another dp (edp) rank steps p (its tp peers own it alike)
            continue
        state = {k: (_gather(composed, p, v) if k in STATE_KEYS else v.detach().cpu().clone())
                 for k, v in state.items() if v is not None}
        if writes[id(p)] or (id(p) in partitioned and coords["tp"] == 0):
            states[names[id(p)]] = state
    path.mkdir(parents=True, exist_ok=True)
    if params or states:
        first = coords["dp"] == coords["cp"] == coords["tp"] == 0  # the stage's dense writer: stage<pp>.pt
        name = f"stage{coords['pp']}.pt" if first else f"stage{coords['pp']}-rank{composed.mesh.rank}.pt"
        torch.save({"params": params, "optimizer": states}, path / name)
    if dist.get_rank() == 0:
        shape = composed.mesh.shape
        meta = {"step": step, "mesh": {a: getattr(shape, a) for a in ("dp", "cp", "tp", "pp", "ep")},
                "order": shape.order}
        (path / "meta.json").write_text(json.dumps(meta))
    dist.barrier()


def load_checkpoint(path: str | Path) -> tuple[int, dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(steps done, whole parameters by name, optimizer state by parameter name) from folder ``path``: the
    union of its rank files."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    params: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    files = sorted(path.glob("stage*.pt"))
    if not files:
        raise ValueError(f"{path}: no stage*.pt files next to meta.json: not a finished checkpoint")
    for f in files:
        part = torch.load(f, weights_only=True)
        params |= part["params"]
        states |= part["optimizer"]
    return meta["step"], params, states


def load_parameters(model: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Copy whole checkpoint parameters into a single-process model (before ``parallelize``)."""
    own = dict(model.named_parameters())
    missing = sorted(n for n, p in own.items() if p.requires_grad and n not in params)
    unknown = sorted(set(params) - set(own))
    if missing or unknown:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise ValueError(f"rank {rank}: the checkpoint has no {missing[:4]}{' ...' if len(missing) > 4 else ''}"
                         f"{f' and unknown {unknown[:4]}' if unknown else ''}: it was written for another model "
                         "(or by an unfinished save): resume with the GPTConfig that saved it, or save again")
    with torch.no_grad():
        for name, t in params.items():
            own[name].copy_(t)


def restore_optimizer(composed: Parallelized, optimizer: torch.optim.Optimizer,
                      states: dict[str, dict[str, torch.Tensor]]) -> None:
    """Give each parameter this rank steps its optimizer state, cut for the new mesh like the parameter
    (``shard_like``: TP's slices, FSDP2's dim-0 shards; experts by global index; ZeRO-1: only its owner; ZeRO-2:
    laid out in the flat shard, ``_restore_flat``)."""
    names, steppers = _names(composed), _steppers(optimizer)
    flat = _flat_units(composed)
    shards = {id(u.shard) for u in flat}
    stepped = [p for p in composed.parameters() if id(p) in steppers and id(p) not in shards]
    missing = sorted(names[id(p)] for p in [*stepped, *(p for u in flat for p in u.params)]
                     if names[id(p)] not in states)
    if missing:  # checked for every parameter of the partitions, owned or not: its peers raise alike
        raise ValueError(f"rank {composed.mesh.rank}: the checkpoint has no optimizer state for {missing[:4]}"
                         f"{' ...' if len(missing) > 4 else ''}: it was written by an unfinished save or for "
                         "another model; save it again")
    for p in stepped:
        inner, owns, _ = steppers[id(p)]
        if owns:
            inner.state[p] = {k: (_cut(composed, p, v) if k in STATE_KEYS else v.clone())
                              for k, v in states[names[id(p)]].items()}
    for u in flat:
        _restore_flat(composed, steppers[id(u.shard)][0], u, [states[names[id(p)]] for p in u.params])
