"""The checkpoint formats: a run saved at one mesh, resumed at another.

* **Sharded** (``save_sharded``, ``load_sharded``): ZeRO's flat units, each rank writing only its
  shard and the optimizer state of that shard, with the units' layouts in ``metadata.json``; a
  checkpoint loads at any data-parallel degree and stage (re-sharded by offsets), or into one
  process (``load_sharded_state_dict``).
* **Whole** (``save_whole``, ``load_whole``): any composed run (TP, FSDP2, PP, EP, ZeRO-1/2) holds
  **whole** tensors by the single-process model's names: every parameter and its optimizer state,
  gathered as its placements say, each written once by the first of its copies (the experts by their
  global index, ZeRO-1's state by its owner). Resuming: ``load_parameters`` into the single-process
  model *before* ``parallelize`` (which cuts what it finds), then ``restore_optimizer`` cuts each
  state like its parameter on the new mesh.

PyTorch's Distributed Checkpoint and Megatron's ``dist_checkpointing`` store each shard with its
place in the global tensor instead, so that nothing is gathered; on the course's tiny models
gathering first is simpler. Chapter 03 saves the sharded form, chapter 10 resumes the whole one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.parallel.placement_ops import axis_group, full_tensor, shard_like, sharded_lists
from course_lib.parallel.sharded_optimizer import ShardedOptimizer
from course_lib.parallel.zero_unit import FlatLayout


class Sharded(Protocol):
    """What the sharded format reads of ``zero.ZeroDataParallel``: its units and their sharding."""

    units: list[Any]
    stage: int
    group: comm.Group
    rank: int
    world_size: int


def layout_to_json(layout: FlatLayout) -> dict[str, Any]:
    entries = zip(layout.names, layout.shapes, layout.offsets, strict=True)
    return {"params": [{"name": n, "shape": list(s), "offset": o} for n, s, o in entries],
            "numel": layout.numel, "padded_numel": layout.padded_numel,
            "world_size": layout.world_size}


def layout_from_json(d: dict[str, Any]) -> FlatLayout:
    ps = d["params"]
    return FlatLayout(tuple(p["name"] for p in ps), tuple(tuple(p["shape"]) for p in ps),
                      tuple(p["offset"] for p in ps), d["numel"], d["padded_numel"],
                      d["world_size"])

CHECKPOINT_FORMAT = "course_lib.zero/v1"


def _require_flat(zdp: Sharded) -> None:
    if not all(u.flat for u in zdp.units):
        raise ValueError("sharded checkpoints store flat-parameter units; per-parameter "
                         "(FSDP2-style) units are not supported: save zdp.full_parameters() "
                         "instead")

# --------------------------------------------------------------------------------------------------
# Sharded checkpoints


def _shard_file(path: Path, shard_rank: int, num_shards: int) -> Path:
    return path / f"shard_{shard_rank:05d}_of_{num_shards:05d}.pt"


def save_sharded(zdp: Sharded, optimizer: torch.optim.Optimizer, path: str | Path,
                 step: int) -> None:
    """Each rank writes only what it owns: its shard of every unit and that shard's optimizer state.

    Layout of ``path``: ``metadata.json`` (rank 0: format, step, world size, stage, and per unit the
    parameter names, shapes and offsets in the flat buffer, its sizes and padding) and
    ``shard_<r>_of_<N>.pt`` per rank (stage 0: one file, every rank holds the same). A collective:
    every rank must call it; it returns once every file is on disk (a barrier)."""
    _require_flat(zdp)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    num_shards = zdp.units[0].layout.world_size
    if zdp.units[0].shard_rank == zdp.rank and zdp.rank < num_shards:
        units = {}
        for u in zdp.units:
            state = optimizer.state.get(u.shard, {})
            units[u.name] = {"param": u.shard.detach().clone(),
                             "state": {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                       for k, v in state.items()}}
        torch.save({"step": step, "units": units}, _shard_file(path, zdp.rank, num_shards))
    if zdp.rank == 0:
        meta = {"format": CHECKPOINT_FORMAT, "step": step, "world_size": zdp.world_size,
                "num_shards": num_shards, "stage": zdp.stage, "optimizer": type(optimizer).__name__,
                "units": [{"name": u.name, **layout_to_json(u.layout)} for u in zdp.units]}
        (path / "metadata.json").write_text(json.dumps(meta, indent=1))
    comm.barrier(zdp.group)


def _read_metadata(path: Path) -> dict[str, Any]:
    meta = json.loads((path / "metadata.json").read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a {CHECKPOINT_FORMAT} checkpoint "
                         f"(format {meta.get('format')!r})")
    return meta


class _ShardReader:
    """Reads the old ranks' files lazily (memory-mapped); assembles any element range of a unit."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path, self.meta = path, meta
        self._files: dict[int, dict[str, Any]] = {}

    def file(self, j: int) -> dict[str, Any]:
        if j not in self._files:
            name = _shard_file(self.path, j, self.meta["num_shards"])
            self._files[j] = torch.load(name, mmap=True, weights_only=True)
        return self._files[j]

    def gather(self, unit_name: str, layout: FlatLayout, key: str, lo: int,
               hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the unit's flat ``key`` ("param" or a per-element optimizer state),
        in the unpadded coordinates every layout shares; past Ψ_u: padding (zeros)."""
        out = torch.zeros(hi - lo, dtype=torch.float32)
        s_old = layout.shard_numel
        end = min(hi, layout.numel)
        first, last = lo // s_old, -(-end // s_old)  # the old shards that overlap [lo, end)
        for j in range(first, last if end > lo else first):
            a, b = max(lo, j * s_old), min(end, (j + 1) * s_old)
            entry = self.file(j)["units"][unit_name]
            src = entry["param"] if key == "param" else entry["state"][key]
            out[a - lo:b - lo] = src[a - j * s_old:b - j * s_old]
        return out

    def scalars(self, unit_name: str) -> dict[str, Any]:
        state = self.file(0)["units"][unit_name]["state"]
        return {k: v for k, v in state.items()
                if not (isinstance(v, torch.Tensor) and v.dim() == 1)}

    def vector_keys(self, unit_name: str) -> list[str]:
        state = self.file(0)["units"][unit_name]["state"]
        return [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 1]


def _check_units(meta: dict[str, Any],
                 names: list[tuple[str, tuple[str, ...], tuple[tuple[int, ...], ...]]]) -> None:
    saved = [(u["name"], tuple(p["name"] for p in u["params"]),
              tuple(tuple(p["shape"]) for p in u["params"])) for u in meta["units"]]
    if saved != names:
        raise ValueError("the checkpoint's units do not match this model's: saved "
                         f"{[(n, len(ps)) for n, ps, _ in saved]}, "
                         f"here {[(n, len(ps)) for n, ps, _ in names]}")


def load_sharded(zdp: Sharded, optimizer: torch.optim.Optimizer, path: str | Path) -> int:
    """Load a ``save_sharded`` checkpoint into ``zdp`` at *any* data-parallel degree and stage.

    Each rank computes its new range [lo, hi) of each unit and copies it from the old shards that
    overlap it (old shard j holds [j S_old, (j+1) S_old)): a re-sharding by offsets, reading only
    the files it needs. Per-element optimizer states (Adam's m and v, SGD's momentum) follow the
    same rule; scalar ones (``step``) are copied. Returns the step the checkpoint was taken at."""
    _require_flat(zdp)
    path = Path(path)
    meta = _read_metadata(path)
    _check_units(meta, [(u.name, u.layout.names, u.layout.shapes) for u in zdp.units])
    reader = _ShardReader(path, meta)
    for u, saved in zip(zdp.units, meta["units"], strict=True):
        old = layout_from_json(saved)
        lo, hi = u.bounds()
        with torch.no_grad():
            u.shard.copy_(reader.gather(u.name, old, "param", lo, hi))
        state = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                 for k, v in reader.scalars(u.name).items()}
        for key in reader.vector_keys(u.name):
            state[key] = reader.gather(u.name, old, key, lo, hi)
        if state:
            optimizer.state[u.shard] = state
        u.refresh_full()  # stages 0-2: every rank's full parameters from the loaded shards
    return int(meta["step"])


def load_sharded_state_dict(path: str | Path
                            ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], int]:
    """A sharded checkpoint as one process sees it: (parameters by name, optimizer state by
    parameter name, step). No process group needed: this is how a checkpoint from N ranks becomes a
    plain single-process one."""
    path = Path(path)
    meta = _read_metadata(path)
    reader = _ShardReader(path, meta)
    params: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, Any]] = {}
    for saved in meta["units"]:
        layout = layout_from_json(saved)
        flat = reader.gather(saved["name"], layout, "param", 0, layout.numel)
        vectors = {k: reader.gather(saved["name"], layout, k, 0, layout.numel)
                   for k in reader.vector_keys(saved["name"])}
        scalars = reader.scalars(saved["name"])
        for i, name in enumerate(layout.names):
            o, n, s = layout.offsets[i], layout.numels[i], layout.shapes[i]
            params[name] = flat[o:o + n].view(s).clone()
            if vectors or scalars:
                states[name] = {**{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                   for k, v in scalars.items()},
                                **{k: v[o:o + n].view(s).clone() for k, v in vectors.items()}}
    return params, states, int(meta["step"])


def load_sharded_into_model(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                            path: str | Path) -> int:
    """Load a sharded checkpoint into a plain single-process model (and its per-parameter optimizer,
    built over ``model.parameters()``). Returns the step."""
    params, states, step = load_sharded_state_dict(path)
    named = dict(model.named_parameters())
    missing = sorted(set(named) - set(params))
    if missing:
        raise ValueError(f"the checkpoint has no values for {missing}")
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(params[name])
    if optimizer is not None:
        for name, p in named.items():
            if name in states:
                optimizer.state[p] = states[name]
    return step


# --------------------------------------------------------------------------------------------------
# Whole tensors, any mesh


class Composed(Protocol):
    """What a checkpoint needs of ``compose.Parallelized`` (a protocol: this module does not import
    compose): the model, its mesh, the parameters this rank trains (placed on its axes)."""

    module: nn.Module
    mesh: Any

    def parameters(self) -> Iterator[nn.Parameter]: ...

STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
"""The per-element optimizer states of AdamW and SGD (parameter-shaped); ``step`` is a scalar."""


def _gather(composed: Composed, p: nn.Parameter, t: torch.Tensor) -> torch.Tensor:
    return full_tensor(p, composed.mesh, t).cpu()


def _cut(composed: Composed, p: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    return shard_like(full, p, composed.mesh)


def _names(composed: Composed) -> dict[int, str]:
    """id(parameter) -> its single-process name: a module list split over an axis (experts) names
    its local entry i of rank r by the global index r n_local + i (``placement_ops.full_parameters``
    does the same)."""
    names = {id(p): n for n, p in composed.module.named_parameters()}
    for lname, experts, axis, _ in sharded_lists(composed.module):
        first = axis_group(composed.mesh, axis)
        offset = dist.get_rank(first) * len(experts)
        for i, e in enumerate(experts):
            for pname, p in e.named_parameters():
                names[id(p)] = f"{lname}.{offset + i}.{pname}"
    return names


def _writers(composed: Composed) -> dict[int, bool]:
    """id(parameter) -> whether this rank writes it: the first of its copies once gathered (tp = 0
    and the first replica: dp = cp = 0 for a dense parameter, edp = 0 for an expert)."""
    coords = composed.mesh.shape.coords(composed.mesh.rank)
    in_list = {id(p) for _, m, _, _ in sharded_lists(composed.module) for p in m.parameters()}
    dense = coords["dp"] == coords["cp"] == coords["tp"] == 0
    expert = coords["tp"] == coords["edp"] == 0
    return {id(p): (expert if id(p) in in_list else dense) for p in composed.module.parameters()}


def _steppers(optimizer: torch.optim.Optimizer
              ) -> dict[int, tuple[torch.optim.Optimizer, bool, bool]]:
    """id(parameter) -> (the optimizer that holds its state, whether this rank steps it, whether its
    state is partitioned over a group). ZeRO-1's ``ShardedOptimizer`` keeps the state in its local
    optimizer, on the group rank its partition gives the parameter; ``compose.Optimizers`` has one
    per data group: the dense parameters' over dp x cp and the experts' over edp (a plain optimizer
    when edp = 1)."""
    parts = getattr(optimizer, "parts", [optimizer])
    out: dict[int, tuple[torch.optim.Optimizer, bool, bool]] = {}
    for part in parts:
        if isinstance(part, ShardedOptimizer):
            out |= {id(p): (part.optimizer, r == part.rank, True)
                    for p, r in zip(part.params, part.owner, strict=True)}
        elif part is not None:
            out |= {id(p): (part, True, False) for g in part.param_groups for p in g["params"]}
    return out


def _inners(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers that hold state (``_steppers``), each once."""
    return list({id(o): o for o, _, _ in _steppers(optimizer).values()}.values())


def _flat_units(composed: Composed) -> list[Any]:
    """ZeRO-2's flat units (a 1-D shard over dp of a buffer of several parameters); not FSDP2's."""
    units = getattr(getattr(composed, "dp", None), "units", ())
    return [u for u in units if getattr(u, "flat", False)]


def _entries(composed: Composed, optimizer: torch.optim.Optimizer
             ) -> Iterator[tuple[nn.Parameter, torch.Tensor, dict[str, Any] | None]]:
    """(parameter, its value, its optimizer state or None where another rank steps it), each placed
    like the parameter (a collective: every rank walks them in the same order). ZeRO-2's flat shards
    are gathered over dp first and cut into their parameters (``layout.views``): each piece is then
    placed like its parameter on the other axes (TP's slices); a scalar state (AdamW's step) is the
    unit's, shared by its parameters."""
    steppers, flat = _steppers(optimizer), _flat_units(composed)
    shards = {id(u.shard) for u in flat}
    for p in composed.parameters():
        if id(p) not in shards:
            stepper = steppers.get(id(p))  # none: a parameter no optimizer steps
            yield p, p, (stepper[0].state.get(p, {}) if stepper and stepper[1] else None)
    for u in flat:
        group = {u.axis: u.group}
        state = steppers[id(u.shard)][0].state.get(u.shard, {})
        vectors = {k: u.layout.views(full_tensor(u.shard, group, v))
                   for k, v in state.items() if k in STATE_KEYS}
        scalars = {k: v for k, v in state.items() if k not in STATE_KEYS}
        values = u.layout.views(full_tensor(u.shard, group))
        for i, p in enumerate(u.params):
            yield p, values[i], {**scalars, **{k: v[i] for k, v in vectors.items()}}


def _restore_flat(composed: Composed, inner: torch.optim.Optimizer, u: Any,
                  states: list[dict[str, torch.Tensor]]) -> None:
    """A ZeRO-2 unit's state from its parameters' whole ones: each cut like its parameter (TP), laid
    out in the unit's flat buffer (``layout.views``), this rank's [lo, hi) kept."""
    lo, hi = u.bounds()
    state = {k: v.clone() for k, v in states[0].items() if k not in STATE_KEYS}
    for key in [k for k in states[0] if k in STATE_KEYS]:
        buf = torch.zeros(u.layout.padded_numel, dtype=u.shard.dtype, device=u.shard.device)
        for view, p, s in zip(u.layout.views(buf), u.params, states, strict=True):
            view.copy_(_cut(composed, p, s[key]))
        state[key] = buf[lo:hi].clone()
    if state:
        inner.state[u.shard] = state


def _check_optimizer(composed: Composed, optimizer: torch.optim.Optimizer) -> None:
    known = (torch.optim.AdamW, torch.optim.SGD)
    unknown = sorted({type(o).__name__ for o in _inners(optimizer) if not isinstance(o, known)})
    if unknown:
        raise ValueError(f"rank {composed.mesh.rank}: save_whole takes AdamW or SGD (directly or "
                         f"in ZeRO-1's ShardedOptimizer, or one per data group), got "
                         f"{', '.join(unknown)} in {type(optimizer).__name__}: its state keys are "
                         "not known")


def save_whole(composed: Composed, optimizer: torch.optim.Optimizer, step: int,
               path: str | Path) -> None:
    """Write the whole parameters and optimizer state of the run after ``step`` steps to folder
    ``path`` (every rank calls it: the gathers are collectives). Each rank writes what it is the
    first copy of (``_writers``; ZeRO-1's state: its owner): every name once."""
    _check_optimizer(composed, optimizer)
    path = Path(path)
    names, writes = _names(composed), _writers(composed)
    # ZeRO-1's states, written by their owners
    partitioned = {k for k, (_, _, part) in _steppers(optimizer).items() if part}
    coords = composed.mesh.shape.coords(composed.mesh.rank)
    if dist.get_rank() == 0 and path.is_dir():  # a previous save's files (other mesh, writers)
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
        first = coords["dp"] == coords["cp"] == coords["tp"] == 0  # the stage's dense writer
        stage = f"stage{coords['pp']}"
        name = f"{stage}.pt" if first else f"{stage}-rank{composed.mesh.rank}.pt"
        torch.save({"params": params, "optimizer": states}, path / name)
    if dist.get_rank() == 0:
        shape = composed.mesh.shape
        meta = {"step": step, "order": shape.order,
                "mesh": {a: getattr(shape, a) for a in ("dp", "cp", "tp", "pp", "ep")}}
        (path / "meta.json").write_text(json.dumps(meta))
    dist.barrier()


def load_whole(path: str | Path
               ) -> tuple[int, dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(steps done, whole parameters by name, optimizer state by parameter name) from folder
    ``path``: the union of its rank files."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    params: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    files = sorted(path.glob("stage*.pt"))
    if not files:
        raise ValueError(f"{path}: no stage*.pt files next to meta.json: not a finished "
                         "checkpoint")
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
        more = " ..." if len(missing) > 4 else ""
        others = f" and unknown {unknown[:4]}" if unknown else ""
        raise ValueError(f"rank {rank}: the checkpoint has no {missing[:4]}{more}{others}: it was "
                         "written for another model (or by an unfinished save): resume with the "
                         "GPTConfig that saved it, or save again")
    with torch.no_grad():
        for name, t in params.items():
            own[name].copy_(t)


def restore_optimizer(composed: Composed, optimizer: torch.optim.Optimizer,
                      states: dict[str, dict[str, torch.Tensor]]) -> None:
    """Give each parameter this rank steps its optimizer state, cut for the new mesh like the
    parameter (``shard_like``: TP's slices, FSDP2's dim-0 shards; experts by global index; ZeRO-1:
    only its owner; ZeRO-2: laid out in the flat shard, ``_restore_flat``)."""
    names, steppers = _names(composed), _steppers(optimizer)
    flat = _flat_units(composed)
    shards = {id(u.shard) for u in flat}
    stepped = [p for p in composed.parameters() if id(p) in steppers and id(p) not in shards]
    missing = sorted(names[id(p)] for p in [*stepped, *(p for u in flat for p in u.params)]
                     if names[id(p)] not in states)
    if missing:  # checked for every parameter of the partitions, owned or not: peers raise alike
        more = " ..." if len(missing) > 4 else ""
        raise ValueError(f"rank {composed.mesh.rank}: the checkpoint has no optimizer state for "
                         f"{missing[:4]}{more}: it was written by an unfinished save or for "
                         "another model; save it again")
    for p in stepped:
        inner, owns, _ = steppers[id(p)]
        if owns:
            inner.state[p] = {k: (_cut(composed, p, v) if k in STATE_KEYS else v.clone())
                              for k, v in states[names[id(p)]].items()}
    for u in flat:
        _restore_flat(composed, steppers[id(u.shard)][0], u,
                      [states[names[id(p)]] for p in u.params])
