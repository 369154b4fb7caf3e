"""Wrong answers for chapter 08 (composing the axes)."""

import itertools
import math

import torch.distributed as dist

from course_lib.model_config import param_count
from course_lib.parallel.schedules import Action, Kind


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


def coords_counts_ep(rank, degrees, order):
    """Reads ep as one more digit of the rank (the specification says to skip it: it does not multiply the world
    size)."""
    coords = {}
    for axis in order.split("-"):
        rank, coords[axis] = divmod(rank, degrees.get(axis, 1))
    coords.pop("ep")
    return coords


def _coords(rank, degrees, order):
    coords = {}
    for axis in order.split("-"):
        if axis != "ep":
            rank, coords[axis] = divmod(rank, degrees.get(axis, 1))
    return coords


def coords_degrees_listed_only(rank, degrees, order):
    """Gives coordinates only for the axes named in ``degrees``: an axis left out (degree 1) is missing."""
    coords = {}
    for axis in order.split("-"):
        if axis != "ep" and axis in degrees:
            rank, coords[axis] = divmod(rank, degrees[axis])
    return coords


def coords_rank_not_shifted(rank, degrees, order):
    """Takes rank % degree for every axis without dividing the rank by the faster axes' sizes."""
    return {axis: rank % degrees.get(axis, 1) for axis in order.split("-") if axis != "ep"}


def _rank_of(coords, degrees, order):
    rank, stride = 0, 1
    for axis in order.split("-"):
        if axis != "ep":
            rank, stride = rank + coords[axis] * stride, stride * degrees.get(axis, 1)
    return rank


def group_in_axes_order(rank, axes, degrees, order):
    """Lists the group by counting over ``axes`` with the first named axis fastest: the right ranks, unsorted."""
    mine = _coords(rank, degrees, order)
    out = []
    for values in itertools.product(*(range(degrees.get(a, 1)) for a in reversed(axes))):
        out.append(_rank_of(mine | dict(zip(reversed(axes), values, strict=True)), degrees, order))
    return out


def group_without_self(rank, axes, degrees, order):
    """Returns the rank's peers: the group without the rank itself."""
    world = math.prod(degrees.get(a, 1) for a in ("tp", "cp", "dp", "pp"))
    mine = _coords(rank, degrees, order)
    fixed = [a for a in mine if a not in axes]
    return [r for r in range(world) if r != rank and all(_coords(r, degrees, order)[a] == mine[a] for a in fixed)]


def group_counts_ep(rank, axes, degrees, order):
    """Reads ep as a digit of the rank and counts it in the world size: ranks beyond the dense mesh appear."""
    world = math.prod(degrees.get(a, 1) for a in ("tp", "cp", "dp", "pp", "ep"))

    def coords(r):
        out = {}
        for axis in order.split("-"):
            r, out[axis] = divmod(r, degrees.get(axis, 1))
        return out
    mine = coords(rank)
    return [r for r in range(world) if all(coords(r)[a] == mine[a] for a in mine if a not in axes)]


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


def problems_batch_over_dp_cp(cfg, degrees, global_batch, micro_batch):
    """Divides the batch by dp x cp x micro-batch: cp ranks share each sequence, not the batch."""
    tp, cp, dp, _pp, rules = _rules(cfg, degrees, global_batch, micro_batch)
    rules["kv_heads"] = cfg.kv_heads % tp != 0 and tp % cfg.kv_heads != 0
    rules["sequence"] = cp > 1 and cfg.seq_len % (2 * cp) != 0
    rules["batch"] = global_batch % (dp * cp * micro_batch) != 0
    return {k for k, v in rules.items() if v}


def problems_kv_one_sided(cfg, degrees, global_batch, micro_batch):
    """Requires tp to be a multiple of the K/V heads (forgets the split case, n_kv a multiple of tp)."""
    tp, cp, _dp, _pp, rules = _rules(cfg, degrees, global_batch, micro_batch)
    rules["kv_heads"] = tp % cfg.kv_heads != 0
    rules["sequence"] = cp > 1 and cfg.seq_len % (2 * cp) != 0
    return {k for k, v in rules.items() if v}


def problems_layers_backwards(cfg, degrees, global_batch, micro_batch):
    """Reads the layer rule backwards: n_layer must divide pp, instead of pp dividing n_layer."""
    tp, cp, _dp, pp, rules = _rules(cfg, degrees, global_batch, micro_batch)
    rules["kv_heads"] = cfg.kv_heads % tp != 0 and tp % cfg.kv_heads != 0
    rules["sequence"] = cp > 1 and cfg.seq_len % (2 * cp) != 0
    rules["layers"] = pp % cfg.n_layer != 0
    return {k for k, v in rules.items() if v}


_HARD_CODED = {}


def average_over_hard_coded_groups(params, mesh):
    """Hard-codes the replicas as ranks {0, 2} and {1, 3}: right when tp varies fastest, not for another order."""
    if not _HARD_CODED:
        _HARD_CODED.update({0: dist.new_group([0, 2]), 1: dist.new_group([1, 3])})
    group = _HARD_CODED[dist.get_rank() % 2]
    for p in params:
        dist.all_reduce(p.grad, group=group)
        p.grad /= 2


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


def average_dividing_by_world(params, mesh):
    """Sums over the right (dp) group but divides by the world size, 4, instead of dp = 2."""
    for p in params:
        dist.all_reduce(p.grad, group=mesh.group("dp"))
        p.grad /= dist.get_world_size()


def average_reduced_to_one_rank(params, mesh):
    """dist.reduce to the group's first rank instead of all_reduce: only that rank holds the average."""
    group = mesh.group("dp")
    first = dist.get_process_group_ranks(group)[0]
    for p in params:
        dist.reduce(p.grad, dst=first, group=group)
        p.grad /= mesh.size("dp")


def _predict(cfg, degrees, gpu, global_batch, seq_len, micro_batch, zero_stage, efficiency, *, split_over=None,
             shard_over=None, bytes_per_param=(2, 2, 12), zero3_shards_weights=True, bubble=None, m_of=None):
    """The spec's formulas with one thing changed (each wrong answer below names which)."""
    tp, cp, dp, pp = (degrees.get(a, 1) for a in ("tp", "cp", "dp", "pp"))
    n = param_count(cfg)
    per_gpu = n / (split_over(tp, pp) if split_over else tp * pp)
    n_d = shard_over(dp, cp) if shard_over else dp * cp
    w, g, o = bytes_per_param
    weights = w * per_gpu / (n_d if zero_stage >= 3 and zero3_shards_weights else 1)
    grads = g * per_gpu / (n_d if zero_stage >= 2 else 1)
    optimizer = o * per_gpu / (n_d if zero_stage >= 1 else 1)
    m = m_of(global_batch, dp, micro_batch) if m_of else global_batch // (dp * micro_batch)
    ideal = 6 * n * global_batch * seq_len / (tp * cp * dp * pp * gpu.peak_flops * efficiency)
    factor = bubble(pp, m) if bubble else (m + pp - 1) / m
    return {"model_state_bytes": weights + grads + optimizer, "step_s": ideal * factor}


def predict_ignores_pp_in_memory(*args):
    """Splits the parameters over tp only: each pipeline stage would hold the whole model."""
    return _predict(*args, split_over=lambda tp, pp: tp)


def predict_without_bubble(*args):
    """The ideal time: the 1F1B bubble (p-1)/(m+p-1) of the step left out."""
    return _predict(*args, bubble=lambda pp, m: 1.0)


def predict_bubble_fraction_as_ratio(*args):
    """Adds the idle fraction (p-1)/(m+p-1) to the ideal time, as if it were bubble / ideal ((p-1)/m)."""
    return _predict(*args, bubble=lambda pp, m: 1 + (pp - 1) / (m + pp - 1))


def predict_microbatches_ignore_dp(*args):
    """m = global batch / micro-batch: every pipeline would run the whole global batch, a bubble too small."""
    return _predict(*args, m_of=lambda gb, dp, mb: gb // mb)


def predict_zero_over_dp_only(*args):
    """Shards ZeRO over dp, not dp x cp (context-parallel ranks hold the same weights)."""
    return _predict(*args, shard_over=lambda dp, cp: dp)


def predict_zero3_like_zero2(*args):
    """ZeRO-3 that never shards the weights (ZeRO-2's memory)."""
    return _predict(*args, zero3_shards_weights=False)


def predict_ignores_zero_stage(*args):
    """Plain data parallelism's 16 bytes per parameter whatever the ZeRO stage."""
    cfg, degrees, gpu, gb, s, mb, _zero, eff = args
    return _predict(cfg, degrees, gpu, gb, s, mb, 0, eff)


def predict_fp32_gradients(*args):
    """fp32 gradients (18 bytes per parameter): not the spec's bf16 ones."""
    return _predict(*args, bytes_per_param=(2, 4, 12))


def _insert_after(schedule, place):
    """Each rank's list with Action(REDUCE_GRAD, j, s) after the positions ``place(actions)`` returns
    ({position: stage})."""
    out = []
    for actions in schedule:
        after = place(actions)
        new = []
        for i, a in enumerate(actions):
            new.append(a)
            if i in after:
                new.append(Action(Kind.REDUCE_GRAD, a.microbatch, after[i]))
        out.append(new)
    return out


def reduce_after_last_i(schedule):
    """The zero-bubble bug: after each stage's last B or I, before the W passes still pending."""
    def place(actions):
        last = {a.stage: i for i, a in enumerate(actions) if a.kind in (Kind.B, Kind.I)}
        return {i: s for s, i in last.items()}
    return _insert_after(schedule, place)


def reduce_once_per_rank(schedule):
    """One REDUCE_GRAD per rank, after its last weight-gradient action: interleaved ranks hold several stages."""
    def place(actions):
        writes = [i for i, a in enumerate(actions) if a.kind in (Kind.B, Kind.W)]
        return {writes[-1]: actions[writes[-1]].stage}
    return _insert_after(schedule, place)


def reduce_after_every_weight_pass(schedule):
    """A REDUCE_GRAD after every B / W: m reductions of partial sums per stage instead of one."""
    return _insert_after(schedule, lambda actions: {i: a.stage for i, a in enumerate(actions)
                                                    if a.kind in (Kind.B, Kind.W)})


def reduce_at_the_end(schedule):
    """Each stage's REDUCE_GRAD appended at the end of the rank's list: right, but it overlaps nothing, and on an
    interleaved rank it waits for the other stage's drain."""
    out = []
    for actions in schedule:
        last = {a.stage: a.microbatch for a in actions if a.kind in (Kind.B, Kind.W)}
        out.append(list(actions) + [Action(Kind.REDUCE_GRAD, j, s) for s, j in sorted(last.items())])
    return out


def reduce_as_tuples(schedule):
    """Inserts ("REDUCE_GRAD", j, s) tuples: the executor only runs schedules.Action."""
    out = []
    for actions in schedule:
        last = {a.stage: i for i, a in enumerate(actions) if a.kind in (Kind.B, Kind.W)}
        new = []
        for i, a in enumerate(actions):
            new.append(a)
            if i in last.values():
                new.append(("REDUCE_GRAD", a.microbatch, a.stage))
        out.append(new)
    return out


def _reduce_after_last_weight_pass(schedule):
    """The right places: after each stage's last B, or its last W where the stage's backward is split."""
    def place(actions):
        split = {a.stage for a in actions if a.kind is Kind.W}
        last = {a.stage: i for i, a in enumerate(actions) if a.kind is (Kind.W if a.stage in split else Kind.B)}
        return {i: s for s, i in last.items()}
    return _insert_after(schedule, place)


def reduce_kind_as_a_string(schedule):
    """Action("REDUCE_GRAD", j, s): equal to the Kind as a string, but the executor tests ``kind is Kind.X``."""
    return [[Action("REDUCE_GRAD", a.microbatch, a.stage) if a.kind is Kind.REDUCE_GRAD else a for a in actions]
            for actions in _reduce_after_last_weight_pass(schedule)]


def reduce_in_place(schedule):
    """The right places, but written into the input lists: the caller's schedule changes under it."""
    for actions, new in zip(schedule, _reduce_after_last_weight_pass(schedule), strict=True):
        actions[:] = new
    return schedule


def _place(name, shape, n_layer, parallel, *, sp_partial=True, data_group=None, stage_rule="runs", ceil=True,
           zero3_grad="reduce_scatter_mean"):
    """A right ``place_parameter`` with one of the knobs turned to a plausible mistake."""
    module = name.split(".")[-2]
    local, placements = list(shape), {}
    if parallel.shape.tp > 1:
        dim = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "fc1": 0, "tok_emb": 0, "lm_head": 0, "o_proj": 1, "fc2": 1}
        if module in dim:
            placements["tp"] = f"S({dim[module]})"
            local[dim[module]] //= parallel.shape.tp
        elif parallel.sequence_parallel and sp_partial:
            placements["tp"] = "P"
    group = data_group or ("dp+cp" if parallel.shape.cp > 1 else "dp")
    ranks = parallel.shape.dp if data_group == "dp" else parallel.shape.dp * parallel.shape.cp
    if parallel.zero_stage == 3 and ranks > 1:
        placements[group] = "S(0)"
        local[0] = math.ceil(local[0] / ranks) if ceil else local[0] // ranks
    if name.startswith("blocks."):
        block = int(name.split(".")[1])
        stage = block % parallel.shape.pp if stage_rule == "modulo" else block // (n_layer // parallel.shape.pp)
    else:
        stage = 0 if module in ("tok_emb", "pos_emb") else parallel.shape.pp - 1
    grad = [("all_reduce_sum", axis) for axis, where in placements.items() if where == "P"]
    if parallel.shape.dp * parallel.shape.cp > 1:
        grad.append((zero3_grad if group in placements else "all_reduce_mean", group))
    return {"placements": placements, "stage": stage, "local_shape": tuple(local), "grad": grad}


def place_sp_norms_replicated(name, shape, n_layer, parallel):
    """Under SP the norms are still R on tp: their gradients are never summed over the TP ranks' tokens."""
    return _place(name, shape, n_layer, parallel, sp_partial=False)


def place_zero3_over_dp_only(name, shape, n_layer, parallel):
    """ZeRO-3 over the dp group alone, even with cp > 1 (the cp ranks hold the same weights: they shard too)."""
    return _place(name, shape, n_layer, parallel, data_group="dp")


def place_stages_round_robin(name, shape, n_layer, parallel):
    """Block i on stage i mod pp, as if every stage were interleaved."""
    return _place(name, shape, n_layer, parallel, stage_rule="modulo")


def place_shard_rows_rounded_down(name, shape, n_layer, parallel):
    """A dim-0 shard of n rows over N ranks is n // N rows: the padded vocabulary row is lost."""
    return _place(name, shape, n_layer, parallel, ceil=False)


def place_zero3_gradient_all_reduced(name, shape, n_layer, parallel):
    """A ZeRO-3 shard's gradient all-reduced (each rank would then hold the whole gradient of a shard it lacks)."""
    return _place(name, shape, n_layer, parallel, zero3_grad="all_reduce_mean")

WRONG = {
    "coords_of": [coords_slowest_first, coords_default_order, coords_counts_ep, coords_degrees_listed_only,
                  coords_rank_not_shifted],
    "group_of": [group_fixes_the_wrong_axes, group_by_stride, group_in_axes_order, group_without_self,
                 group_counts_ep],
    "mesh_problems": [problems_kv_never_replicated, problems_sequence_by_cp, problems_batch_without_micro_batch,
                      problems_batch_over_dp_cp, problems_kv_one_sided, problems_layers_backwards],
    "predict_mesh": [predict_ignores_pp_in_memory, predict_without_bubble, predict_bubble_fraction_as_ratio,
                     predict_microbatches_ignore_dp, predict_zero_over_dp_only, predict_zero3_like_zero2,
                     predict_ignores_zero_stage, predict_fp32_gradients],
    "average_dp_gradients": [average_over_tp, average_over_world, sum_without_dividing,
                             average_over_hard_coded_groups, average_dividing_by_world, average_reduced_to_one_rank],
    "add_grad_reduce": [reduce_after_last_i, reduce_once_per_rank, reduce_after_every_weight_pass,
                        reduce_at_the_end, reduce_as_tuples, reduce_kind_as_a_string, reduce_in_place],
    "place_parameter": [place_sp_norms_replicated, place_zero3_over_dp_only, place_stages_round_robin,
                        place_shard_rows_rounded_down, place_zero3_gradient_all_reduced],
}
