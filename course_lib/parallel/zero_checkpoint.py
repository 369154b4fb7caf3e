"""Sharded checkpoints of ``course_lib.parallel.zero``: every rank writes only what it owns; a checkpoint loads at
any data-parallel degree and stage (re-sharding by offsets), or into one plain process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from course_lib import comm
from course_lib.parallel.zero_unit import FlatLayout, ShardedModel

CHECKPOINT_FORMAT = "course_lib.zero/v1"


def _require_flat(zdp: ShardedModel) -> None:
    if not all(u.flat for u in zdp.units):
        raise ValueError("sharded checkpoints store flat-parameter units; per-parameter (FSDP2-style) units are not "
                         "supported: save zdp.full_state_dict() instead")

# ----------------------------------------------------------------------------------------------------------------
# Sharded checkpoints


def _shard_file(path: Path, shard_rank: int, num_shards: int) -> Path:
    return path / f"shard_{shard_rank:05d}_of_{num_shards:05d}.pt"


def save_checkpoint(zdp: ShardedModel, optimizer: torch.optim.Optimizer, path: str | Path, step: int) -> None:
    """Each rank writes only what it owns: its shard of every unit and the optimizer state of that shard.

    Layout of ``path``: ``metadata.json`` (rank 0: format, step, world size, stage, and per unit the parameter
    names, shapes and offsets in the flat buffer, its sizes and padding) and ``shard_<r>_of_<N>.pt`` per
    rank (stage 0: one file, every rank holds the same). A collective: every rank must call it; it returns once
    every file is on disk (a barrier)."""
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
        meta = {"format": CHECKPOINT_FORMAT, "step": step, "world_size": zdp.world_size, "num_shards": num_shards,
                "stage": zdp.stage, "optimizer": type(optimizer).__name__,
                "units": [{"name": u.name, **u.layout.to_json()} for u in zdp.units]}
        (path / "metadata.json").write_text(json.dumps(meta, indent=1))
    comm.barrier(zdp.group)


def _read_metadata(path: Path) -> dict[str, Any]:
    meta = json.loads((path / "metadata.json").read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a {CHECKPOINT_FORMAT} checkpoint (format {meta.get('format')!r})")
    return meta


class _ShardReader:
    """Reads the old ranks' files lazily (memory-mapped) and assembles any element range of a unit."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path, self.meta = path, meta
        self._files: dict[int, dict[str, Any]] = {}

    def file(self, j: int) -> dict[str, Any]:
        if j not in self._files:
            self._files[j] = torch.load(_shard_file(self.path, j, self.meta["num_shards"]), mmap=True,
                                        weights_only=True)
        return self._files[j]

    def gather(self, unit_name: str, layout: FlatLayout, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the unit's flat ``key`` ("param" or a per-element optimizer state), in the
        unpadded coordinates shared by every layout; elements past Ψ_u are padding (zeros)."""
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
        return {k: v for k, v in state.items() if not (isinstance(v, torch.Tensor) and v.dim() == 1)}

    def vector_keys(self, unit_name: str) -> list[str]:
        state = self.file(0)["units"][unit_name]["state"]
        return [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 1]


def _check_units(meta: dict[str, Any], names: list[tuple[str, tuple[str, ...], tuple[tuple[int, ...], ...]]]) -> None:
    saved = [(u["name"], tuple(p["name"] for p in u["params"]), tuple(tuple(p["shape"]) for p in u["params"]))
             for u in meta["units"]]
    if saved != names:
        raise ValueError("the checkpoint's units do not match this model's: saved "
                         f"{[(n, len(ps)) for n, ps, _ in saved]}, here {[(n, len(ps)) for n, ps, _ in names]}")


def load_checkpoint(zdp: ShardedModel, optimizer: torch.optim.Optimizer, path: str | Path) -> int:
    """Load a checkpoint saved by ``save_checkpoint`` at *any* data-parallel degree and stage into ``zdp``.

    Each rank computes its new range [lo, hi) of each unit and copies it from the old shards that overlap it
    (old shard j holds [j S_old, (j+1) S_old)): a re-sharding by offsets, reading only the files it needs.
    Per-element optimizer states (Adam's m and v, SGD's momentum) follow the same rule; scalar ones (``step``)
    are copied. Returns the step the checkpoint was taken at."""
    _require_flat(zdp)
    path = Path(path)
    meta = _read_metadata(path)
    _check_units(meta, [(u.name, u.layout.names, u.layout.shapes) for u in zdp.units])
    reader = _ShardReader(path, meta)
    for u, saved in zip(zdp.units, meta["units"], strict=True):
        old = FlatLayout.from_json(saved)
        lo, hi = u.bounds()
        with torch.no_grad():
            u.shard.copy_(reader.gather(u.name, old, "param", lo, hi))
        state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in reader.scalars(u.name).items()}
        for key in reader.vector_keys(u.name):
            state[key] = reader.gather(u.name, old, key, lo, hi)
        if state:
            optimizer.state[u.shard] = state
        u.refresh_full()  # stages 0-2: every rank's full parameters from the loaded shards
    return int(meta["step"])


def load_full_state_dict(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], int]:
    """A sharded checkpoint as one process sees it: (parameters by name, optimizer state by parameter name,
    step). No process group needed: this is how a checkpoint from N ranks becomes a plain single-process one."""
    path = Path(path)
    meta = _read_metadata(path)
    reader = _ShardReader(path, meta)
    params: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, Any]] = {}
    for saved in meta["units"]:
        layout = FlatLayout.from_json(saved)
        flat = reader.gather(saved["name"], layout, "param", 0, layout.numel)
        vectors = {k: reader.gather(saved["name"], layout, k, 0, layout.numel)
                   for k in reader.vector_keys(saved["name"])}
        scalars = reader.scalars(saved["name"])
        for i, name in enumerate(layout.names):
            o, n, s = layout.offsets[i], layout.numels[i], layout.shapes[i]
            params[name] = flat[o:o + n].view(s).clone()
            if vectors or scalars:
                states[name] = {**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()},
                                **{k: v[o:o + n].view(s).clone() for k, v in vectors.items()}}
    return params, states, int(meta["step"])


def load_into_model(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | Path) -> int:
    """Load a sharded checkpoint into a plain single-process model (and its per-parameter optimizer, built over
    ``model.parameters()``). Returns the step."""
    params, states, step = load_full_state_dict(path)
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
