"""Answers that are the library's own implementation, called, wrapped or inherited: each must score 0 with a
reason that says "write it yourself" (``course_lib.grading.allowlist``). Keyed (chapter, exercise)."""

import course_lib.parallel.schedules
from course_lib.debug import desync as desync_lib
from course_lib.estimates.memory import kv_cache_bytes as library_kv
from course_lib.grading.ch11 import as_traces
from course_lib.moe import expert_positions
from course_lib.parallel import cp_attention as ca
from course_lib.parallel import cp_ulysses, tp_layers
from course_lib.parallel import dp as dp_lib
from course_lib.parallel import placement as placement_lib
from course_lib.parallel import schedules as S
from course_lib.parallel.schedules import one_f_one_b
from course_lib.parallel.tp_comm import sequence_parallel_linears
from course_lib.runtime.collectives import ring_reduce_scatter as library_rs
from course_lib.runtime.mesh import MeshShape
from course_lib.serving.paged import PagedKVCache


def zb_h1_by_full_path(p, m):
    """The issue's example: the library's ZB-H1 through its full dotted path."""
    return course_lib.parallel.schedules.zb_h1(p, m)


def _my_helper(p, m):
    return S.zb_h1(p, m)


def zb_h1_through_a_helper(p, m):
    """The library's schedule one helper away."""
    return _my_helper(p, m)


def one_f_one_b_imported(p, m, rank):
    """Exercise 1 with the library's one_f_one_b imported by name (a list comprehension around it)."""
    return [f"{a.kind.value}{a.microbatch}" for a in one_f_one_b(p, m)[rank] if a.is_compute]


def add_grad_reduce_wrapped(schedule):
    """The library's placement of REDUCE_GRAD, wrapped."""
    return S.add_grad_reduce(schedule)


class FixedKernelInherits(ca.BlockAttention):
    """The base class is already the fix: nothing of the learner's."""


class FixedKernelCallsSuper(ca.BlockAttention):
    """Overrides the block backward only to hand it to the library's through super()."""

    def backward(self, q, k, v, scale, mask, d_out, lse, delta):
        return super().backward(q, k, v, scale, mask, d_out, lse, delta)


def coords_of_from_mesh_shape(rank, degrees, order):
    """MeshShape's own rank -> coordinates."""
    shape = MeshShape(**{a: degrees.get(a, 1) for a in ("tp", "cp", "dp", "pp")}, order=order)
    return {a: c for a, c in shape.coords(rank).items() if a != "ep"}


def merge_partials_by_the_kernel(out1, lse1, out2, lse2):
    """BlockAttention's merge on an instance."""
    return ca.BlockAttention().merge(out1, lse1, out2, lse2)


def ring_reduce_scatter_renamed(tensor):
    """The library's ring reduce-scatter imported under another name."""
    return library_rs(tensor)


def kv_cache_bytes_from_memory(n_layer, n_kv_head, head_dim, tokens, batch, bytes_per_value):
    """memory.kv_cache_bytes (a different signature, but the answer all the same) behind a closure."""
    def inner():
        return library_kv
    return inner


def assign_buckets_from_dp(sizes, cap):
    """The DP wrapper's own bucket assignment, reached through the module."""
    return dp_lib.assign_buckets([__import__("torch").empty(s) for s in sizes], cap)


def ulysses_by_the_library(q, k, v):
    """The library's Ulysses attention, with the global positions it needs."""
    import torch
    return cp_ulysses.ulysses_attention(q, k, v, torch.arange(q.shape[1]))


def sp_region_by_the_librarys_linears(x, norm_w, w1, b1, w2, b2):
    """The library's sequence-parallel linears do the region's all-gather and its backward."""
    import torch.nn.functional as F
    (hidden,) = sequence_parallel_linears(F.rms_norm(x, (x.shape[-1],), norm_w), [(w1, b1)], None)
    return F.linear(F.gelu(hidden), w2) + b2


def bpr_by_the_chapters_queue(logits, k, capacity_factor):
    """The chapter's token-order queue, fed the priority order: the library writes the queue."""
    import math
    T, E = logits.shape
    chosen = logits.topk(k, dim=-1).indices
    order = logits.softmax(-1).amax(-1).sort(descending=True, stable=True).indices
    keep = chosen.new_empty(T, k, dtype=bool)
    keep[order] = (expert_positions(chosen[order].T.contiguous(), E) < math.ceil(capacity_factor * T * k / E)).T
    return chosen, keep


def paged_decode_by_the_caches_read(q, k_pool, v_pool, block_tables, seq_lens):
    """PagedKVCache.read on a stand-in cache: the library gathers each sequence's positions from its table."""
    import math
    import types

    import torch
    bs, rep = k_pool.shape[2], q.shape[1] // k_pool.shape[1]
    cache = types.SimpleNamespace(block_tables=dict(enumerate(block_tables.tolist())), k=k_pool[None],
                                  v=v_pool[None], n_kv_heads=k_pool.shape[1], head_dim=q.shape[2], device="cpu",
                                  blocks_for=lambda n: math.ceil(n / bs))
    out = []
    for b, n in enumerate(seq_lens.tolist()):
        k, v = (t.repeat_interleave(rep, 0) for t in PagedKVCache.read(cache, 0, b, n))
        w = torch.softmax(torch.einsum("hd,hnd->hn", q[b], k) / q.shape[2] ** 0.5, -1)
        out.append(torch.einsum("hn,hnd->hd", w, v))
    return torch.stack(out)
def embedding_by_the_librarys_layer(ids, weight):
    """The library's VocabParallelEmbedding around this rank's rows."""
    import torch
    layer = tp_layers.VocabParallelEmbedding(torch.nn.Embedding(weight.shape[0] * 2, weight.shape[1]))
    layer.weight = torch.nn.Parameter(weight)
    return layer(ids)


class AttentionInheritsTheLibrarys(tp_layers.TensorParallelAttention):
    """A class the exercise does not allow, subclassed: its forward is the library's."""
def place_parameter_from_the_records(name, shape, n_layer, parallel):
    """Reads the library's placement records of a model built on the mesh instead of deriving them."""
    from course_lib.model import GPT
    from course_lib.model_config import GPTConfig
    model = GPT(GPTConfig(n_layer=n_layer), seed=0)
    return {"placements": {a: str(w) for a, w in placement_lib.placements_of(model.get_parameter(name)).items()},
            "stage": 0, "local_shape": tuple(shape), "grad": []}


def first_desync_by_the_library(calls, finished):
    """The library's comparison, on the calls turned back into its traces."""
    d = desync_lib.first_desync(as_traces(calls, finished))
    return None if d is None else {"group": d.group, "ranks": list(d.ranks), "n": d.position,
                                   "culprits": list(d.culprits)}


def train_clipped_by_the_librarys_data_parallel(rank, world_size, steps=4, seed=0):
    """The library's data parallelism (and its runs) instead of the colleague's loop, fixed."""
    return dp_lib.DataParallel, steps, seed


CASES = {
    ("05", "zb_h1_schedule"): [zb_h1_by_full_path, zb_h1_through_a_helper],
    ("05", "one_f_one_b_order"): [one_f_one_b_imported],
    ("08", "add_grad_reduce"): [add_grad_reduce_wrapped],
    ("06", "fixed_kernel"): [FixedKernelInherits, FixedKernelCallsSuper],
    ("08", "coords_of"): [coords_of_from_mesh_shape],
    ("06", "merge_partials"): [merge_partials_by_the_kernel],
    ("01", "ring_reduce_scatter"): [ring_reduce_scatter_renamed],
    ("00", "kv_cache_bytes"): [kv_cache_bytes_from_memory],
    ("02", "assign_buckets"): [assign_buckets_from_dp],
    ("06", "ulysses_attention"): [ulysses_by_the_library],
    ("04", "sp_region"): [sp_region_by_the_librarys_linears],
    ("07", "batch_priority_routing"): [bpr_by_the_chapters_queue],
    ("09", "paged_decode"): [paged_decode_by_the_caches_read],
    ("04", "vocab_parallel_embedding"): [embedding_by_the_librarys_layer],
    ("04", "gqa_attention"): [AttentionInheritsTheLibrarys],
    ("08", "place_parameter"): [place_parameter_from_the_records],
    ("11", "first_desync"): [first_desync_by_the_library],
    ("11", "train_clipped"): [train_clipped_by_the_librarys_data_parallel],
}
