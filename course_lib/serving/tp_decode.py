"""Tensor-parallel decode vs independent replicas, on real ranks.

**TP** (Megatron-LM, Shoeybi et al. 2019, applied to inference as in Pope et al. 2022): each of the t ranks of
the group keeps ``n_head / t`` query heads, their K/V heads (and so ``1/t`` of the KV cache) and ``1/t`` of the
MLP's hidden units. Per layer and step:

* q, k, v projections: the rows of the rank's heads (column parallel, no communication);
* o projection: the columns of the rank's heads (row parallel) -> partial sums -> **all-reduce** (1 of 2);
* MLP: fc1 (and gate) rows, fc2 columns -> **all-reduce** (2 of 2).

So a step costs two all-reduces of ``N x h`` activations per layer (N tokens in the step), 2(t-1)/t x N h x
bytes per rank on a ring, in exchange for 1/t of the weight and KV bytes each rank must stream.

**GQA with t > n_kv_heads**: the KV heads cannot be split further; each KV head is **replicated** on the
t / n_kv ranks whose query heads use it (query head j uses KV head j // (n_head / n_kv)). The KV cache then
shrinks only to one head per rank: ``ceil(n_kv / t)`` heads, as ``memory.kv_cache_bytes`` counts.

**Replicas**: d ranks each with the full model serve 1/d of the requests, with no communication at all.

The layers are chapter 04's (``course_lib.parallel.tp_layers``): ``ColumnParallelLinear`` / ``RowParallelLinear`` /
``TensorParallelMLP`` built from the full ``nn.Linear`` layers of ``course_lib.model.GPT``; the K/V projections keep
exactly the heads this rank reads (:meth:`TPDecodeEngine.kv_heads`), so the rank's cache holds only those.
Embeddings, norms and the LM head stay replicated.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comm
from course_lib.model import GPT, Block
from course_lib.model_config import GPTConfig
from course_lib.parallel.tp_layers import ColumnParallelLinear, RowParallelLinear, TensorParallelMLP
from course_lib.runtime.mesh import Mesh
from course_lib.serving.engine import Engine, Segment, generate, sample
from course_lib.serving.kv_cache import ContiguousKVCache, KVCache


def q_heads_of(rank: int, t: int, n_head: int) -> list[int]:
    """Query heads of ``rank``: a contiguous ``n_head / t``."""
    per = n_head // t
    return list(range(rank * per, (rank + 1) * per))


def kv_heads_of(rank: int, t: int, n_head: int, n_kv: int) -> list[int]:
    """KV heads ``rank`` must hold: those its query heads use. t <= n_kv: a contiguous ``n_kv / t``;
    t > n_kv: the single head shared by its query heads, replicated on t / n_kv ranks."""
    group = n_head // n_kv  # query heads per KV head
    return sorted({j // group for j in q_heads_of(rank, t, n_head)})


def check_tp(config: GPTConfig, t: int) -> None:
    """Raise ``ValueError`` naming what to change if ``config`` cannot be split over ``t`` ranks."""
    problems = []
    if config.n_head % t:
        problems.append(f"n_head={config.n_head} is not divisible by t={t}")
    if config.kv_heads % t and t % config.kv_heads:
        problems.append(f"n_kv_head={config.kv_heads} and t={t}: one must divide the other")
    if config.ffn_dim % t:
        problems.append(f"d_ff={config.ffn_dim} is not divisible by t={t}")
    if problems:
        raise ValueError("cannot shard for tensor-parallel decode: " + "; ".join(problems))


def _kv_rows(linear: nn.Linear, heads: Sequence[int], d: int, group: dist.ProcessGroup | None) -> ColumnParallelLinear:
    """A column-parallel projection that keeps the output rows of ``heads`` (``d`` rows each): the K/V heads this
    rank's query heads read, which are replicated on several ranks when t > n_kv."""
    idx = torch.tensor([h * d + i for h in heads for i in range(d)], device=linear.weight.device)
    bias = linear.bias.detach()[idx].clone() if linear.bias is not None else None
    return ColumnParallelLinear(linear.weight.detach()[idx].clone(), bias, group, enter_region=False)


class TPDecodeEngine(Engine):
    """:class:`Engine` with attention split by heads and the MLP by hidden units over a tensor-parallel group.

    ``group`` (a ProcessGroup, default the world) or ``mesh`` (its ``"tp"`` group). The cache must hold the
    rank's ``len(self.kv_heads())`` KV heads (:func:`make_tp_cache`). Seam: :meth:`kv_heads`.
    """

    def __init__(self, model: GPT, cache: KVCache, *, group: dist.ProcessGroup | None = None,
                 mesh: Mesh | None = None) -> None:
        super().__init__(model, cache)
        self.group = mesh.group("tp") if mesh is not None else group
        self.t, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        c = self.config
        check_tp(c, self.t)
        kv = self.kv_heads()
        if cache.n_kv_heads != len(kv):
            raise ValueError(f"the cache holds {cache.n_kv_heads} KV heads, this rank computes {len(kv)}")
        self.shards = []
        for blk in model.blocks:
            a = blk.attn
            self.shards.append({
                "q": ColumnParallelLinear.from_linear(a.q_proj, self.group, enter_region=False),
                "k": _kv_rows(a.k_proj, kv, c.head_dim, self.group),
                "v": _kv_rows(a.v_proj, kv, c.head_dim, self.group),
                "o": RowParallelLinear.from_linear(a.o_proj, self.group),
                "mlp": TensorParallelMLP(blk.mlp, self.group),
            })
        self._index = {id(b): i for i, b in enumerate(model.blocks)}

    def kv_heads(self) -> list[int]:
        """The KV heads this rank computes and caches (replicated when t > n_kv)."""
        return kv_heads_of(self.rank, self.t, self.config.n_head, self.config.kv_heads)

    def qkv(self, block: Block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, N, d = self.shards[self._index[id(block)]], x.shape[0], self.head_dim
        return tuple(s[k](x).view(N, -1, d).transpose(0, 1) for k in ("q", "k", "v"))

    def attn_out(self, block: Block, y: torch.Tensor) -> torch.Tensor:
        return self.shards[self._index[id(block)]]["o"](y)  # row parallel: partial sums, all-reduce, + bias

    def mlp(self, block: Block, x: torch.Tensor) -> torch.Tensor:
        return self.shards[self._index[id(block)]]["mlp"](x)  # column -> row, one all-reduce


def make_tp_cache(config: GPTConfig, t: int, max_seqs: int, max_len: int, **kw) -> ContiguousKVCache:
    """A contiguous cache for one rank of a t-way TP group: ceil(n_kv / t) KV heads."""
    return ContiguousKVCache(config, max_seqs, max_len, n_kv_heads=-(-config.kv_heads // t), **kw)


def _model(config: GPTConfig, seed: int, group: dist.ProcessGroup | None) -> GPT:
    """The same full model on every rank of the group: built from ``seed``, then broadcast from its first rank."""
    model = GPT(config, seed=seed).eval()
    src = dist.get_process_group_ranks(group)[0] if group is not None else 0
    with torch.no_grad():
        for p in model.parameters():
            comm.broadcast(p.data, src=src, group=group)
    return model


def tp_generate(rank: int, world_size: int, config: GPTConfig, prompts: Sequence[torch.Tensor],
                max_new_tokens: int, *, seed: int = 0, group: dist.ProcessGroup | None = None,
                mesh: Mesh | None = None, engine_cls: type[TPDecodeEngine] = TPDecodeEngine) -> dict:
    """Launch target: greedy generation with TP decode over the group. Returns the tokens, the cache's measured
    bytes on this rank, and ``step_comm`` (the comm records of each engine step: 2 all-reduces per layer)."""
    group = mesh.group("tp") if mesh is not None else group
    torch.set_num_threads(1)
    model = _model(config, seed, group)
    t = dist.get_world_size(group)
    cache = make_tp_cache(config, t, len(prompts), max(p.numel() for p in prompts) + max_new_tokens)
    step_comm: list[list[comm.CommRecord]] = []

    class Recorded(engine_cls):
        def forward(self, segments: Sequence[Segment]) -> torch.Tensor:
            with comm.recording() as log:
                out = super().forward(segments)
            step_comm.append(list(log.records))
            return out

    tokens = generate(model, prompts, max_new_tokens, engine=Recorded(model, cache, group=group))
    return {"tokens": tokens, "cache_bytes": cache.allocated_bytes(), "step_comm": step_comm}


def decode_step_times(rank: int, world_size: int, config: GPTConfig, batches: Sequence[int], *, context: int = 16,
                      steps: int = 10, mode: str = "tp", seed: int = 0) -> dict:
    """Launch target: median wall-clock seconds of one decode step at each batch size, ``mode="tp"`` (one step
    shared by the ranks, two all-reduces per layer) or ``"replicas"`` (each rank steps its own batch alone).
    Also the median seconds spent inside the all-reduces of a TP step."""
    torch.set_num_threads(1)
    model = _model(config, seed, None)
    t = world_size if mode == "tp" else 1
    out: dict[str, list[float]] = {"step_s": [], "allreduce_s": []}
    for b in batches:
        cache = make_tp_cache(config, t, b, context + steps + 1)
        engine = TPDecodeEngine(model, cache) if mode == "tp" else Engine(model, cache)
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, config.vocab_size, (context,), generator=g) for _ in range(b)]
        for i in range(b):
            cache.reserve(i, context + steps + 1)
        nxt = sample(engine.forward([Segment(i, p, 0) for i, p in enumerate(prompts)]))
        times, comm_s = [], []
        for s in range(steps):
            if mode == "tp":
                dist.barrier()
            with comm.recording() as log:
                t0 = time.perf_counter()
                nxt = sample(engine.forward([Segment(i, nxt[i:i + 1], context + s) for i in range(b)]))
                times.append(time.perf_counter() - t0)
            comm_s.append(log.seconds("all_reduce"))
        out["step_s"].append(sorted(times)[steps // 2])
        out["allreduce_s"].append(sorted(comm_s)[steps // 2])
    return out
