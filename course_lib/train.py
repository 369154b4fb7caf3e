"""The single-process baseline every chapter is checked against, and the parity check itself.

A parallel implementation is *correct* when, trained on the same global batches from the same initial weights,
it produces the same per-step losses and the same final parameters as ``train_baseline`` -- up to floating-point
reassociation: fp32 sums added in another order (other shards, micro-batches, all-reduce groupings, CPU kernels).

The tolerance is derived from that noise, measured, never tuned. ``train_baseline`` trains the same problem twice:
in float32 (the reference) and in float64 (the same initial weights and batches; its own rounding, ~1e-16, is
negligible). Their difference is the float32 rounding error of the reference, on this machine's kernels
(``Fp32Noise``): n = max |p_fp32 - p_fp64| over every parameter element, n_loss = max |loss_fp32 - loss_fp64| over
the steps. ``compare`` accepts, element by element (parameters with n, losses with n_loss),

    |candidate - reference| <= NOISE_MULTIPLE * n + FLOOR_ULPS * u * |reference|     (u = 2^-24, fp32's roundoff)

Why: candidate and reference are two fp32 evaluations of one exact result, so |c - r| <= |c - exact| + |r - exact|;
a sum's rounding bound, (k-1) u sum|x_i| for k terms, is the same for every order (Higham, *Accuracy and Stability
of Numerical Algorithms*, 2nd ed., section 4.2), so a correct candidate's error is of the reference's size: about
2 n apart, and NOISE_MULTIPLE = 8 leaves a factor 4 for the candidate's extra additions (partial sums over ranks).
n is the whole run's maximum, not each tensor's: after one step every gradient depends on every parameter, so the
error is the run's, and where it shows is chance -- under AdamW a parameter whose gradient is ~0 turns its rounding
into a step of ~lr x rounding / eps (the conditioning note below), and which of those elements the candidate's
order hits hardest differs from the reference's (measured, expert parallelism with 2 micro-batches on AVX-512: an
attention weight 5.4e-7 from the reference, 15x that tensor's own fp32 error of 3.7e-8, 1/16 of the run's n of
8.7e-6). The floor, FLOOR_ULPS ulps of the value, covers a value whose rounding exceeds n by chance (a loss of ~5
has ulps of 5e-7). A plausible bug moves parameters by a fraction of an
update (lr x gradient, >= 1e-5 here), hundreds of tolerances: ``ParityReport.worst_ratio`` says how many.
Comparisons that are not with a baseline (ours against PyTorch's, two layouts) pass the baseline's ``noise``; an
explicit ``rtol``/``atol`` replaces the rule where a test states its own (0, 0: exact).

Conditioning, measured: Adam divides each gradient by its own running RMS, so a parameter whose true gradient is
~0 turns rounding noise into steps of size ~lr. The key bias of attention is such a parameter (softmax ignores a
shift shared by all scores, so d loss / d k_bias = 0 exactly): with ``bias=True`` and AdamW at lr 1e-2 a *correct*
data-parallel run differs from the baseline by 7.6e-5. The float64 run measures that too (n grows with it), but a
tolerance that large would hide bugs: parity runs use ``PARITY_MODEL`` (no biases) and AdamW at lr 1e-3 (the
``TrainConfig`` default), or SGD -- which also catches a missing 1/N that Adam would hide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from course_lib.data import global_batch, micro_batches
from course_lib.model import GPT, lm_loss
from course_lib.model_config import GPTConfig
from course_lib.moe import moe_aux_loss

NOISE_MULTIPLE = 8.0
"""How many times the reference's own measured fp32 error a correct candidate may differ by (module docstring)."""
FLOOR_ULPS = 8.0
"""The tolerance's floor, in units of fp32's roundoff u = 2^-24 times |reference|."""
UNIT_ROUNDOFF = 2.0 ** -24
PARITY_MODEL = GPTConfig(bias=False)
"""The tiny GPT without biases: what parity runs train (see the conditioning note above)."""


@dataclass(frozen=True)
class TrainConfig:
    """What every parity run shares: steps, global batch (rows per optimizer step, over all ranks), optimizer."""

    steps: int = 3
    global_batch: int = 8
    lr: float = 1e-3
    optimizer: Literal["sgd", "adamw"] = "adamw"
    weight_decay: float = 0.01
    momentum: float = 0.9
    seed: int = 0


@dataclass(frozen=True)
class Fp32Noise:
    """The float32 rounding error of a run, measured against the same run in float64: ``losses[s]`` =
    |loss_fp32 - loss_fp64| at step s, ``params[name]`` = max |p_fp32 - p_fp64| over that tensor's elements."""

    losses: list[float]
    params: dict[str, float]

    def largest(self) -> tuple[float, str]:
        """n: the largest parameter noise, and the tensor it is on."""
        name = max(self.params, key=self.params.__getitem__, default="-")
        return self.params.get(name, 0.0), name

    def loss(self) -> float:
        """n_loss: the largest loss noise over the steps."""
        return max(self.losses, default=0.0)


@dataclass
class TrainResult:
    """Per-step losses (mean over the global batch) and the final full parameters, by name; ``noise``: the fp32
    rounding error of this run where it was measured (``train_baseline`` does), else None."""

    losses: list[float]
    params: dict[str, torch.Tensor] = field(repr=False)
    noise: Fp32Noise | None = field(default=None, repr=False, kw_only=True)

    def from_step(self, step: int) -> TrainResult:
        """The losses from ``step`` on, the same final parameters and noise (the whole run's): what a run resumed
        at ``step`` from a checkpoint of this one must match."""
        return TrainResult(self.losses[step:], self.params, noise=self.noise)


def optimizer_spec(tc: TrainConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class of ``tc`` and its keywords (plain for-loop implementation: identical across layouts;
    ZeRO-1 builds the same optimizer over each rank's partition)."""
    if tc.optimizer == "sgd":
        return torch.optim.SGD, {"lr": tc.lr, "momentum": tc.momentum, "weight_decay": tc.weight_decay,
                                 "foreach": False}
    if tc.optimizer == "adamw":
        return torch.optim.AdamW, {"lr": tc.lr, "weight_decay": tc.weight_decay, "foreach": False}
    raise ValueError(f"unknown optimizer {tc.optimizer!r}: use 'sgd' or 'adamw'")


def make_optimizer(params: list[nn.Parameter] | list[torch.Tensor], tc: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer of ``tc`` over ``params``."""
    cls, kwargs = optimizer_spec(tc)
    return cls(params, **kwargs)


def copy_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of every parameter, by name, in fp32 (fp64 stays fp64): what parity compares; CPU so
    that results of ranks on GPUs travel back and compare with the single-process baseline."""
    return {k: v.detach().cpu().to(torch.promote_types(v.dtype, torch.float32)).clone()
            for k, v in model.named_parameters()}


def with_fp32_noise(train: Callable[[torch.dtype], TrainResult]) -> TrainResult:
    """``train(torch.float32)``, carrying its ``Fp32Noise`` measured against ``train(torch.float64)``: ``train``
    must build its model in the dtype it is given (``model_fn(cfg, seed).to(dtype)``) and train it exactly as in
    fp32. Wrap a test's own single-process reference in this to compare with the module docstring's rule."""
    fp32, fp64 = train(torch.float32), train(torch.float64)
    if fp32.params.keys() != fp64.params.keys() or len(fp32.losses) != len(fp64.losses):
        raise ValueError("with_fp32_noise: the float32 and float64 runs returned different steps or parameters")
    params = {k: float((v.double() - fp64.params[k].double()).abs().max()) if v.numel() else 0.0
              for k, v in fp32.params.items()}
    losses = [abs(a - b) for a, b in zip(fp32.losses, fp64.losses, strict=True)]
    fp32.noise = Fp32Noise(losses, params)
    return fp32


Batch = tuple[torch.Tensor, torch.Tensor]


def train_single(cfg: GPTConfig, tc: TrainConfig = TrainConfig(),
                 model_fn: Callable[[GPTConfig, int], nn.Module] | None = None, freeze: Iterable[str] = (),
                 accumulation: int = 1, dtype: torch.dtype = torch.float32, *,
                 split: Callable[[torch.Tensor, torch.Tensor], list[Batch]] | None = None) -> TrainResult:
    """One single-process run of ``model_fn`` (default the GPT) in ``dtype`` (the loss in at least fp32, as the
    parallel forms compute it), without its noise: ``train_baseline`` runs it in fp32 and fp64; chapter 11 in
    bf16, in two reduction orders. ``split``: as ``train_baseline``'s."""
    model = (model_fn or GPT)(cfg, tc.seed).to(dtype)
    frozen = set(freeze)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], tc)
    losses = []
    for step in range(tc.steps):
        x, y = global_batch(step, tc.global_batch, cfg.seq_len, tc.seed)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        micro = micro_batches(x, y, accumulation) if split is None else split(x, y)
        for xm, ym in micro:
            logits = model(xm)
            loss = (lm_loss(logits.to(torch.promote_types(logits.dtype, torch.float32)), ym)
                    + moe_aux_loss(model)) / len(micro)
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return TrainResult(losses, copy_parameters(model))


def train_baseline(cfg: GPTConfig, tc: TrainConfig = TrainConfig(),
                   model_fn: Callable[[GPTConfig, int], nn.Module] | None = None, freeze: Iterable[str] = (),
                   accumulation: int = 1, *,
                   split: Callable[[torch.Tensor, torch.Tensor], list[Batch]] | None = None) -> TrainResult:
    """Train ``model_fn(cfg, tc.seed)`` (the GPT by default) on one process: the reference for every parallel
    layout. Parameters named in ``freeze`` get ``requires_grad=False`` and stay out of the optimizer.
    The loss is the LM loss plus the MoE router losses (``moe_aux_loss``; 0 for a dense model). With
    ``accumulation`` = m each step's batch is split into m micro-batches, each loss scaled by 1/m; ``split``
    (x, y) -> micro-batches replaces that cut (``parallel.moe_reference``: the micro-batches a mesh's ranks hold).
    The result carries its fp32 rounding error (``noise``, from a second run in float64: ``with_fp32_noise``)."""
    return with_fp32_noise(lambda dtype: train_single(cfg, tc, model_fn, freeze, accumulation, dtype, split=split))


@dataclass
class ParityReport:
    """How far a candidate run is from the reference: max |diff| of losses and of parameters, and
    ``worst_ratio``, the largest |diff| / tolerance over every element compared (below 1 passes)."""

    max_loss_diff: float
    max_param_diff: float
    worst_param: str
    worst_ratio: float
    tolerance: str
    ok: bool
    problems: list[str]

    def __str__(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        text = (f"parity {verdict}: max |loss diff| = {self.max_loss_diff:.3e}, "
                f"max |param diff| = {self.max_param_diff:.3e} ({self.worst_param}); tolerance {self.tolerance}")
        return "\n".join([text, *self.problems[:10]])


class _Tolerance:
    """The allowed |diff| of each compared element: the noise rule, or a fixed ``atol + rtol |ref|``."""

    def __init__(self, noise: Fp32Noise | None, rtol: float | None, atol: float | None) -> None:
        self.noise, self.fixed = noise, rtol is not None or atol is not None
        self.rtol, self.atol = rtol or 0.0, atol or 0.0
        if not self.fixed and noise is None:
            raise ValueError("compare: no fp32 noise to derive the tolerance from -- the reference does not come "
                             "from train_baseline (or with_fp32_noise): pass noise=<that baseline>.noise, or a "
                             "fixed rtol/atol")

    def describe(self) -> str:
        if self.fixed:
            return f"|a-b| <= {self.atol:g} + {self.rtol:g}*|ref|"
        largest, name = self.noise.largest()
        return (f"{NOISE_MULTIPLE:g} x the fp32 noise (params {largest:.1e}, on {name}; losses "
                f"{self.noise.loss():.1e}) + {FLOOR_ULPS:g} ulp of |ref|")

    def allowed(self, ref: torch.Tensor, what: Literal["losses", "params"]) -> torch.Tensor:
        if self.fixed:
            return self.atol + self.rtol * ref.abs()
        noise = self.noise.loss() if what == "losses" else self.noise.largest()[0]
        return NOISE_MULTIPLE * noise + FLOOR_ULPS * UNIT_ROUNDOFF * ref.abs()


def _ratio(diff: torch.Tensor, allowed: torch.Tensor) -> float:
    """max |diff| / allowed (0/0 counts 0, x/0 and NaN infinite)."""
    if not diff.numel():
        return 0.0
    r = torch.where(diff == 0, torch.zeros_like(diff), diff / allowed)
    return float("inf") if bool(r.isnan().any()) else float(r.max())


def compare(reference: TrainResult, candidate: TrainResult, rtol: float | None = None, atol: float | None = None,
            noise: Fp32Noise | None = None) -> ParityReport:
    """Compare per-step losses and final parameters of ``candidate`` with ``reference``, element by element,
    within ``NOISE_MULTIPLE`` x the fp32 noise + ``FLOOR_ULPS`` ulp (the module docstring). The noise is
    ``noise``, else the reference's, else the candidate's; ``rtol``/``atol`` given: a fixed tolerance instead."""
    tol = _Tolerance(noise or reference.noise or candidate.noise, rtol, atol)
    problems, worst_ratio = [], 0.0
    ref_l, cand_l = torch.tensor(reference.losses, dtype=torch.float64), torch.tensor(candidate.losses,
                                                                                        dtype=torch.float64)
    if ref_l.shape != cand_l.shape:
        problems.append(f"{len(candidate.losses)} losses, expected {len(reference.losses)}")
        max_loss = worst_ratio = float("inf")
    else:
        max_loss = float((ref_l - cand_l).abs().max()) if ref_l.numel() else 0.0
        ratio = _ratio((ref_l - cand_l).abs(), tol.allowed(ref_l, "losses"))
        worst_ratio = max(worst_ratio, ratio)
        if ratio > 1:
            problems.append(f"losses differ: got {candidate.losses}, expected {reference.losses}")
    missing = sorted(set(reference.params) - set(candidate.params))
    extra = sorted(set(candidate.params) - set(reference.params))
    if missing:
        problems.append(f"missing parameters: {missing}")
    if extra:
        problems.append(f"unexpected parameters: {extra}")
    max_param, worst = 0.0, "-"
    for name in sorted(set(reference.params) & set(candidate.params)):
        ref, got = reference.params[name].double(), candidate.params[name].double()
        if ref.shape != got.shape:
            problems.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
            max_param, worst, worst_ratio = float("inf"), name, float("inf")
            continue
        diff = (ref - got).abs()
        biggest = float(diff.max()) if ref.numel() else 0.0
        if biggest > max_param:
            max_param, worst = biggest, name
        ratio = _ratio(diff, tol.allowed(ref, "params"))
        worst_ratio = max(worst_ratio, ratio)
        if ratio > 1:
            problems.append(f"{name}: max |diff| {biggest:.3e}")
    if not reference.params:
        problems.append("the reference has no parameters: nothing was compared")
    return ParityReport(max_loss, max_param, worst, worst_ratio, tol.describe(), not problems, problems)


def assert_parity(reference: TrainResult, candidate: TrainResult, rtol: float | None = None,
                  atol: float | None = None, noise: Fp32Noise | None = None) -> ParityReport:
    """``compare`` and raise ``AssertionError`` with the report when it fails; return the report otherwise."""
    report = compare(reference, candidate, rtol, atol, noise)
    if not report.ok:
        raise AssertionError(str(report))
    return report
