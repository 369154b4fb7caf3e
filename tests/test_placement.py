"""course_lib.parallel.placement: what every transform records, checked against DTensor, and the generic gather,
norm, partial-gradient reduction and checkpoint cut driven by those records, on every axis.

* TP and SP record, weight by weight, what DTensor's ``parallelize_module`` gives the same plan (``dtensor_plan``):
  the weight's placement (ours ``Partial()`` is a replicated weight), and every gradient DTensor leaves
  ``Partial(sum)`` after backward (the sequence-parallel norms) is ``Partial()`` in ours. DTensor sums one more
  inside backward (the row-parallel bias under SP: its gradient comes back ``Replicate()``), which ours sums
  with the norms in ``finish_gradient_sync``; and it returns the vocabulary embedding's gradient
  ``Replicate()`` for a ``Shard(0)`` weight, so gradients are compared where DTensor defers the sum, as ours.
* The generic functions equal what the per-wrapper code computed before them, bit for bit: the whole parameters
  at construction equal the single-process model's exactly (the transforms only slice them) on DP, ZeRO-1/2/3,
  TP, SP, CP, PP and EP; the gradient norm equals the former TP/EP formula (squares of the shards all-reduced,
  the replicated ones counted once); cutting a whole tensor again (the mesh checkpoint) gives this rank's
  piece exactly. The reduced gradients, gathered, equal one process's within 1e-5 relative (fp32 sums in
  another order), and the global norm -- of ZeRO's flat shards, of DP, CP, DP x TP, and of pipeline stages
  (summed over pp) -- equals ``torch.nn.utils.clip_grad_norm_``'s on one process within the same.
* Mutations: a row-parallel weight recorded ``Shard(0)`` (the wrong dim), a norm's ``Partial()`` forgotten under
  SP, an expert list recorded nowhere: each makes a check fail.

Two launches (2 ranks: every kind in turn; 4 ranks: TP 4 with SP and DP 2 x TP 2), results cached per module.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate as DReplicate

from course_lib.data import global_batch, shard
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig
from course_lib.moe import moe_aux_loss
from course_lib.parallel import dp_reduce, oracles, placement_ops, tp, tp_layers
from course_lib.parallel import placement as P
from course_lib.parallel.checkpoint import _cut, _gather
from course_lib.parallel.compose import parallelize
from course_lib.parallel.config import ParallelConfig
from course_lib.parallel.dp import DataParallel
from course_lib.parallel.ep import apply_ep
from course_lib.parallel.tp_comm import all_gather_along
from course_lib.parallel.zero import ZeroDataParallel
from course_lib.runtime.launch import launch
from course_lib.runtime.mesh import Mesh

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

CFG = GPTConfig(n_layer=2, d_model=32, n_head=4, seq_len=16, pos="rope")  # biases on: row biases partial under SP
MOE = GPTConfig(bias=False, n_layer=2, d_model=32, n_head=2, seq_len=16, n_expert=4, top_k=2)
BATCH = 4
REL = 1e-5  # fp32 sums of the same terms in another order (shards, ranks): ~1e-7 relative, with margin
TIMEOUT = 300


# ----------------------------------------------------------------------------------------------------------------
# Mutations


class RowRecordedOnDim0(tp_layers.RowParallelLinear):
    """Slices the input features (dim 1) but records the weight as ``Shard(0)``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.weight = nn.Parameter(self.weight.data)  # a fresh parameter: its record is made anew
        P.set_placement(self.weight, "tp", P.Shard(0))


class MLPWithWrongRowRecord(tp_layers.TensorParallelMLP):
    def __init__(self, mlp, group=None, sequence_parallel=False) -> None:
        super().__init__(mlp, group, sequence_parallel)
        bias = self.fc2.bias.data if self.fc2.bias is not None else None
        self.fc2 = RowRecordedOnDim0(self.fc2.weight.data, bias, group, sequence_parallel=sequence_parallel)


def _wrong_row_record(m: nn.Module, group, sp: bool) -> nn.Module:
    return MLPWithWrongRowRecord(m, group, sp)


def _norm_unrecorded(m: nn.Module, group, sp: bool) -> None:
    """Under SP, leaves the norm unrecorded (so ``Replicate()``): its partial gradient is never summed."""
    return None


TP_PLANS = {  # name -> plan entries over gpt_plan's: the correct plan and two mutations
    "tp": {},
    "wrong_dim": {"blocks.*.mlp": _wrong_row_record},
    "forgets_partial": {"blocks.*.norm1": _norm_unrecorded, "blocks.*.norm2": _norm_unrecorded,
                        "norm_f": _norm_unrecorded},
}
TP_GROUPS = {"tp": None}  # every rank is the TP group (the default group)


def _tp_model(sp: bool, variant: str) -> GPT:
    """The GPT with TP (``variant``'s plan) over every rank applied in place."""
    model = GPT(CFG, 0)
    tp.apply_tp(model, None, tp.gpt_plan(CFG) | TP_PLANS[variant], sequence_parallel=sp)
    return model


def _tp_backward(model: GPT, x: torch.Tensor, y: torch.Tensor) -> None:
    """One backward of the vocab-parallel loss, then the partial gradients summed over tp as their records say
    (what the data-parallel step does after its own reduction)."""
    tp_layers.vocab_parallel_cross_entropy(model(x), y).backward()
    dp_reduce.sum_partials(model.parameters(), TP_GROUPS)


# ----------------------------------------------------------------------------------------------------------------
# What runs on the ranks


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k].float()) for k in a)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and float((a - b).abs().max()) <= REL * max(float(b.abs().max()), 1e-6)


def _reference(cfg: GPTConfig, rows: tuple[int, int] | None = None) -> tuple[dict, dict, float]:
    """One process: the initial parameters, the gradients of one step's loss (on the whole batch, or the mean
    over ``rows`` = (rank, world) shards, the data-parallel loss), and their global norm."""
    model = GPT(cfg, 0)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = global_batch(0, BATCH, cfg.seq_len, 0)
    loss = lm_loss(model(x), y) + (moe_aux_loss(model) if cfg.n_expert else 0)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return init, grads, float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))


def _dtensor_rows(ws: int, sp: bool, variant: str) -> list[tuple[str, str, str, str, str]]:
    """(name, ours, ours as DTensor's weight placement, DTensor's weight, DTensor's grad) for every parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    x, y = global_batch(0, BATCH, CFG.seq_len, 0)
    theirs = GPT(CFG, 0)
    parallelize_module(theirs, init_device_mesh("cpu", (ws,)), oracles.dtensor_plan(CFG, sp))
    with loss_parallel():
        lm_loss(theirs(x), y).backward()
    ours = _tp_model(sp, variant)
    tp_layers.vocab_parallel_cross_entropy(ours(x), y).backward()

    def as_dtensor(where: P.Placement) -> str:
        return str(DShard(where.dim) if isinstance(where, P.Shard) else DReplicate())

    def of(t: torch.Tensor) -> str:
        return str(t.placements[0]) if isinstance(t, DTensor) else str(DReplicate())

    own = dict(ours.named_parameters())
    return [(n, str(P.placement(own[n], "tp")), as_dtensor(P.placement(own[n], "tp")), of(p), of(p.grad))
            for n, p in theirs.named_parameters()]


def _tp_checks(ws: int, sp: bool, variant: str = "tp") -> dict:
    init, grads, ref_norm = _reference(CFG)
    model = _tp_model(sp, variant)
    groups = TP_GROUPS
    out = {"gather": _equal(placement_ops.full_parameters(model, groups), init)}
    x, y = global_batch(0, BATCH, CFG.seq_len, 0)
    _tp_backward(model, x, y)
    params = dict(model.named_parameters())
    out["grads"] = all(_close(placement_ops.full_tensor(p, groups, p.grad), grads[n]) for n, p in params.items())
    # the former TensorParallel.grad_norm: the shards' squares all-reduced, the replicated ones once
    sq_sh, sq_rep = torch.zeros(()), torch.zeros(())
    for p in params.values():
        sq = p.grad.detach().float().pow(2).sum()
        if isinstance(P.placement(p, "tp"), P.Shard):
            sq_sh += sq
        else:
            sq_rep += sq
    torch.distributed.all_reduce(sq_sh)
    norm = placement_ops.grad_norm(model, groups)
    out["norm_bitwise"] = torch.equal(norm, (sq_sh + sq_rep).sqrt())
    out["norm_vs_torch"] = abs(float(norm) - ref_norm) <= REL * ref_norm
    # the former all-gather per shard dim, and the checkpoint's cut of the whole tensor, both exact
    out["former_gather"] = all(torch.equal(placement_ops.full_tensor(p, groups), all_gather_along(
        p.detach(), P.placement(p, "tp").dim, None) if isinstance(P.placement(p, "tp"), P.Shard) else p.detach())
        for p in params.values())
    out["cut"] = all(torch.equal(placement_ops.shard_like(placement_ops.full_tensor(p, groups, p.grad), p, groups),
                                 p.grad) for p in params.values())
    before = {n: p.grad.clone() for n, p in params.items()}
    max_norm = 0.5 * float(norm)
    clipped = placement_ops.clip_grad_norm_(model, max_norm, groups)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch.nn.utils.clip_grad_norm_'s coefficient
    out["clip"] = torch.equal(clipped, norm) and all(torch.equal(p.grad, before[n] * coef) for n, p in params.items())
    return out


def _ep_checks(ws: int, record_list: bool = True) -> dict:
    init, _, _ = _reference(MOE)
    mesh, model = Mesh(dp=ws, ep=ws), GPT(MOE, 0)
    layers = apply_ep(model, mesh.group("ep"), mesh.group("dp", "cp"))
    if not record_list:
        for layer in layers:
            del layer.experts._course_placements
    groups = {"ep": mesh.group("ep")}
    full = placement_ops.full_parameters(model, groups)
    out = {"gather": _equal(full, init)}
    x, y = (shard(t, torch.distributed.get_rank(), ws) for t in global_batch(0, BATCH, MOE.seq_len, 0))
    dp = DataParallel(model, mesh=mesh, mode="bucketed", find_unused_parameters=True)  # the one that reduces
    (lm_loss(dp(x), y) + moe_aux_loss(model)).backward()
    dp.finish_gradient_sync()
    experts = {id(p) for layer in layers for p in layer.experts.parameters()}
    sq_dense, sq_expert = torch.zeros(()), torch.zeros(())  # the experts' squares summed over ep, the rest once
    for p in model.parameters():
        if p.grad is not None:
            if id(p) in experts:
                sq_expert += p.grad.float().pow(2).sum()
            else:
                sq_dense += p.grad.float().pow(2).sum()
    torch.distributed.all_reduce(sq_expert, group=mesh.group("ep"))
    out["norm_bitwise"] = torch.equal(placement_ops.grad_norm(model, groups), (sq_expert + sq_dense).sqrt())
    return out


def _zero_checks(ws: int, stage: int) -> dict:
    init, _, ref_norm = _reference(CFG)  # the whole batch: the mean of the shards' means (equal shard sizes)
    rank = torch.distributed.get_rank()
    model = GPT(CFG, 0)
    zdp = ZeroDataParallel(model, stage)
    shards = list(zdp.parameters())
    out = {"records": all(P.placement(s, "dp") == (P.Shard(0, u.layout.numel) if stage else P.Replicate())
                          for s, u in zip(shards, zdp.units, strict=True)),
           "gather": _equal(zdp.full_parameters(), init)}
    # the former FlatParamUnit.full_parameters: one all-gather of the padded flat shards, cut into views
    former = {}
    for u in zdp.units:
        flat = torch.empty(u.layout.padded_numel)
        if u.layout.world_size == 1:
            flat.copy_(u.shard.detach())
        else:
            torch.distributed.all_gather_into_tensor(flat, u.shard.detach())
        former |= dict(zip(u.layout.names, u.layout.views(flat), strict=True))
    out["former_gather"] = _equal({n: former[n] for n, _ in model.named_parameters()}, init)
    x, y = (shard(t, rank, ws) for t in global_batch(0, BATCH, CFG.seq_len, 0))
    lm_loss(zdp(x), y).backward()
    norm = float(placement_ops.grad_norm(shards, {"dp": None}))
    out["norm_vs_torch"] = abs(norm - ref_norm) <= REL * ref_norm
    return out


def _composed_checks(ws: int, **axes: int) -> dict:
    init, _, ref_norm = _reference(CFG)
    mesh = Mesh(**axes)
    composed = parallelize(GPT(CFG, 0), mesh, ParallelConfig(mesh.shape, microbatches=2), global_batch=BATCH)
    full = composed.full_parameters()
    x, y = (shard(t, mesh.coord("dp"), mesh.size("dp")) for t in global_batch(0, BATCH, CFG.seq_len, 0))
    composed.forward_backward(x, y)
    composed.finish_gradient_sync()
    norm = float(placement_ops.grad_norm(composed.module, mesh, disjoint=("pp",) if mesh.size("pp") > 1 else ()))
    held = {n for n, p in composed.module.named_parameters() if any(p is q for q in composed.parameters())}
    out = {"gather": all(torch.equal(t, init[n]) for n, t in full.items()), "names": sorted(full),
           "held": sorted(held) == sorted(full),
           "cut": all(torch.equal(_cut(composed, p, _gather(composed, p, p)), p.detach())
                      for p in composed.parameters()),
           "cp_replicated": all(P.placement(p, "cp") == P.Replicate() for p in composed.module.parameters()),
           "norm_vs_torch": abs(norm - ref_norm) <= REL * ref_norm}
    return out


def _padding_checks(rank: int) -> dict:
    """Shard(0, size=3) over 2 ranks: slices of 2 rows, rank 1's second row zero padding."""
    full = torch.arange(9.0).view(3, 3)
    p = torch.zeros(2, 3)
    P.set_placement(p, "dp", P.Shard(0, size=3))
    piece = placement_ops.shard_like(full, p, {"dp": None})
    padded = torch.cat([full, torch.zeros(1, 3)])[2 * rank:2 * rank + 2]
    out = {"piece": torch.equal(piece, padded),
           "whole": torch.equal(placement_ops.full_tensor(p, {"dp": None}, piece), full)}
    chunk = torch.zeros(2 - rank, 3)  # torch.chunk's pieces, as FSDP2 keeps them: 2 rows and 1, no padding
    P.set_placement(chunk, "dp", P.Shard(0, size=3))
    chunk_piece = placement_ops.shard_like(full, chunk, {"dp": None})
    out["chunk"] = (torch.equal(chunk_piece, full[2 * rank:2 * rank + 2])
                    and torch.equal(placement_ops.full_tensor(chunk, {"dp": None}, chunk_piece), full))
    try:
        placement_ops.shard_like(full[:, :2], p, {"dp": None})
        out["misfit"] = False
    except ValueError as e:
        out["misfit"] = "not the parameter's" in str(e)
    try:
        P.set_placement(p, "dp", P.Shard(1))
        out["twice"] = False
    except ValueError as e:
        out["twice"] = "already shards" in str(e)
    return out


def _fsdp2_checks(ws: int) -> dict:
    """FSDP2's shards (the module's own parameters, torch.chunk's pieces) gathered and cut by the generic functions."""
    from course_lib.parallel.fsdp2 import FSDP2DataParallel

    cfg = CFG.with_(vocab_size=255)  # an odd vocabulary: the embedding's and head's last pieces are shorter
    init = dict(GPT(cfg, 0).named_parameters())
    model = GPT(cfg, 0)
    FSDP2DataParallel(model, group=None)
    groups = {"dp": None}
    return {"gather": all(torch.equal(placement_ops.full_tensor(p, groups), init[n].detach())
                          for n, p in model.named_parameters()),
            "cut": all(torch.equal(placement_ops.shard_like(init[n].detach(), p, groups), p.detach())
                       for n, p in model.named_parameters()),
            "uneven": any(p.shape[0] * ws != init[n].shape[0] for n, p in model.named_parameters())}


def _two_ranks(rank: int, ws: int) -> dict:
    out = {"padding": _padding_checks(rank), "fsdp2": _fsdp2_checks(ws)}
    out |= {("dtensor", sp): _dtensor_rows(ws, sp, "tp") for sp in (False, True)}
    out["dtensor", "wrong_dim"] = _dtensor_rows(ws, False, "wrong_dim")
    out["dtensor", "forgets_partial"] = _dtensor_rows(ws, True, "forgets_partial")
    out |= {"tp": _tp_checks(ws, False), "sp": _tp_checks(ws, True), "wrong_dim": _tp_checks(ws, False, "wrong_dim"),
            "forgets_partial": _tp_checks(ws, True, "forgets_partial"), "ep": _ep_checks(ws),
            "ep_unrecorded": _ep_checks(ws, record_list=False)}
    out |= {f"zero{s}": _zero_checks(ws, s) for s in (0, 1, 2, 3)}
    out |= {"dp": _composed_checks(ws, dp=2), "cp": _composed_checks(ws, cp=2), "pp": _composed_checks(ws, pp=2)}
    return out


def _four_ranks(rank: int, ws: int) -> dict:
    return {"tp4_sp": _tp_checks(ws, True), "dp2_tp2": _composed_checks(ws, dp=2, tp=2),
            "dp2_pp2": _composed_checks(ws, dp=2, pp=2)}


@functools.cache
def two() -> list[dict]:
    return launch(_two_ranks, 2, timeout=TIMEOUT)


@functools.cache
def four() -> list[dict]:
    return launch(_four_ranks, 4, timeout=TIMEOUT)


# ----------------------------------------------------------------------------------------------------------------
# Placements against DTensor's


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_tp_records_what_dtensor_places(sp):
    for rank in two():
        rows = rank["dtensor", sp]
        assert len(rows) == len(dict(GPT(CFG, 0).named_parameters()))
        for name, ours, weight, their_weight, their_grad in rows:
            assert weight == their_weight, f"{name}: ours {ours}, DTensor's {their_weight}"
            if their_grad == str(DPartial()):
                assert ours == "P", f"{name}: DTensor's gradient is {their_grad}, ours recorded {ours}"
            if ours == "P":  # DTensor sums it later (Partial) or already inside backward (the SP row bias)
                assert their_grad in (str(DPartial()), str(DReplicate())), name
        kinds = {ours for _, ours, *_ in rows}
        assert kinds == ({"S(0)", "S(1)", "P"} if sp else {"S(0)", "S(1)", "R"})  # every kind compared


@pytest.mark.parametrize("mutation", ["wrong_dim", "forgets_partial"])
def test_a_wrong_record_differs_from_dtensor(mutation):
    rows = two()[0]["dtensor", mutation]
    assert any(w != tw or (tg == str(DPartial()) and ours != "P") for _, ours, w, tw, tg in rows)


# ----------------------------------------------------------------------------------------------------------------
# The generic functions


@pytest.mark.parametrize("kind", ["tp", "sp"])
def test_tp_gather_grads_norm_cut_and_clip(kind):
    for rank in two():
        assert rank[kind] == {k: True for k in rank[kind]}, rank[kind]


def test_tp4_sp_on_four_ranks():
    for rank in four():
        assert rank["tp4_sp"] == {k: True for k in rank["tp4_sp"]}, rank["tp4_sp"]


def test_ep_gathers_experts_by_global_name_and_counts_each_once():
    for rank in two():
        assert rank["ep"] == {"gather": True, "norm_bitwise": True}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_flat_shards_are_placed_and_gathered(stage):
    for rank in two():
        assert rank[f"zero{stage}"] == {k: True for k in rank[f"zero{stage}"]}, rank[f"zero{stage}"]


@pytest.mark.parametrize("kind", ["dp", "cp", "pp"])
def test_dp_cp_pp_whole_parameters_and_cut(kind):
    ranks = two()
    names = sorted(dict(GPT(CFG, 0).named_parameters()))
    for rank in ranks:
        r = rank[kind]
        assert r["gather"] and r["held"] and r["cut"] and r["cp_replicated"] and r["norm_vs_torch"], r
    if kind == "pp":  # two stages: every parameter on exactly one
        first, second = (set(rank["pp"]["names"]) for rank in ranks)
        assert not first & second and sorted(first | second) == names
    else:
        assert all(rank[kind]["names"] == names for rank in ranks)


@pytest.mark.parametrize("kind", ["dp2_tp2", "dp2_pp2"])
def test_composed_on_four_ranks(kind):
    ranks = four()
    for rank in ranks:
        r = rank[kind]
        assert r["gather"] and r["held"] and r["cut"] and r["norm_vs_torch"], r
    names = set().union(*(rank[kind]["names"] for rank in ranks))
    assert sorted(names) == sorted(dict(GPT(CFG, 0).named_parameters()))


def test_fsdp2_shards_are_gathered_and_cut_by_their_placements():
    for rank in two():
        assert rank["fsdp2"]["gather"] and rank["fsdp2"]["cut"], rank["fsdp2"]
    assert any(rank["fsdp2"]["uneven"] for rank in two()), "no parameter with an uneven dim 0: nothing checked"


def test_merge_parameters_joins_and_refuses_drift():
    a, b = {"x": torch.zeros(2)}, {"x": torch.zeros(2), "y": torch.ones(1)}
    assert placement_ops.merge_parameters([a, b]).keys() == {"x", "y"}
    with pytest.raises(ValueError, match="held by two ranks"):
        placement_ops.merge_parameters([a, b], exclusive=True)
    with pytest.raises(ValueError, match="x differs between rank 0 and rank 1"):
        placement_ops.merge_parameters([a, {"x": torch.ones(2)}])


def test_a_padded_shard_round_trips_and_a_misfit_is_refused():
    for rank in two():
        assert rank["padding"] == {"piece": True, "whole": True, "chunk": True, "misfit": True, "twice": True}


# ----------------------------------------------------------------------------------------------------------------
# Mutations


@pytest.mark.parametrize("mutation", ["wrong_dim", "forgets_partial"])
def test_wrong_tp_records_fail(mutation):
    r = two()[0][mutation]
    failed = {k for k, ok in r.items() if not ok}
    assert failed >= ({"gather", "grads"} if mutation == "wrong_dim" else {"grads"}), r


def test_an_unrecorded_expert_list_fails_the_gather():
    assert not two()[0]["ep_unrecorded"]["gather"]
