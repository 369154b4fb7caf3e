"""Wrong answers for chapter 08 (composing the axes)."""

import math

import torch.distributed as dist


def coords_slowest_first(rank, degrees, order):
    """Reads the order backwards: the last axis fastest."""
    coords = {}
    for axis in reversed(order.split("-")):
        if axis != "ep":
            rank, coords[axis] = divmod(rank, degrees.get(axis, 1))
    return coords


def coords_default_order(rank, degrees, order):
    """Ignores the order argument: always tp-cp-dp-pp."""
    coords = {}
    for axis in ("tp", "cp", "dp", "pp"):
        rank, coords[axis] = divmod(rank, degrees.get(axis, 1))
    return coords


def _coords(rank, degrees, order):
    coords = {}
    for axis in order.split("-"):
        if axis != "ep":
            rank, coords[axis] = divmod(rank, degrees.get(axis, 1))
    return coords


def group_fixes_the_wrong_axes(rank, axes, degrees, order):
    """Keeps the ranks that share the coordinates on ``axes`` (the complement of the group)."""
    world = math.prod(degrees.get(a, 1) for a in ("tp", "cp", "dp", "pp"))
    mine = _coords(rank, degrees, order)
    return [r for r in range(world) if all(_coords(r, degrees, order)[a] == mine[a] for a in axes)]


def group_by_stride(rank, axes, degrees, order):
    """Assumes a group is a run of consecutive ranks (true only for the fastest axis)."""
    size = math.prod(degrees.get(a, 1) for a in axes)
    start = rank - rank % size
    return list(range(start, start + size))


def _rules(cfg, degrees, global_batch, micro_batch):
    tp, cp, dp, pp = (degrees.get(a, 1) for a in ("tp", "cp", "dp", "pp"))
    return tp, cp, dp, pp, {
        "heads": cfg.n_head % tp != 0, "ffn": cfg.ffn_dim % tp != 0, "vocab": cfg.vocab_size % tp != 0,
        "layers": cfg.n_layer % pp != 0, "batch": global_batch % (dp * micro_batch) != 0,
    }


def problems_kv_never_replicated(cfg, degrees, global_batch, micro_batch):
    """K/V heads must always split by tp (forgets the replication when n_kv divides tp)."""
    tp, cp, _dp, _pp, rules = _rules(cfg, degrees, global_batch, micro_batch)
    rules["kv_heads"] = cfg.kv_heads % tp != 0
    rules["sequence"] = cp > 1 and cfg.seq_len % (2 * cp) != 0
    return {k for k, v in rules.items() if v}


def problems_sequence_by_cp(cfg, degrees, global_batch, micro_batch):
    """Cuts the sequence into cp chunks, not 2 cp (no zig-zag)."""
    tp, cp, _dp, _pp, rules = _rules(cfg, degrees, global_batch, micro_batch)
    rules["kv_heads"] = cfg.kv_heads % tp != 0 and tp % cfg.kv_heads != 0
    rules["sequence"] = cfg.seq_len % cp != 0
    return {k for k, v in rules.items() if v}


def problems_batch_without_micro_batch(cfg, degrees, global_batch, micro_batch):
    """Checks the batch against dp only."""
    tp, cp, dp, _pp, rules = _rules(cfg, degrees, global_batch, micro_batch)
    rules["kv_heads"] = cfg.kv_heads % tp != 0 and tp % cfg.kv_heads != 0
    rules["sequence"] = cp > 1 and cfg.seq_len % (2 * cp) != 0
    rules["batch"] = global_batch % dp != 0
    return {k for k, v in rules.items() if v}


def average_over_tp(params, mesh):
    """The colleague's bug: the average over the tensor-parallel pair (different shards, same data)."""
    for p in params:
        dist.all_reduce(p.grad, group=mesh.group("tp"))
        p.grad /= mesh.size("tp")


def average_over_world(params, mesh):
    """Sums over all four ranks: TP partners add gradients of different shards' data copies."""
    for p in params:
        dist.all_reduce(p.grad)
        p.grad /= 4


def sum_without_dividing(params, mesh):
    """Sums the replicas' gradients without dividing by dp: gradients 2x too large."""
    for p in params:
        dist.all_reduce(p.grad, group=mesh.group("dp"))


WRONG = {
    "coords_of": [coords_slowest_first, coords_default_order],
    "group_of": [group_fixes_the_wrong_axes, group_by_stride],
    "mesh_problems": [problems_kv_never_replicated, problems_sequence_by_cp, problems_batch_without_micro_batch],
    "average_dp_gradients": [average_over_tp, average_over_world, sum_without_dividing],
}
