"""Expert parallelism (``course_lib.parallel.ep``) on ``--world-size`` ranks against the single-process MoE on one:
bytes per step against the formula, step time as a ratio, and the slowest rank's load against the mean under a
skewed router, with and without the load-balancing loss.

* **Bytes** (exact, our logged all-to-alls): per step, dispatch + combine forward + backward carry
  4 x L x (kept assignments) x h x 4 bytes over all ranks (4 x L x T*k*h*4 when nothing is dropped); the count
  exchange adds L all-gathers of W*E int64 and L all-to-alls of E int64. The script asserts equality.
* **Time**: the median step (forward, backward, gradient sync, optimizer) of the EP run on W ranks against
  ``train_baseline``'s step on one process, same global batch. On 2 shared CPU cores with tiny experts this
  measures our Python and gloo overhead, not what NCCL and a GPU would do.
* **Balance**: a router initialised to prefer expert 0, top-1, trained ``--steps`` steps with alpha = 0 and
  alpha = ``--alpha``: the busiest ep rank's rows over the mean (``slowest_rank_load``), first step and mean of
  the last 5. An all-to-all step waits for that rank.
* **Node-limited routing** (DeepSeek-V3): 8 fine-grained experts top-4 in 2 groups ("nodes" of ranks), free
  routing against each token limited to 1 group: the rows our dispatch sends to the other group (one per
  assignment: counted from our own splits; gloo moves them, so the bytes are *modelled*) and the distinct (token,
  other group) pairs, the rows a dispatcher that sends a token once per node would move across nodes (modelled).

Run: ``python benchmarks/ep_bench.py [--world-size 2 --steps 20 --alpha 0.05]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from course_lib.data import global_batch
from course_lib.estimates import accounting
from course_lib.model import GPT
from course_lib.model_config import GPTConfig
from course_lib.parallel import runs
from course_lib.runtime.launch import launch
from course_lib.train import TrainConfig, train_baseline


def skewed_router(cfg: GPTConfig, seed: int) -> GPT:
    """A GPT whose routers start out preferring expert 0 (its router row aligned with the mean hidden state)."""
    model = GPT(cfg, seed)
    h = model.embed(global_batch(10**6, 16, cfg.seq_len, seed)[0])
    with torch.no_grad():
        for block in model.blocks:
            u = block.norm2(h + block.attn(block.norm1(h))).reshape(-1, cfg.d_model).mean(0)
            block.mlp.router.weight[0] += 0.5 * u / u.norm()
            h = block(h)
    return model


def _timed_ep(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig) -> tuple[runs.ComposedResult, float]:
    torch.set_num_threads(1)
    start = time.perf_counter()
    result = runs.train_ep(rank, world_size, cfg, tc)
    return result, time.perf_counter() - start


def _balance(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig, alphas: list[float]) -> dict:
    torch.set_num_threads(1)
    return {a: runs.train_ep(rank, world_size, cfg.with_(aux_loss_coef=a), tc, model_fn=skewed_router) for a in alphas}


def _groups(rank: int, world_size: int, cfg: GPTConfig, tc: TrainConfig) -> dict:
    torch.set_num_threads(1)
    return {m: runs.train_ep(rank, world_size, cfg.with_(topk_group=m), tc) for m in (None, 1)}


def node_limited(world_size: int, steps: int = 3) -> None:
    """Free vs node-limited routing over 2 groups of experts: bytes to the other group per step (modelled)."""
    cfg = GPTConfig(bias=False, n_layer=2, d_model=64, n_head=4, seq_len=32, n_expert=8, top_k=4, expert_d_ff=128,
                    n_group=2)
    ranks = launch(_groups, world_size, cfg, TrainConfig(steps=steps, global_batch=8), timeout=300)
    row_bytes = 4 * cfg.d_model * 4  # dispatch + combine, forward + backward, fp32
    for m in (None, 1):
        rows = sum(s.cross_group_rows for r in ranks for step in r[m].routing for s in step) / steps
        pairs = sum(s.cross_group_pairs for r in ranks for step in r[m].routing for s in step) / steps
        span = statistics.fmean(s.groups_per_token for r in ranks for step in r[m].routing for s in step)
        print(f"{'free routing' if m is None else f'at most {m} group':>16}: {span:.2f} groups per token; to the other "
              f"group per step: {rows * row_bytes:,.0f} B as our per-assignment rows, {pairs * row_bytes:,.0f} B "
              f"sent once per (token, node) (both modelled)")


def main(world_size: int = 2, steps: int = 20, alpha: float = 0.05, repeats: int = 5) -> None:
    torch.set_num_threads(1)
    cfg = GPTConfig(bias=False, n_layer=2, d_model=64, n_head=4, seq_len=32, n_expert=4, top_k=2)
    tc = TrainConfig(steps=repeats, global_batch=8)
    T, L, h = tc.global_batch * cfg.seq_len, cfg.n_layer, cfg.d_model

    ranks = launch(_timed_ep, world_size, cfg, tc, timeout=300)
    for step in range(tc.steps):
        recs = [r for res, _ in ranks for r in res.step_comm[step]]
        rows = sum(r.tensor_bytes for r in recs if r.op == "all_to_all" and r.tensor_bytes != cfg.n_expert * 8)
        formula = 4 * L * accounting.dispatch_bytes(T, cfg.top_k, h)
        assert rows == formula, (step, rows, formula)
    print(f"bytes per step, {world_size} ranks, dropless: dispatch + combine fwd + bwd {rows:,} B == 4 x L x T*k*h*4 = "
          f"{formula:,} B (exact); count exchange {L} all_gather of {world_size * cfg.n_expert * 8} B + {L} "
          f"all_to_all of {cfg.n_expert * 8} B per rank")

    ep_step = max(seconds for _, seconds in ranks) / tc.steps
    one = []
    for _ in range(3):
        start = time.perf_counter()
        train_baseline(cfg, tc)
        one.append((time.perf_counter() - start) / tc.steps)
    base_step = statistics.median(one)
    print(f"step time (mean over {tc.steps} steps incl. start-up): EP on {world_size} ranks {ep_step * 1e3:.1f} ms, "
          f"one process {base_step * 1e3:.1f} ms -> ratio {ep_step / base_step:.2f} (CPU gloo, tiny experts)")

    bal = launch(_balance, world_size, cfg.with_(top_k=1), TrainConfig(steps=steps, global_batch=8, lr=3e-3),
                 [0.0, alpha], timeout=300)[0]
    for a, res in bal.items():
        ratios = []
        for step in res.routing:
            slow, mean = accounting.slowest_rank_load(step[0].kept_per_expert, world_size)
            ratios.append(slow / mean)
        print(f"alpha = {a:g}: slowest ep rank / mean, layer 0: first step {ratios[0]:.2f}x, last 5 steps "
              f"{statistics.fmean(ratios[-5:]):.2f}x")
    node_limited(world_size)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    main(args.world_size, args.steps, args.alpha, args.repeats)
