"""What a checkpoint costs: the course's mesh checkpoint and PyTorch's Distributed Checkpoint (DCP) side by side on
one model and mesh -- bytes each rank writes, time to save and load, synchronous vs asynchronous.

Bytes: an fp32 AdamW run's checkpoint holds the weights and both moments, 3 x 4 = 12 bytes a parameter, B = 12 P
(plus a few bytes of step counts and metadata). Who writes them differs:

* the course's whole-tensor checkpoint (``parallel.checkpoint.save_whole``) gathers whole tensors and one rank
  per pipeline stage writes them: on a data-parallel mesh rank 0 writes all B, the others 0;
* DCP (``torch.distributed.checkpoint.save``) plans the save collectively: every rank writes its own shards, and
  a tensor replicated on several ranks is written once, by the rank with the least planned so far -- on a
  replicated model each rank writes about B / N (whole tensors, so not exactly), and the save takes ~1/N the
  time of one writer where the storage is not the bottleneck.

``dcp.async_save`` returns once the state is staged (copied to host memory) and writes in a background thread:
training blocks only for the copy. Resharding: DCP's files record each shard's place in the global tensor, so a
load into a model placed differently (another mesh) reads what it needs (``load`` at another mesh in
``save_whole`` does the same by gathering whole tensors first).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from course_lib.data import global_batch, shard
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig
from course_lib.parallel.checkpoint import load_whole as load_checkpoint
from course_lib.parallel.checkpoint import save_whole as save_checkpoint
from course_lib.parallel.compose import parallelize
from course_lib.runtime.mesh import Mesh

BYTES_PER_PARAMETER = 12
"""fp32 weights + AdamW's m and v."""


def checkpoint_bytes(params: int) -> int:
    """B = 12 P: the bytes of an fp32 AdamW checkpoint's tensors."""
    return BYTES_PER_PARAMETER * params


@dataclass(frozen=True)
class CheckpointCost:
    """One rank's bytes written and seconds to save / load, for the course's checkpoint and for DCP
    (sync; async: the time training blocks, then until the write is done)."""

    ours_bytes: int
    dcp_bytes: int
    ours_save_s: float
    ours_load_s: float
    dcp_save_s: float
    dcp_load_s: float
    dcp_async_block_s: float
    dcp_async_total_s: float
    same_tensors: bool


def _written(folder: Path, names: list[str]) -> int:
    return sum((folder / n).stat().st_size for n in names if (folder / n).exists())


def measure_checkpoint_cost(rank: int, world_size: int, folder: str, cfg: GPTConfig) -> CheckpointCost:
    """On a data-parallel mesh of ``world_size``: one AdamW step, then save and load with both, timed on each rank
    (barriers around each, so a time is the slowest rank's); the bytes are this rank's files."""
    root = Path(folder)
    model = GPT(cfg)
    composed = parallelize(model, Mesh(dp=world_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = global_batch(0, 2 * world_size, cfg.seq_len)
    composed.forward_backward(shard(x, rank, world_size), shard(y, rank, world_size), lm_loss)
    composed.finish_gradient_sync()
    optimizer.step()

    def timed(fn: object) -> float:
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t

    ours_save = timed(lambda: save_checkpoint(composed, optimizer, 1, root / "ours"))
    loaded: dict = {}
    ours_load = timed(lambda: loaded.update(params=load_checkpoint(root / "ours")[1]))
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp_save = timed(lambda: dcp.save(state, checkpoint_id=str(root / "dcp")))
    fresh = {"model": GPT(cfg).state_dict()}
    dcp_load = timed(lambda: dcp.load(fresh, checkpoint_id=str(root / "dcp")))
    dist.barrier()
    t = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=str(root / "dcp_async"))
    block = time.perf_counter() - t
    future.result()
    total = time.perf_counter() - t
    same = all(torch.equal(fresh["model"][n], loaded["params"][n]) for n in loaded["params"])
    mine = [f"stage{k}.pt" for k in range(1)] if rank == 0 else []
    return CheckpointCost(_written(root / "ours", mine), _written(root / "dcp", [f"__{rank}_0.distcp"]),
                          ours_save, ours_load, dcp_save, dcp_load, block, total, same)


def reshard_with_dcp(rank: int, world_size: int, folder: str, cfg: GPTConfig) -> bool:
    """Save at one placement, load at another, with DCP: the model sharded by PyTorch's FSDP2 (``fully_shard``,
    each rank a dim-0 shard of every parameter: DTensors) after one AdamW step, saved with ``dcp.save``; loaded
    into an unsharded model on every rank (``dcp.load`` reads the pieces of each whole tensor from the shards that
    hold them). True when every loaded tensor equals the sharded model's gathered one, on this rank."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=init_device_mesh("cpu", (world_size,)))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = global_batch(0, 2 * world_size, cfg.seq_len)
    lm_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size)).backward()
    optimizer.step()
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=folder)
    whole = {"model": GPT(cfg, seed=1).state_dict()}  # other weights: the load must overwrite every one
    dcp.load(whole, checkpoint_id=folder)
    gathered = {n: p.full_tensor() for n, p in model.named_parameters()}
    return all(torch.equal(whole["model"][n], t) for n, t in gathered.items())
