"""Our ZeRO-3, in its flat form (``course_lib.parallel.zero``) and in FSDP2's per-parameter form
(``course_lib.parallel.fsdp2``), against PyTorch's FSDP2 (``fully_shard``): peak memory per rank and step time,
measured side by side in one run, as ratios (ours / PyTorch's). With ``--tp 2``: FSDP + TP ("2D", torchtitan's
default) on a dp x tp mesh -- our ``apply_tp`` then ``FSDP2DataParallel`` over the dp group, which shards
every TP-local tensor again on dim 0 -- against PyTorch's own 2D: ``parallelize_module`` (DTensor, the course's
plan in DTensor's styles) on the tp sub-mesh, then ``fully_shard`` on the dp sub-mesh, with ``loss_parallel``.

The engines live in the same ranks and train the same GPT (same seed, same per-rank batch: the dp slice), with
units per block plus the root, ``reshard_after_forward`` at FSDP2's default (every unit but the root), fp32, AdamW.

* **Memory**: ``torch.distributed._tools.mem_tracker.MemTracker`` on each, over one full training step (forward,
  backward, optimizer step) after a warm-up step, so Adam's states exist. It tracks every storage allocated
  inside the step and the parameters, gradients and optimizer states passed to it, including the storage
  resizes the engines use to free and re-fill unsharded parameters. Its categories differ between them
  (our flat shards are not module parameters: ``Other``; FSDP2's unsharded parameters count as ``Parameter``),
  so the comparison is on the peak **total**, and on the peak total less activations and temporaries (the
  model states at the peak moment). Goal: ours / PyTorch's <= 1.02, and step time <= 1.2 for 2D.
* **Time**: the median over ``--repeats`` steps of each engine, interleaved (one step of each in turn) so that the
  machine's load drifts over all alike. CPU gloo on a laptop is not a GPU: this says whether our Python hooks
  cost more than PyTorch's, not what either does on NCCL.

Run: ``python benchmarks/zero_bench.py [--world-size 2 --d-model 128 --n-layer 4 --repeats 7]``;
2D: ``python benchmarks/zero_bench.py --world-size 4 --tp 2``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
import warnings
from typing import Any

import torch

from course_lib.data import global_batch, shard
from course_lib.model import GPT, lm_loss, num_params
from course_lib.model_config import GPTConfig
from course_lib.parallel import zero
from course_lib.parallel.fsdp2 import FSDP2DataParallel
from course_lib.runtime.launch import launch
from course_lib.runtime.mesh import Mesh
from course_lib.train import TrainConfig, make_optimizer

MEMORY_GOAL, TIME_GOAL_2D = 1.02, 1.2
OURS = {"zero3": "ours, flat", "per_param": "ours, per-parameter"}
OURS_2D = {"fsdp_tp": "ours, FSDP2 form x TP"}
CATS = ("Parameter", "Gradient", "Optstate", "Other", "Activation", "Temp")


def _engine(kind: str, cfg: GPTConfig, tc: TrainConfig, mesh: Mesh) -> dict[str, Any]:
    """One engine: the model, what to call, its optimizer, its loss (and the context it runs in), and the tensors
    MemTracker should watch besides the model's parameters."""
    from torch.distributed.fsdp import fully_shard

    model = GPT(cfg, seed=tc.seed)
    e: dict[str, Any] = {"model": model, "call": model, "loss": lm_loss, "ctx": contextlib.nullcontext,
                         "after": lambda: None, "extra": []}
    if kind == "zero3":
        zdp = zero.ZeroDataParallel(model, 3)
        e.update(call=zdp, after=zdp.after_step, extra=list(zdp.parameters()))  # the flat shards: not the module's
    elif kind in ("per_param", "fsdp_tp"):  # the module's parameters are the shards; the gathered weights tracked
        if kind == "fsdp_tp":
            from course_lib.parallel.tp import apply_tp
            from course_lib.parallel.tp_layers import vocab_parallel_cross_entropy

            apply_tp(model, mesh.group("tp"))
            e["loss"] = functools.partial(vocab_parallel_cross_entropy, group=mesh.group("tp"))
        zdp = FSDP2DataParallel(model, group=mesh.group("dp"))
        e.update(call=zdp, extra=[p for u in zdp.units for p in u.params])
    else:  # PyTorch's: fully_shard on every block, then the root; 2D: DTensor TP on the tp sub-mesh first
        dp_mesh = mesh.device_mesh("dp")
        if kind == "torch_2d":
            from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

            from course_lib.parallel.oracles import dtensor_plan

            parallelize_module(model, mesh.device_mesh("tp"), dtensor_plan(cfg))
            e["ctx"] = loss_parallel
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    e["opt"] = make_optimizer(e["extra"] if kind == "zero3" else list(model.parameters()), tc)
    return e


def _step(e: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> float:
    with e["ctx"]():
        loss = e["loss"](e["call"](x), y)
        loss.backward()
    e["opt"].step()
    e["after"]()
    e["opt"].zero_grad(set_to_none=True)
    return loss.item()


def _peak(e: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
    from torch.distributed._tools.mem_tracker import MemTracker

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MemTracker warns about parameters whose .grad is None
        mt = MemTracker()
        mt.track_external(e["model"], e["opt"], *e["extra"])
        with mt:
            _step(e, x, y)
        (snap,) = mt.get_tracker_snapshot("peak").values()
    out = {str(k.value if hasattr(k, "value") else k): int(v) for k, v in snap.items()}
    return {**{c: out.get(c, 0) for c in CATS}, "Total": out["Total"]}


def _rank(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig, repeats: int, tp: int) -> dict[str, Any]:
    mesh = Mesh(dp=world_size // tp, tp=tp)
    kinds = (*OURS_2D, "torch_2d") if tp > 1 else (*OURS, "fsdp2")
    engines = {k: _engine(k, cfg, tc, mesh) for k in kinds}
    x, y = global_batch(0, tc.global_batch, cfg.seq_len, tc.seed)
    x, y = (shard(t, mesh.coord("dp"), mesh.size("dp")).clone() for t in (x, y))
    losses = {k: [_step(e, x, y)] for k, e in engines.items()}  # warm-up: Adam's states exist afterwards
    peaks = {k: _peak(e, x, y) for k, e in engines.items()}
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(repeats):
        for k, e in engines.items():
            start = time.perf_counter()
            losses[k].append(_step(e, x, y))
            times[k].append(time.perf_counter() - start)
    return {"peaks": peaks, "times": times, "losses": losses}


def _states(p: dict[str, int]) -> int:
    """The model states at the peak moment: the peak total less activations and temporaries."""
    return p["Total"] - p["Activation"] - p["Temp"]


def main(world_size: int = 2, d_model: int = 128, n_layer: int = 4, seq_len: int = 64, batch: int = 8,
         repeats: int = 7, tp: int = 1) -> dict[str, float]:
    if world_size % tp:
        raise ValueError(f"--tp {tp} must divide --world-size {world_size}")
    cfg = GPTConfig(bias=False, d_model=d_model, n_head=4, n_layer=n_layer, seq_len=seq_len)
    tc = TrainConfig(global_batch=batch)
    psi = num_params(GPT(cfg))
    res = launch(_rank, world_size, cfg, tc, repeats, tp, timeout=900)
    ours, ref = (OURS_2D, "torch_2d") if tp > 1 else (OURS, "fsdp2")
    kinds = (*ours, ref)
    what = f"FSDP + TP on dp {world_size // tp} x tp {tp}" if tp > 1 else "ZeRO-3"
    print(f"{what}: ours ({'; '.join(ours.values())}) vs PyTorch's ({ref}), {world_size} ranks (gloo, CPU), "
          f"GPT d={d_model} L={n_layer} s={seq_len}, {psi:,} parameters (fp32 states {16 * psi / 1e6:.2f} MB), "
          f"global batch {batch}")
    print("peak memory per rank during one training step (torch MemTracker), bytes:")
    print(f"  {'rank':>4} {'engine':>9} | " + " | ".join(f"{c:>10}" for c in (*CATS, "Total")) + " | states")
    for r, got in enumerate(res):
        for k in kinds:
            p = got["peaks"][k]
            print(f"  {r:>4} {k:>9} | " + " | ".join(f"{p[c]:10,}" for c in (*CATS, "Total")) + f" | {_states(p):,}")
    med = {k: statistics.median(t for r in res for t in r["times"][k]) for k in kinds}
    print(f"step time, median of {repeats} interleaved steps x {world_size} ranks: "
          + ", ".join(f"{k} {med[k] * 1e3:.1f} ms" for k in kinds))
    out: dict[str, float] = {}
    for k, label in ours.items():
        total = max(got["peaks"][k]["Total"] / got["peaks"][ref]["Total"] for got in res)
        states = max(_states(got["peaks"][k]) / _states(got["peaks"][ref]) for got in res)
        speed = med[k] / med[ref]
        diffs = [[abs(a - b) for a, b in zip(got["losses"][k], got["losses"][ref], strict=True)] for got in res]
        verdict = "PASS" if total <= MEMORY_GOAL else "FAIL"
        timing = f"step time {speed:.2f}"
        if tp > 1:
            timing += f" (goal <= {TIME_GOAL_2D}: {'PASS' if speed <= TIME_GOAL_2D else 'FAIL'})"
        print(f"{label} / {ref} (worst rank): peak memory {total:.4f} (goal <= {MEMORY_GOAL}: {verdict}); "
              f"model states at the peak {states:.4f}; {timing}; |loss diff| first step "
              f"{max(d[0] for d in diffs):.1e}, max over {repeats + 2} steps {max(max(d) for d in diffs):.1e} "
              "(one batch repeated: AdamW amplifies the float noise of a different reduction order)")
        out.update({f"{k}_memory": total, f"{k}_states": states, f"{k}_time": speed})
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: > 1 compares FSDP + TP (2D)")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    a = parser.parse_args()
    main(a.world_size, a.d_model, a.n_layer, a.seq_len, a.batch, a.repeats, a.tp)
