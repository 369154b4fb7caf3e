"""course_lib.parallel.tp: every layer against its single-process module (outputs, input gradients and the gradient of
every shard against the matching slice of the full gradient), the whole GPT against the baseline for several SGD
and AdamW steps with and without sequence parallelism, the comm log against the formula, broken variants that must
fail, and the errors for shapes t cannot split.

Launches are few and batched (rank start-up costs seconds on 2 cores): one layer suite and one model suite per TP
degree (2 and 4); every test reads their cached results.

Tolerances. Layers: max |diff| <= 1e-5 relative to the largest reference value (floored at 1e-2; fp32, the
partial sums are added in another order than the single-process matmul). Whole model: ``course_lib.train``'s
rule, a multiple of the reference's own fp32 noise measured against the same run in float64 (``baseline`` here
adds gradient clipping to ``train_baseline`` and measures its noise with ``with_fp32_noise``), for SGD (lr 1e-2)
and AdamW (lr 1e-3). AdamW on the SwiGLU GPT is the ill-conditioned case the rule adapts to: its fc1/gate gradients
at initialisation are products of two ~0.02-scale factors, fp32 rounds single elements of them by up to 10 %, and
AdamW turns such relative noise into steps of lr-size: the single-process fp32 run itself is ~5e-6 from fp64.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib import comm
from course_lib.data import global_batch
from course_lib.estimates import accounting
from course_lib.estimates.activation_memory import layer_activation_bytes
from course_lib.layers import MLP, Attention
from course_lib.measure.memtrack import MemoryTracker
from course_lib.model import GPT, Block, lm_loss
from course_lib.model_config import GPTConfig, param_count
from course_lib.parallel import oracles, tp, tp_comm, tp_layers, tp_overlap
from course_lib.parallel.dp import DataParallel
from course_lib.parallel.placement import Partial, Shard, placement
from course_lib.parallel.placement_ops import clip_grad_norm_
from course_lib.parallel.pp_stages import Stage
from course_lib.parallel.runs import train_tp
from course_lib.parallel.tp_comm import SequenceParallelLinears, reduce_scatter_along, split_along
from course_lib.runtime.launch import RankError, RankTimeout, launch
from course_lib.runtime.mesh import Mesh
from course_lib.train import (
    TrainConfig,
    TrainResult,
    assert_parity,
    compare,
    copy_parameters,
    make_optimizer,
    with_fp32_noise,
)

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

CFG = GPTConfig(bias=False)  # GELU, LayerNorm, learned positions, MHA
GQA = GPTConfig(bias=False, n_kv_head=2, mlp="swiglu", norm="rmsnorm", pos="rope")  # t=4: K/V replicated
BIASED = GPTConfig()  # with biases: row-parallel biases are partial under SP
TIED = CFG.with_(tie_embeddings=True)
PADDED = CFG.with_(vocab_size=257, make_vocab_size_divisible_by=4)  # 260 rows: t = 2 and 4 split the padding
SGD = TrainConfig(optimizer="sgd", lr=1e-2)
ADAMW = TrainConfig(optimizer="adamw", lr=1e-3)
CLIP = 0.5
LAYER_RTOL = 1e-5
LAUNCH_TIMEOUT = 240


# ----------------------------------------------------------------------------------------------------------------
# Variants that must fail


class MLPWithoutFBackward(tp_layers.TensorParallelMLP):
    """Enters the region with a plain identity: the backward all-reduce of f is missing (what a bare
    ``dist.all_reduce`` in forward, invisible to autograd, amounts to)."""

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _mlp_without_f_backward(m: nn.Module, group, sp: bool) -> nn.Module:
    return MLPWithoutFBackward(m, group, sequence_parallel=sp)


def _norm_not_partial(m: nn.Module, group, sp: bool) -> None:
    """Keeps the norm and records nothing: under SP its gradient (each rank's own tokens) is taken for a replicated
    one (``Replicate()`` on tp), so nobody sums it over tp: each norm weight keeps only its own tokens' gradient."""
    return None


NORMS_NOT_PARTIAL = {"blocks.*.norm1": _norm_not_partial, "blocks.*.norm2": _norm_not_partial,
                     "norm_f": _norm_not_partial}


class SavesGathered:
    """SP the short way: all-gather the shard (SP's g), then ordinary linears, which save the gathered input
    [b, s, h] instead of the s/t shard, so SP shrinks only the norms' activations."""

    def project(self, x: torch.Tensor, linears: list[nn.Module]) -> tuple[torch.Tensor, ...]:
        x = tp_comm.gather_from_sequence_parallel_region(x, self.group)
        return tuple(F.linear(x, m.weight, m.bias) for m in linears)


class SavesGatheredAttention(SavesGathered, tp_layers.TensorParallelAttention):
    pass


class SavesGatheredMLP(SavesGathered, tp_layers.TensorParallelMLP):
    pass


class _NoRegather(SequenceParallelLinears):
    """Saves the s/t shard like Megatron-LM but skips the backward re-gather: each rank's weight gradient comes
    from its own tokens only (dW = dY_own^T x_own), a t-th of the sum."""

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        grad_x = reduce_scatter_along(sum(g @ w for g, w in zip(grads, weights, strict=True)), 1, ctx.group)
        out: list[torch.Tensor | None] = [grad_x, None]
        for g, has_bias in zip(grads, ctx.has_bias, strict=True):
            own = split_along(g, 1, ctx.group).reshape(-1, g.shape[-1])
            out += [own.t() @ x.reshape(-1, x.shape[-1]), own.sum(0) if has_bias else None]
        return tuple(out)


class NoRegatherProject:
    def project(self, x: torch.Tensor, linears: list[nn.Module]) -> tuple[torch.Tensor, ...]:
        return _NoRegather.apply(x, self.group, *(p for m in linears for p in (m.weight, m.bias)))


class NoRegatherAttention(NoRegatherProject, tp_layers.TensorParallelAttention):
    pass


class NoRegatherMLP(NoRegatherProject, tp_layers.TensorParallelMLP):
    pass


def _no_regather_attention(m: nn.Module, group, sp: bool) -> nn.Module:
    return NoRegatherAttention(m, group, sequence_parallel=sp)


def _no_regather_mlp(m: nn.Module, group, sp: bool) -> nn.Module:
    return NoRegatherMLP(m, group, sequence_parallel=sp)


def _gathers_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Gathers the full logits and uses the ordinary cross-entropy: right numbers, b*s*V bytes instead of 3*b*s.
    (The runs below use every rank as the TP group, so the default group is it.)"""
    full = tp_comm.gather_from_tensor_parallel_region(logits, None)
    return lm_loss(full, targets)


class InterleavedGQA(tp_layers.TensorParallelAttention):
    """Maps query head j to K/V head j mod n_kv (interleaved) instead of j // (n_head / n_kv)."""

    def kv_head_of(self, q_head: torch.Tensor) -> torch.Tensor:
        return q_head % self.n_kv_head


def _interleaved_gqa(m: nn.Module, group, sp: bool) -> nn.Module:
    return InterleavedGQA(m, group, sequence_parallel=sp)


# Sums every gradient's squares over tp, as if each rank held different parameters (a pipeline's rule):
# replicated gradients are counted t times in the norm.
counts_replicated_per_rank = functools.partial(clip_grad_norm_, disjoint=("tp",))


# ----------------------------------------------------------------------------------------------------------------
# Layer suite: each TP layer against its single-process module


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max(max |ref|, 1e-2): relative, except for a reference that is ~0 everywhere (the key bias's
    gradient is 0 in exact arithmetic: softmax ignores a shift shared by all scores), whose rounding noise is
    measured against 1e-2."""
    scale = max(float(ref.abs().max()), 1e-2)
    return float((a.detach() - ref.detach()).abs().max()) / scale


def _ops(records: list[comm.CommRecord]) -> list[tuple[str, int]]:
    return [(r.op, r.tensor_bytes) for r in records]


def _check_layer(ref: nn.Module, par: nn.Module, x: torch.Tensor, t: int, r: int, sp: bool,
                 group=None) -> dict:
    """Forward/backward ``ref`` on x and ``par`` on x (its sequence shard under SP) with the same loss; the relative
    errors of output, input gradient and every parameter's gradient (shards vs slices; partial gradients summed),
    and the collectives of forward and backward."""
    w = _rand(*ref(x).shape, seed=7)
    x_ref = x.clone().requires_grad_(True)
    out_ref = ref(x_ref)
    (out_ref * w).sum().backward()
    x_par = (split_along(x, 1, group) if sp else x.clone()).requires_grad_(True)
    w_par = split_along(w, 1, group) if sp else w
    with comm.recording() as fwd:
        out = par(x_par)
    with comm.recording() as bwd:
        (out * w_par).sum().backward()
    res = {"out": _rel(out, split_along(out_ref, 1, group) if sp else out_ref),
           "x_grad": _rel(x_par.grad, split_along(x_ref.grad, 1, group) if sp else x_ref.grad),
           "fwd": _ops(fwd.records), "bwd": _ops(bwd.records), "grads": {}}
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        where = placement(p, "tp")  # what the layer recorded: a wrong record makes the comparison fail
        expected = ref_params[name].grad
        got = p.grad.clone()
        if isinstance(where, Partial):
            comm.all_reduce(got)
        if isinstance(where, Shard):
            expected = expected.chunk(t, dim=where.dim)[r]
        res["grads"][name] = _rel(got, expected)
    return res


def _layer_suite(rank: int, world_size: int) -> dict:
    t, r = world_size, rank
    torch.manual_seed(0)  # every rank builds the same single-process modules
    out = {}
    x = _rand(2, 8, 64, seed=1)
    for mlp in ("gelu", "swiglu"):
        cfg = GPTConfig(mlp=mlp, bias=True)
        for sp in (False, True):
            ref = MLP(cfg)
            out["mlp", mlp, sp] = _check_layer(ref, tp_layers.TensorParallelMLP(ref, sequence_parallel=sp), x, t, r, sp)
        ref = MLP(cfg)
        out["mlp_no_f", mlp] = _check_layer(ref, MLPWithoutFBackward(ref), x, t, r, False)
    for name, cfg in {"mha": GPTConfig(), "gqa": GPTConfig(n_kv_head=2), "gqa_rope": GQA.with_(bias=True)}.items():
        for sp in (False, True):
            torch.manual_seed(3)
            ref = Attention(cfg)
            out["attn", name, sp] = _check_layer(ref, tp_layers.TensorParallelAttention(ref, sequence_parallel=sp),
                                                 x, t, r, sp)
        ref = Attention(cfg)
        try:
            out["attn_interleaved", name] = _check_layer(ref, InterleavedGQA(ref), x, t, r, False)
        except RuntimeError as e:  # the wrong map reads K/V heads this rank does not hold
            out["attn_interleaved", name] = str(e)
    # column with gather_output, row with a replicated input
    lin = nn.Linear(64, 32)
    column = tp_layers.ColumnParallelLinear.from_linear(lin, gather_output=True)
    out["column_gather"] = _check_layer(lin, column, x, t, r, False)
    lin = nn.Linear(64, 32)
    out["row_split_input"] = _check_layer(lin, tp_layers.RowParallelLinear.from_linear(lin, input_is_parallel=False), x,
                                          t, r, False)
    # embedding
    emb = nn.Embedding(256, 64)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(5))
    for sp in (False, True):
        par = tp_layers.VocabParallelEmbedding(emb, sequence_parallel=sp)
        with comm.recording() as log:
            got = par(ids)
        w = _rand(2, 8, 64, seed=9)
        ref_out = emb(ids)
        emb.zero_grad()
        (ref_out * w).sum().backward()
        (got * (split_along(w, 1, None) if sp else w)).sum().backward()
        out["embedding", sp] = {"out": _rel(got, split_along(ref_out, 1, None) if sp else ref_out),
                                "grad": _rel(par.weight.grad, emb.weight.grad.chunk(t)[r]), "fwd": _ops(log.records)}
    # the collective matmul (overlapped or not) against the gathered GEMM, and with step-indexed output rows
    lin1, lin2 = nn.Linear(64, 32), nn.Linear(64, 16, bias=False)
    xs = _rand(2, 8, 64, seed=21)
    for variant in ("overlapped", "sequential", "step_indexed"):
        x_ref = xs.clone().requires_grad_(True)
        refs = (lin1(x_ref), lin2(x_ref))
        ws = [_rand(*y.shape, seed=22 + i) for i, y in enumerate(refs)]
        for p in (*lin1.parameters(), *lin2.parameters()):
            p.grad = None
        sum((y * w).sum() for y, w in zip(refs, ws, strict=True)).backward()
        ref_grads = [lin1.weight.grad.chunk(t)[r], lin1.bias.grad.chunk(t)[r], lin2.weight.grad.chunk(t)[r]]
        params = [p.detach().chunk(t)[r].clone().requires_grad_(True) for p in (lin1.weight, lin1.bias, lin2.weight)]
        x_par = split_along(xs, 1, None).requires_grad_(True)
        seam = (lambda rank, step, n: step) if variant == "step_indexed" else tp_overlap.ring_source
        with mock.patch.object(tp_overlap, "ring_source", seam), comm.recording() as fwd:
            ys = tp_overlap.collective_matmul(x_par, [(params[0], params[1]), (params[2], None)],
                                              overlap=variant != "sequential")
        sum((y * w.chunk(t, -1)[r]).sum() for y, w in zip(ys, ws, strict=True)).backward()
        out["collective_matmul", variant] = {
            "out": max(_rel(y, ref.chunk(t, -1)[r]) for y, ref in zip(ys, refs, strict=True)),
            "x_grad": _rel(x_par.grad, split_along(x_ref.grad, 1, None)),
            "grads": {i: _rel(p.grad, g) for i, (p, g) in enumerate(zip(params, ref_grads, strict=True))},
            "fwd": _ops(fwd.records)}
    # activation memory of one block: unsplit, TP, TP + SP, and SP keeping the gathered input
    for sp in ("unsplit", False, True, "regather_skipped"):
        block = Block(CFG)
        if sp != "unsplit":
            attn, mlp = (SavesGatheredAttention, SavesGatheredMLP) if sp == "regather_skipped" else \
                (tp_layers.TensorParallelAttention, tp_layers.TensorParallelMLP)
            block.attn = attn(block.attn, sequence_parallel=bool(sp))
            block.mlp = mlp(block.mlp, sequence_parallel=bool(sp))
        xb = _rand(4, CFG.seq_len, CFG.d_model, seed=13)
        xb = (split_along(xb, 1, None) if sp in (True, "regather_skipped") else xb).requires_grad_(True)
        with MemoryTracker(block) as mt:
            yb = block(xb)
            out["activations", sp] = mt.current["activations"]
        del yb
    # vocab-parallel cross-entropy, ordinary, scaled by 1000, and with ignored targets (-100)
    for scale in (1.0, 1000.0, "ignore"):
        logits = _rand(2, 8, 256, seed=11) * (1.0 if scale == "ignore" else scale)
        targets = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(12))
        if scale == "ignore":
            targets[0, :3] = targets[1, 5] = -100
        full = logits.clone().requires_grad_(True)
        ref_loss = F.cross_entropy(full.reshape(-1, 256), targets.reshape(-1))
        ref_loss.backward()
        shard = logits.chunk(t, dim=-1)[r].clone().requires_grad_(True)
        with comm.recording() as fwd:
            loss = tp_layers.vocab_parallel_cross_entropy(shard, targets)
        with comm.recording() as bwd:
            loss.backward()
        out["ce", scale] = {"loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                            "finite": bool(torch.isfinite(loss)) and bool(torch.isfinite(shard.grad).all()),
                            "grad": _rel(shard.grad, full.grad.chunk(t, dim=-1)[r]),
                            "fwd": _ops(fwd.records), "bwd": _ops(bwd.records)}
    return out


# ----------------------------------------------------------------------------------------------------------------
# Model suite: the whole GPT


RUNS = {  # name -> (cfg, tc, sequence_parallel, variant, clip); variant: train_tp's keywords, "plan" over gpt_plan
    "sgd": (CFG, SGD, False, {}, None),
    "sgd_sp": (CFG, SGD, True, {}, None),
    "adamw": (CFG, ADAMW, False, {}, None),
    "adamw_sp": (CFG, ADAMW, True, {}, None),
    "gqa_sgd": (GQA, SGD, False, {}, None),
    "gqa_sgd_sp": (GQA, SGD, True, {}, None),
    "gqa_adamw_sp": (GQA, ADAMW, True, {}, None),
    "biased_sgd_sp": (BIASED, SGD, True, {}, None),
    "tied_sgd_sp": (TIED, SGD, True, {}, None),
    "clip_sgd_sp": (CFG, SGD, True, {}, CLIP),
    "padded_sgd_sp": (PADDED, SGD, True, {}, None),
    # SP with every column-parallel GEMM as a collective matmul (tp_overlap)
    "overlap_sgd_sp": (GQA, SGD, True, {"sp_matmul": tp_overlap.collective_matmul}, None),
    "broken_no_f_backward": (CFG, SGD, False, {"plan": {"blocks.*.mlp": _mlp_without_f_backward}}, None),
    "broken_norm_sync": (CFG, SGD, True, {"plan": NORMS_NOT_PARTIAL}, None),
    "broken_gathered_logits": (CFG, SGD, False, {"loss_fn": _gathers_logits}, None),
    "broken_gqa_split": (GQA, SGD, False, {"plan": {"blocks.*.attn": _interleaved_gqa}}, None),
    "broken_clip_norm": (CFG, SGD, True, {"clip": counts_replicated_per_rank}, CLIP),
    "broken_no_regather": (CFG, SGD, True, {"plan": {"blocks.*.attn": _no_regather_attention,
                                                     "blocks.*.mlp": _no_regather_mlp}}, None),
}


def _variant_kwargs(cfg: GPTConfig, variant: dict) -> dict:
    """``train_tp``'s keywords of a variant: its plan entries replace ``gpt_plan``'s (same order)."""
    if "plan" not in variant:
        return variant
    return {**variant, "plan": tp.gpt_plan(cfg) | variant["plan"]}


def _tp_gpt(cfg: GPTConfig, **options) -> GPT:
    """A GPT with tensor parallelism over every rank applied in place (``apply_tp``)."""
    model = GPT(cfg)
    tp.apply_tp(model, None, **options)
    return model


def _errors(rank: int, world_size: int) -> dict[str, str]:
    """The message of every construction that must be refused."""
    ce = tp_layers.vocab_parallel_cross_entropy
    cases = {
        "n_head": lambda: _tp_gpt(GPTConfig(n_head=6, d_model=48)),
        "d_ff": lambda: _tp_gpt(GPTConfig(d_ff=65)),
        "vocab": lambda: _tp_gpt(GPTConfig(vocab_size=255)),
        "seq_len": lambda: _tp_gpt(CFG, sequence_parallel=True)(torch.zeros(1, 6, dtype=torch.long)),
        "style": lambda: _tp_gpt(CFG, plan={"lm_head": "diagonal"}),
        "pattern": lambda: _tp_gpt(CFG, plan={"blocks.*.attention": "attention"}),
        "module_type": lambda: _tp_gpt(CFG, plan={"blocks.*.mlp": "attention"}),
        # TP names its group one way only (apply_tp's group); the data-parallel form it composes with
        # (DataParallel, compose.data_parallel) still takes mesh= or group= and refuses both
        "mesh_and_group": lambda: DataParallel(_tp_gpt(CFG), mesh=object(), group=torch.distributed.group.WORLD),
        "no_plan": lambda: tp.apply_tp(nn.Linear(4, 4), None),
        "targets": lambda: ce(torch.zeros(2, 3, 64), torch.zeros(2, 4, dtype=torch.long)),
        "target_range": lambda: ce(torch.zeros(2, 3, 64), torch.full((2, 3), 64 * world_size)),
        "negative_target": lambda: ce(torch.zeros(2, 3, 64), torch.full((2, 3), -1)),
    }
    out = {}
    for name, build in cases.items():
        try:
            build()
            out[name] = "no error"
        except (ValueError, RuntimeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _model_suite(rank: int, world_size: int) -> dict:
    out: dict = {}
    for name, (cfg, tc, sp, variant, clip) in RUNS.items():
        try:
            out[name] = train_tp(rank, world_size, cfg, tc, sequence_parallel=sp, clip_grad_norm=clip,
                                 **_variant_kwargs(cfg, variant))
        except RuntimeError as e:  # a broken variant may be refused on every rank (the wrong GQA map at t=2)
            if not name.startswith("broken"):
                raise
            out[name] = str(e)
    # over a mesh's TP group: all ranks at t=2; at 4 ranks two TP groups of 2 (dp=2), each its own replica
    mesh = Mesh(tp=2) if world_size == 2 else Mesh(dp=2, tp=2)
    out["mesh"] = train_tp(rank, world_size, CFG, SGD, mesh=mesh, sequence_parallel=True)
    out["errors"] = _errors(rank, world_size)
    return out


ROPE = GPTConfig(bias=False, pos="rope")  # DTensor's SP plan needs rotary positions (see oracles.dtensor_plan)
ROPE_SWIGLU = ROPE.with_(mlp="swiglu", norm="rmsnorm")
DTENSOR_RUNS = {  # name -> (cfg, tc, sequence_parallel)
    "sgd": (ROPE, SGD, False),
    "sgd_sp": (ROPE, SGD, True),
    "adamw_sp": (ROPE, ADAMW, True),
    "swiglu_sgd_sp": (ROPE_SWIGLU, SGD, True),
}


def _dtensor_suite(rank: int, world_size: int) -> dict:
    out = {}
    for name, (cfg, tc, sp) in DTENSOR_RUNS.items():
        out["ours", name] = train_tp(rank, world_size, cfg, tc, sequence_parallel=sp)
        out["dtensor", name] = oracles.train_dtensor_tp(rank, world_size, cfg, tc, sequence_parallel=sp)
    return out


SUITE_FNS = {"layers": _layer_suite, "models": _model_suite, "dtensor": _dtensor_suite}
_SUITES: dict[tuple[str, int], list | Exception] = {}


def _suite(kind: str, n: int) -> list[dict]:
    """Every rank's results of suite ``kind`` at TP degree n: one launch, kept (or its failure) for the session."""
    key = (kind, n)
    if key not in _SUITES:
        try:
            _SUITES[key] = launch(SUITE_FNS[kind], n, timeout=LAUNCH_TIMEOUT)
        except (RankError, RankTimeout) as e:
            _SUITES[key] = e
    if isinstance(_SUITES[key], Exception):
        raise _SUITES[key]
    return _SUITES[key]


@pytest.fixture(params=[2, 4], ids=lambda n: f"tp{n}")
def layers(request) -> tuple[int, list[dict]]:
    return request.param, _suite("layers", request.param)


@pytest.fixture(params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda n: f"tp{n}")  # tp4: not test-fast
def models(request) -> tuple[int, list[dict]]:
    return request.param, _suite("models", request.param)


@pytest.fixture(params=[2, 4], ids=lambda n: f"tp{n}")
def dtensor(request) -> tuple[int, list[dict]]:
    return request.param, _suite("dtensor", request.param)


# ----------------------------------------------------------------------------------------------------------------
# Single-process references


@functools.cache
def baseline(cfg: GPTConfig, tc: TrainConfig, clip: float | None = None) -> TrainResult:
    """``train_baseline`` with optional gradient-norm clipping (its norms kept in ``grad_norms``), carrying its fp32
    noise (the same run in float64: ``with_fp32_noise``)."""

    def train(dtype: torch.dtype) -> TrainResult:
        model = GPT(cfg, tc.seed).to(dtype)
        opt = make_optimizer(list(model.parameters()), tc)
        losses, norms = [], []
        for step in range(tc.steps):
            x, y = global_batch(step, tc.global_batch, cfg.seq_len, tc.seed)
            loss = lm_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            losses.append(loss.item())
        result = TrainResult(losses, copy_parameters(model))
        result.grad_norms = norms
        return result

    return with_fp32_noise(train)


def _expected_ops(cfg: GPTConfig, tc: TrainConfig, t: int, sp: bool) -> list[tuple[str, int]]:
    return [(c.op, c.tensor_bytes) for c in accounting.step_collectives(cfg, tc.global_batch, t, sp)]


# ----------------------------------------------------------------------------------------------------------------
# Layers


def _assert_layer(res: dict, label: str) -> None:
    assert res["out"] <= LAYER_RTOL, f"{label}: output off by {res['out']:.2e}"
    assert res["x_grad"] <= LAYER_RTOL, f"{label}: input gradient off by {res['x_grad']:.2e}"
    assert res["grads"], f"{label}: no parameter compared"
    bad = {k: v for k, v in res["grads"].items() if v > LAYER_RTOL}
    assert not bad, f"{label}: shard gradients off: {bad}"


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_mlp_matches_one_process_and_communicates_once_each_way(layers, mlp):
    t, per_rank = layers
    v = 2 * 8 * 64 * 4
    for r, res in enumerate(per_rank):
        for sp in (False, True):
            got = res["mlp", mlp, sp]
            _assert_layer(got, f"{mlp} MLP, t={t}, sp={sp}, rank {r}")
            if sp:  # all-gather in, reduce-scatter out; backward reversed, with the input re-gathered
                assert got["fwd"] == [("all_gather", v), ("reduce_scatter", v)]
                assert got["bwd"] == [("all_gather", v), ("all_gather", v), ("reduce_scatter", v)]
            else:  # g forward, f backward
                assert got["fwd"] == [("all_reduce", v)]
                assert got["bwd"] == [("all_reduce", v)]


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_f_without_backward_all_reduce_gives_wrong_input_gradients(layers, mlp):
    _t, per_rank = layers
    res = per_rank[0]["mlp_no_f", mlp]
    assert res["out"] <= LAYER_RTOL  # forward is still right...
    assert res["x_grad"] > 1e-2, "...but each rank keeps only its partial input gradient"
    assert res["bwd"] == []


@pytest.mark.parametrize("name", ["mha", "gqa", "gqa_rope"])
def test_attention_split_by_heads_matches_one_process(layers, name):
    t, per_rank = layers
    for r, res in enumerate(per_rank):
        for sp in (False, True):
            _assert_layer(res["attn", name, sp], f"{name} attention, t={t}, sp={sp}, rank {r}")


@pytest.mark.parametrize("name", ["gqa", "gqa_rope"])
def test_wrong_gqa_head_map_fails(layers, name):
    """Mapping query heads to K/V heads by j mod n_kv instead of j // (n_head/n_kv): some rank reads K/V heads it
    does not hold (refused) or computes the wrong attention."""
    _t, per_rank = layers
    results = [res["attn_interleaved", name] for res in per_rank]
    assert any(isinstance(x, str) or x["out"] > 1e-3 for x in results), results


def test_gather_output_and_split_input_layers(layers):
    _t, per_rank = layers
    for r, res in enumerate(per_rank):
        _assert_layer(res["column_gather"], f"column gather_output, rank {r}")
        _assert_layer(res["row_split_input"], f"row input_is_parallel=False, rank {r}")
        assert [op for op, _ in res["column_gather"]["fwd"]] == ["all_gather"]


def test_vocab_parallel_embedding(layers):
    _t, per_rank = layers
    v = 2 * 8 * 64 * 4
    for res in per_rank:
        for sp, op in ((False, "all_reduce"), (True, "reduce_scatter")):
            got = res["embedding", sp]
            assert got["out"] <= LAYER_RTOL and got["grad"] <= LAYER_RTOL
            assert got["fwd"] == [(op, v)]


@pytest.mark.parametrize("scale", [1.0, 1000.0, "ignore"])
def test_vocab_parallel_cross_entropy(layers, scale):
    """Equal to F.cross_entropy (also for logits x1000, and with targets -100 ignored: mean over the others, no
    gradient), gradient of every shard = the slice of the full gradient, 3 all-reduces of b*s fp32 forward and
    nothing backward."""
    _t, per_rank = layers
    for r, res in enumerate(per_rank):
        got = res["ce", scale]
        assert got["finite"]
        assert got["loss"] <= 1e-6, f"rank {r}: loss off by {got['loss']:.2e}"
        assert got["grad"] <= LAYER_RTOL, f"rank {r}: logit-shard gradient off by {got['grad']:.2e}"
        assert got["fwd"] == [("all_reduce", 2 * 8 * 4)] * 3
        assert got["bwd"] == []


def test_collective_matmul_equals_the_gathered_gemm(layers):
    """Two column-parallel GEMMs on the ring-gathered shards, overlapped and not: outputs, input and weight
    gradients equal the single-process linears'; forward moves exactly the all-gather's bytes by our own sends:
    t - 1 shards of b s/t h fp32 per rank. Writing each partial GEMM at its step's index instead of its source
    rank's (a mutation) scrambles the rows."""
    t, per_rank = layers
    shard = 2 * 8 // t * 64 * 4
    for r, res in enumerate(per_rank):
        for variant in ("overlapped", "sequential"):
            got = res["collective_matmul", variant]
            _assert_layer(got, f"collective matmul {variant}, t={t}, rank {r}")
            assert max(got["grads"].values()) <= LAYER_RTOL, got["grads"]
            assert sorted(got["fwd"]) == sorted([("send", shard), ("recv", shard)] * (t - 1)), got["fwd"]
    assert any(res["collective_matmul", "step_indexed"]["out"] > 1e-3 for res in per_rank)


def test_activation_memory_with_and_without_sp_matches_formula(layers):
    """Measured (MemoryTracker) activations of one block per rank equal the adapted formula to the byte, and
    TP + SP holds exactly 1/t of the unsplit block's (MHA, learned positions: every saved tensor is split)."""
    t, per_rank = layers
    for res in per_rank:
        for sp in (False, True):
            assert res["activations", sp] == accounting.layer_activation_bytes_tp(CFG, 4, t, sp), (t, sp)
        assert res["activations", True] * t == res["activations", "unsplit"]
        assert res["activations", "regather_skipped"] > res["activations", True]
    assert per_rank[0]["activations", False] == layer_activation_bytes(CFG, 4, CFG.seq_len, tp=t, formula="adapted",
                                                                       element_bytes=4)


# ----------------------------------------------------------------------------------------------------------------
# The whole model


@pytest.mark.parity
@pytest.mark.parametrize("name", ["sgd", "sgd_sp", "adamw", "adamw_sp", "gqa_sgd", "gqa_sgd_sp", "biased_sgd_sp",
                                  "tied_sgd_sp", "clip_sgd_sp", "padded_sgd_sp", "overlap_sgd_sp"])
def test_gpt_parity_with_one_process(models, name):
    t, per_rank = models
    cfg, tc, _sp, _cls, clip = RUNS[name]
    ref = baseline(cfg, tc, clip)
    report = assert_parity(ref, per_rank[0][name])
    print(f"t={t} {name}: {report}")
    for r, res in enumerate(per_rank[1:], 1):
        assert res[name].losses == per_rank[0][name].losses, f"rank {r} reports another loss"
        assert all(torch.equal(res[name].params[k], v) for k, v in per_rank[0][name].params.items())


@pytest.mark.parity
def test_gpt_parity_swiglu_adamw(models):
    t, per_rank = models
    cfg, tc, *_ = RUNS["gqa_adamw_sp"]
    report = assert_parity(baseline(cfg, tc), per_rank[0]["gqa_adamw_sp"])
    print(f"t={t}: {report}")


@pytest.mark.parity
def test_tp_over_a_mesh_group(models):
    """``mesh=`` resolves to ``mesh.group("tp")``: with dp=2 x tp=2 on 4 ranks both TP pairs train their own replica
    (same data), each equal to one process; every collective is on the group named "tp", of size 2."""
    _t, per_rank = models
    ref = baseline(CFG, SGD)
    for r, res in enumerate(per_rank):
        assert compare(ref, res["mesh"]).ok, f"rank {r}"
        records = [rec for step in res["mesh"].step_comm for rec in step]
        assert records and {(rec.group, rec.group_size) for rec in records} == {("tp", 2)}


@pytest.mark.parity
def test_grad_norm_clipping_counts_each_shard_once(models):
    _t, per_rank = models
    ref = baseline(CFG, SGD, CLIP)
    assert len(ref.grad_norms) == SGD.steps
    assert per_rank[0]["clip_sgd_sp"].grad_norms == pytest.approx(ref.grad_norms, rel=1e-5)
    assert min(ref.grad_norms) > CLIP  # clipping really acted
    broken = per_rank[0]["broken_clip_norm"]
    assert broken.grad_norms[0] > ref.grad_norms[0] * 1.01, "replicated gradients counted t times must show"
    assert not compare(ref, broken).ok


@pytest.mark.parametrize("name", ["sgd", "sgd_sp", "gqa_sgd", "gqa_sgd_sp", "biased_sgd_sp"])
def test_comm_log_equals_formula(models, name):
    """Every collective of a step, in order, with its bytes: 2 all-reduces of b*s*h forward and 2 backward per
    block (SP: all-gather + reduce-scatter of the same bytes, and the backward re-gather of each region's input),
    the loss's 3 scalar all-reduces, the sync."""
    t, per_rank = models
    cfg, tc, sp, *_ = RUNS[name]
    expected = _expected_ops(cfg, tc, t, sp)
    v = tc.global_batch * cfg.seq_len * cfg.d_model * 4
    blocks = [c for c in accounting.step_collectives(cfg, tc.global_batch, t, sp) if c.where.startswith("blocks.0.")]
    assert [c.tensor_bytes for c in blocks] == [v] * (10 if sp else 4)  # SP: + 2 backward re-gathers
    for r, res in enumerate(per_rank):
        for step, records in enumerate(res[name].step_comm):
            assert _ops(records) == expected, f"rank {r} step {step}"
            for rec in records:  # ring bytes per rank: (t-1)/t V, all-reduce 2(t-1)/t V
                factor = 2 if rec.op == "all_reduce" else 1
                assert rec.sent_bytes == factor * (t - 1) * rec.tensor_bytes // t


def test_sp_moves_tp_bytes_plus_the_backward_regathers(models):
    """SP's all-gather + reduce-scatter pairs move TP's all-reduce bytes; the re-gather of each region's input
    in backward (and of the LM head's) adds (t-1)/t V each."""
    t, per_rank = models
    v = 8 * 32 * 64 * 4

    def block_bytes(name: str) -> int:
        return sum(r.sent_bytes for r in per_rank[0][name].step_comm[0] if r.tensor_bytes == v)

    ends = 2 * 2 * (t - 1) * v // t  # the embedding's and the LM head's all-reduce (SP: RS + AG each)
    assert block_bytes("sgd") == CFG.n_layer * accounting.block_bytes_per_rank(8, 32, 64, t, 4) + ends
    sp_block = accounting.block_bytes_per_rank(8, 32, 64, t, 4, sequence_parallel=True)
    assert block_bytes("sgd_sp") == CFG.n_layer * sp_block + ends + (t - 1) * v // t  # + the LM head's re-gather
    assert block_bytes("sgd_sp") - block_bytes("sgd") == (2 * CFG.n_layer + 1) * (t - 1) * v // t


def test_padded_vocabulary_is_masked_out_of_the_loss():
    """257 tokens padded to 260 rows: the padded logits are -inf, the loss is the cross-entropy over the 257 real
    ones, and the padded rows of the LM head get no gradient."""
    model = GPT(PADDED)
    assert model.tok_emb.weight.shape[0] == model.lm_head.weight.shape[0] == PADDED.padded_vocab_size == 260
    x, y = global_batch(0, 2, PADDED.seq_len, 0)
    logits = model(x)
    assert bool((logits[..., 257:] == float("-inf")).all()) and bool(torch.isfinite(logits[..., :257]).all())
    loss = lm_loss(logits, y)
    assert loss.item() == F.cross_entropy(logits[..., :257].reshape(-1, 257), y.reshape(-1)).item()
    loss.backward()
    assert bool((model.lm_head.weight.grad[257:] == 0).all()) and bool(model.lm_head.weight.grad[:257].any())
    assert param_count(PADDED) == sum(p.numel() for p in model.parameters())
    stage = Stage(model, 0, 1, range(PADDED.n_layer))  # a pipeline stage runs GPT.head on the same LM head
    assert bool((stage(x)[..., 257:] == float("-inf")).all())


@pytest.mark.parity
def test_missing_f_backward_breaks_parity(models):
    _t, per_rank = models
    assert not compare(baseline(CFG, SGD), per_rank[0]["broken_no_f_backward"]).ok


def test_overlapped_tp_replaces_the_forward_all_gathers_by_ring_sends(models):
    """With the collective matmul, each forward all-gather of a region (and of the LM head) becomes t - 1 sends of
    one s/t shard: the same bytes, by our own send/recv."""
    t, per_rank = models
    v = 8 * GQA.seq_len * GQA.d_model * 4
    planned = accounting.step_collectives(GQA, 8, t, True)
    gathers = [c for c in planned if c.phase == "forward" and c.op == "all_gather"]
    for res in per_rank:
        step = res["overlap_sgd_sp"].step_comm[0]
        sends = [rec for rec in step if rec.op == "send"]
        assert len(sends) == len(gathers) * (t - 1) and {rec.sent_bytes for rec in sends} == {v // t}
        assert sum(rec.sent_bytes for rec in sends) == sum((t - 1) * c.tensor_bytes // t for c in gathers)
        backward_gathers = [c for c in planned if c.phase == "backward" and c.op == "all_gather"]
        assert len([rec for rec in step if rec.op == "all_gather"]) == len(backward_gathers)


@pytest.mark.parity
def test_sp_without_the_backward_regather_breaks_parity(models):
    """Weight gradients from each rank's own s/t tokens (the shard saved, never re-gathered) are a t-th of the
    sum: the q/k/v, gate/up and fc1 weights drift."""
    _t, per_rank = models
    report = compare(baseline(CFG, SGD), per_rank[0]["broken_no_regather"])
    assert not report.ok
    assert any("fc1" in p or "q_proj" in p for p in report.problems), report.problems


@pytest.mark.parity
def test_forgotten_norm_gradient_sync_under_sp_breaks_parity(models):
    _t, per_rank = models
    report = compare(baseline(CFG, SGD), per_rank[0]["broken_norm_sync"])
    assert not report.ok
    assert any("norm" in p for p in report.problems), report.problems


@pytest.mark.parity
def test_gathering_the_logits_is_caught_by_the_bytes(models):
    """Gathering the logits gives the right loss (parity passes) but moves b*s*V instead of 3 x b*s fp32."""
    t, per_rank = models
    broken = per_rank[0]["broken_gathered_logits"]
    assert_parity(baseline(CFG, SGD), broken)
    assert _ops(broken.step_comm[0]) != _expected_ops(CFG, SGD, t, False)
    gathered = [r for r in broken.step_comm[0] if r.op == "all_gather"]
    assert [r.tensor_bytes for r in gathered] == [8 * 32 * 256 * 4]


@pytest.mark.parity
def test_wrong_gqa_split_breaks_parity(models):
    _t, per_rank = models
    result = per_rank[0]["broken_gqa_split"]
    if isinstance(result, str):  # t=2: query heads 0, 1 would read K/V heads 0, 1 but the rank holds only head 0
        assert "read K/V heads" in result
    else:
        assert not compare(baseline(GQA, SGD), result).ok


@pytest.mark.parametrize("case, words", [
    ("n_head", ["n_head=6", "t=4"]), ("d_ff", ["d_ff=65"]),
    ("vocab", ["vocab_size=255", "make_vocab_size_divisible_by"]),
    ("seq_len", ["size 6", "divisible by"]), ("style", ["diagonal"]), ("pattern", ["blocks.*.attention"]),
    ("module_type", ["blocks.0.mlp", "MLP"]), ("mesh_and_group", ["either mesh"]), ("no_plan", ["plan="]),
    ("targets", ["do not match"]), ("target_range", ["rank", "outside the vocabulary", "ignore_index=-100"]),
    ("negative_target", ["target -1", "outside the vocabulary"]),
])
def test_clear_errors(models, case, words):
    t, per_rank = models
    message = per_rank[0]["errors"][case]
    if t == 2 and case in ("n_head", "seq_len"):  # 6 heads and 6 tokens do split over 2 ranks
        assert message == "no error"
        return
    assert message != "no error", case
    for w in words:
        assert w in message, message


# ----------------------------------------------------------------------------------------------------------------
# DTensor parallelize_module + loss_parallel


@pytest.mark.parity
@pytest.mark.slow
@pytest.mark.parametrize("name", list(DTENSOR_RUNS))
def test_dtensor_matches_one_process_and_ours(dtensor, name):
    t, per_rank = dtensor
    cfg, tc, _sp = DTENSOR_RUNS[name]
    ref, ours, theirs = baseline(cfg, tc), per_rank[0]["ours", name], per_rank[0]["dtensor", name]
    print(f"t={t} {name} DTensor: {assert_parity(ref, theirs)}")
    print(f"t={t} {name} ours: {assert_parity(ref, ours)}")
    print(f"t={t} {name} ours vs DTensor: {assert_parity(theirs, ours, noise=ref.noise)}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sgd", "sgd_sp", "swiglu_sgd_sp"])
def test_ledger_equals_dtensors_collectives(dtensor, name):
    """Forward and backward: the same collectives with the same bytes in the same order, but for our SP's
    backward re-gathers of the saved s/t inputs (DTensor's SequenceParallel saves the gathered input) and the
    norms' partial gradients under SP -- ours one flat all-reduce in finish_gradient_sync, DTensor one all-reduce
    per parameter when the optimizer first reads its Partial gradient; the same bytes in more calls."""
    t, per_rank = dtensor
    cfg, tc, sp = DTENSOR_RUNS[name]
    regathers = {i for i, c in enumerate(accounting.step_collectives(cfg, tc.global_batch, t, sp)) if c.regather}
    assert len(regathers) == (2 * cfg.n_layer + 1 if sp else 0)
    for res in per_rank:
        ours_all, theirs = res["ours", name].step_comm[0], res["dtensor", name].step_comm[0]
        ours = [rec for i, rec in enumerate(ours_all) if i not in regathers]  # DTensor keeps the gathered input
        ours_main, ours_sync = ours[:len(ours) - (1 if _sp_run(name) else 0)], ours[len(ours) - 1:]
        assert _ops(theirs[:len(ours_main)]) == _ops(ours_main)
        rest = theirs[len(ours_main):]
        if _sp_run(name):
            assert {r.op for r in rest} == {"all_reduce"} and len(rest) > 1
            assert sum(r.tensor_bytes for r in rest) == ours_sync[0].tensor_bytes
        else:
            assert rest == []
        assert sum(r.sent_bytes for r in theirs) == sum(r.sent_bytes for r in ours)  # bytes ratio 1.00
        assert all(ours_all[i].op == "all_gather" for i in regathers)


def _sp_run(name: str) -> bool:
    return DTENSOR_RUNS[name][2]
