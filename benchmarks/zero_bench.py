"""Our ZeRO-3, in its flat form (``course_lib.parallel.zero``) and in FSDP2's per-parameter form
(``course_lib.parallel.fsdp2``), against PyTorch's FSDP2 (``fully_shard``): peak memory per rank and step time,
measured side by side in one run, as ratios (ours / FSDP2).

The three engines live in the same ranks and train the same GPT (same seed, same per-rank batch), with units
per block plus the root, ``reshard_after_forward`` at FSDP2's default (every unit but the root), fp32, AdamW.

* **Memory**: ``torch.distributed._tools.mem_tracker.MemTracker`` on both, over one full training step (forward,
  backward, optimizer step) after a warm-up step, so Adam's states exist. It tracks every storage allocated
  inside the step and the parameters, gradients and optimizer states passed to it, including the storage
  resizes the engines use to free and re-fill unsharded parameters. Its categories differ between them
  (our flat shards are not module parameters: ``Other``; FSDP2's unsharded parameters count as ``Parameter``),
  so the comparison is on the peak **total**, and on the peak total less activations and temporaries (the
  model states at the peak moment). Goal: ours / FSDP2 <= 1.02 for both forms.
* **Time**: the median over ``--repeats`` steps of each engine, interleaved (flat, per-parameter, FSDP2, ...) so the
  machine's load drifts over both alike. CPU gloo on a laptop is not a GPU: this says whether our Python hooks
  cost more than FSDP2's, not what either does on NCCL.

Run: ``python benchmarks/zero_bench.py [--world-size 2 --d-model 128 --n-layer 4 --repeats 7]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import torch

from course_lib.data import global_batch, shard
from course_lib.launch import launch
from course_lib.model import GPT, GPTConfig, lm_loss, num_params
from course_lib.parallel import zero
from course_lib.parallel.fsdp2 import FSDP2DataParallel
from course_lib.train import TrainConfig, make_optimizer

MEMORY_GOAL = 1.02
OURS = {"zero3": "ours, flat", "per_param": "ours, per-parameter"}
CATS = ("Parameter", "Gradient", "Optstate", "Other", "Activation", "Temp")


def _engine(kind: str, cfg: GPTConfig, tc: TrainConfig, world_size: int) -> dict[str, Any]:
    model = GPT(cfg, seed=tc.seed)
    if kind == "zero3":
        zdp = zero.ZeroDataParallel(model, 3)
        opt = make_optimizer(zdp.parameters(), tc)
        return {"model": model, "call": zdp, "opt": opt, "after": zdp.after_step, "extra": list(zdp.parameters())}
    if kind == "per_param":  # the module's parameters are the shards; the gathered weights are tracked too
        zdp = FSDP2DataParallel(model)
        opt = make_optimizer(list(model.parameters()), tc)
        return {"model": model, "call": zdp, "opt": opt, "after": zdp.after_step,
                "extra": [p for u in zdp.units for p in u.params]}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_optimizer(list(model.parameters()), tc)
    return {"model": model, "call": model, "opt": opt, "after": lambda: None, "extra": []}


def _step(e: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> float:
    loss = lm_loss(e["call"](x), y)
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


def _rank(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig, repeats: int) -> dict[str, Any]:
    engines = {k: _engine(k, cfg, tc, world_size) for k in (*OURS, "fsdp2")}
    x, y = global_batch(0, tc.global_batch, cfg.seq_len, tc.seed)
    x, y = shard(x, rank, world_size).clone(), shard(y, rank, world_size).clone()
    losses = {k: [_step(e, x, y)] for k, e in engines.items()}  # warm-up: Adam's states exist afterwards
    peaks = {k: _peak(e, x, y) for k, e in engines.items()}
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(repeats):
        for k, e in engines.items():
            start = time.perf_counter()
            losses[k].append(_step(e, x, y))
            times[k].append(time.perf_counter() - start)
    return {"peaks": peaks, "times": times, "losses": losses}


def main(world_size: int = 2, d_model: int = 128, n_layer: int = 4, seq_len: int = 64, batch: int = 8,
         repeats: int = 7) -> dict[str, float]:
    cfg = GPTConfig(bias=False, d_model=d_model, n_head=4, n_layer=n_layer, seq_len=seq_len)
    tc = TrainConfig(global_batch=batch)
    psi = num_params(GPT(cfg))
    res = launch(_rank, world_size, cfg, tc, repeats, timeout=900)
    print(f"ZeRO-3: ours (flat; per-parameter) vs FSDP2 fully_shard, {world_size} ranks (gloo, CPU), "
          f"GPT d={d_model} L={n_layer} s={seq_len}, {psi:,} parameters (fp32 states {16 * psi / 1e6:.2f} MB), "
          f"global batch {batch}")
    print("peak memory per rank during one training step (torch MemTracker), bytes:")
    print(f"  {'rank':>4} {'engine':>9} | " + " | ".join(f"{c:>10}" for c in (*CATS, "Total")) + " | states")
    out: dict[str, float] = {}
    med = {k: statistics.median(t for r in res for t in r["times"][k]) for k in (*OURS, "fsdp2")}
    for r, got in enumerate(res):
        for k in (*OURS, "fsdp2"):
            p = got["peaks"][k]
            print(f"  {r:>4} {k:>9} | " + " | ".join(f"{p[c]:10,}" for c in (*CATS, "Total"))
                  + f" | {p['Total'] - p['Activation'] - p['Temp']:,}")
    print(f"step time, median of {repeats} interleaved steps x {world_size} ranks: "
          + ", ".join(f"{k} {med[k] * 1e3:.1f} ms" for k in (*OURS, "fsdp2")))
    for k, label in OURS.items():
        total = max(got["peaks"][k]["Total"] / got["peaks"]["fsdp2"]["Total"] for got in res)
        states = max(_states(got["peaks"][k]) / _states(got["peaks"]["fsdp2"]) for got in res)
        loss_diff = max(abs(a - b) for got in res for a, b in zip(got["losses"][k], got["losses"]["fsdp2"],
                                                                  strict=True))
        verdict = "PASS" if total <= MEMORY_GOAL else "FAIL"
        print(f"{label} / FSDP2 (worst rank): peak memory {total:.4f} (goal <= {MEMORY_GOAL}: {verdict}); "
              f"model states at the peak {states:.4f}; step time {med[k] / med['fsdp2']:.2f}; "
              f"max |loss diff| over {repeats + 2} steps {loss_diff:.1e}")
        out.update({f"{k}_memory": total, f"{k}_states": states, f"{k}_time": med[k] / med["fsdp2"]})
    return out


def _states(p: dict[str, int]) -> int:
    """The model states at the peak moment: the peak total less activations and temporaries."""
    return p["Total"] - p["Activation"] - p["Temp"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    a = parser.parse_args()
    main(a.world_size, a.d_model, a.n_layer, a.seq_len, a.batch, a.repeats)
