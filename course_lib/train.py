"""The single-process baseline every chapter is checked against, and the parity check itself.

A parallel implementation is *correct* when, trained on the same global batches from the same initial weights,
it produces the same per-step losses and the same final parameters as ``train_baseline`` -- up to floating-point
reassociation (fp32, default tolerance |a - b| <= atol + rtol * |b| with rtol = 1e-5, atol = 1e-6).

Conditioning, measured: Adam divides each gradient by its own running RMS, so a parameter whose true gradient is
~0 turns rounding noise into steps of size ~lr. The key bias of attention is such a parameter (softmax ignores a
shift shared by all scores, so d loss / d k_bias = 0 exactly): with ``bias=True`` and AdamW at lr 1e-2 a *correct*
data-parallel run differs from the baseline by 7.6e-5. Parity runs therefore use ``PARITY_MODEL`` (no biases) and
AdamW at lr 1e-3 (the ``TrainConfig`` default), or SGD -- which also catches a missing 1/N that Adam would hide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from course_lib.data import global_batch, micro_batches
from course_lib.model import GPT, GPTConfig, lm_loss, moe_aux_loss

RTOL = 1e-5
ATOL = 1e-6
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


@dataclass
class TrainResult:
    """Per-step losses (mean over the global batch) and the final full parameters, by name."""

    losses: list[float]
    params: dict[str, torch.Tensor] = field(repr=False)


def make_optimizer(params: list[nn.Parameter] | list[torch.Tensor], tc: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer of ``tc`` over ``params`` (plain for-loop implementation: identical across layouts)."""
    if tc.optimizer == "sgd":
        return torch.optim.SGD(params, lr=tc.lr, momentum=tc.momentum, weight_decay=tc.weight_decay,
                               foreach=False)
    if tc.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay, foreach=False)
    raise ValueError(f"unknown optimizer {tc.optimizer!r}: use 'sgd' or 'adamw'")


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached fp32 CPU copies of every parameter, by name (what parity compares; CPU so that results of ranks
    on GPUs travel back and compare with the single-process baseline)."""
    return {k: v.detach().float().cpu().clone() for k, v in model.named_parameters()}


def train_baseline(cfg: GPTConfig, tc: TrainConfig = TrainConfig(),
                   model_fn: Callable[[GPTConfig, int], nn.Module] = GPT, freeze: Iterable[str] = (),
                   accumulation: int = 1) -> TrainResult:
    """Train ``model_fn(cfg, tc.seed)`` (the GPT by default) on one process: the reference for every parallel
    layout. Parameters named in ``freeze`` get ``requires_grad=False`` and stay out of the optimizer.
    The loss is the LM loss plus the MoE router losses (``moe_aux_loss``; 0 for a dense model). With
    ``accumulation`` = m each step's batch is split into m micro-batches, each loss scaled by 1/m."""
    model = model_fn(cfg, tc.seed)
    frozen = set(freeze)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], tc)
    losses = []
    for step in range(tc.steps):
        x, y = global_batch(step, tc.global_batch, cfg.seq_len, tc.seed)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xm, ym in micro_batches(x, y, accumulation):
            loss = (lm_loss(model(xm), ym) + moe_aux_loss(model)) / accumulation
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return TrainResult(losses, full_params(model))


@dataclass
class ParityReport:
    """How far a candidate run is from the reference: max |diff| of losses and of parameters."""

    max_loss_diff: float
    max_param_diff: float
    worst_param: str
    rtol: float
    atol: float
    ok: bool
    problems: list[str]

    def __str__(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        text = (f"parity {verdict}: max |loss diff| = {self.max_loss_diff:.3e}, "
                f"max |param diff| = {self.max_param_diff:.3e} ({self.worst_param}); "
                f"tolerance |a-b| <= {self.atol:g} + {self.rtol:g}*|ref|")
        return "\n".join([text, *self.problems[:10]])


def _within(a: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> bool:
    return bool(((a - ref).abs() <= atol + rtol * ref.abs()).all())


def compare(reference: TrainResult, candidate: TrainResult, rtol: float = RTOL, atol: float = ATOL) -> ParityReport:
    """Compare per-step losses and final parameters of ``candidate`` with ``reference``."""
    problems = []
    ref_l, cand_l = torch.tensor(reference.losses, dtype=torch.float64), torch.tensor(candidate.losses,
                                                                                        dtype=torch.float64)
    if ref_l.shape != cand_l.shape:
        problems.append(f"{len(candidate.losses)} losses, expected {len(reference.losses)}")
        max_loss = float("inf")
    else:
        max_loss = float((ref_l - cand_l).abs().max()) if ref_l.numel() else 0.0
        if not _within(cand_l, ref_l, rtol, atol):
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
            max_param, worst = float("inf"), name
            continue
        diff = float((ref - got).abs().max()) if ref.numel() else 0.0
        if diff > max_param:
            max_param, worst = diff, name
        if not _within(got, ref, rtol, atol):
            problems.append(f"{name}: max |diff| {diff:.3e}")
    if not reference.params:
        problems.append("the reference has no parameters: nothing was compared")
    return ParityReport(max_loss, max_param, worst, rtol, atol, not problems, problems)


def assert_parity(reference: TrainResult, candidate: TrainResult, rtol: float = RTOL, atol: float = ATOL) -> \
        ParityReport:
    """``compare`` and raise ``AssertionError`` with the report when it fails; return the report otherwise."""
    report = compare(reference, candidate, rtol, atol)
    if not report.ok:
        raise AssertionError(str(report))
    return report
