"""Model states per parameter: the precision policy, the optimizer's state, and ZeRO's sharding of them.

Conventions (bytes per parameter):

* Mixed-precision Adam keeps 2 (bf16 weights) + 2 (bf16 grads) + 4 (fp32 master weights) + 4 + 4 (fp32 Adam
  m and v) = 16 bytes per parameter; in the notation of ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory
  Optimizations Toward Training Trillion Parameter Models", Sec. 3.1) that is 2Ψ + 2Ψ + KΨ with K = 12.
  With a separate fp32 gradient-accumulation buffer, add 4 (20 bytes/param; we count it with the gradients).
  Megatron-LM's distributed optimizer keeps only the fp32 main grad (2 + 4 + 12 = 18): a different convention.
* ZeRO per device (N_d data-parallel ranks): baseline (4+K)Ψ; ZeRO-1 4Ψ + KΨ/N_d; ZeRO-2 2Ψ + (2+K)Ψ/N_d;
  ZeRO-3 (4+K)Ψ/N_d (ZeRO paper, Sec. 5 and Figure 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from course_lib.estimates.memory_budget import check_amount, check_count
from course_lib.parallel.zero import check_stage

__all__ = [
    "PRECISIONS",
    "OptimizerName",
    "ParamBytes",
    "Precision",
    "bytes_per_param",
    "bytes_per_param_table",
    "precision_policy",
    "weight_bytes",
    "zero_memory_per_device",
]

OptimizerName = Literal["sgd", "sgd_momentum", "adam", "adamw"]


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of training state.

    * ``param_bytes``: the weights forward/backward read; ``grad_bytes``: their gradients;
    * ``master_bytes``: an fp32 master copy of the weights (mixed precision), 0 if none;
    * ``state_bytes``: each optimizer state tensor (Adam m and v, SGD momentum);
    * ``grad_accum_bytes``: a separate fp32 buffer that accumulates gradients across micro-batches;
    * ``activation_bytes``: saved activations.
    """

    name: str
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    state_bytes: int
    activation_bytes: int
    grad_accum_bytes: int = 0


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", param_bytes=4, grad_bytes=4, master_bytes=0, state_bytes=4, activation_bytes=4),
    "bf16": Precision("bf16", param_bytes=2, grad_bytes=2, master_bytes=0, state_bytes=2, activation_bytes=2),
    "mixed": Precision("mixed", param_bytes=2, grad_bytes=2, master_bytes=4, state_bytes=4, activation_bytes=2),
}


def precision_policy(name: str | Precision = "mixed", fp32_grad_accum: bool = False) -> Precision:
    """One of ``PRECISIONS``: "fp32"; "bf16" (pure bf16: weights, grads and optimizer states all 16-bit);
    "mixed" (bf16 weights/grads/activations, fp32 master weights and optimizer states). ``fp32_grad_accum``
    adds a 4-byte gradient-accumulation buffer (meaningless for fp32, whose grads already are fp32)."""
    p = name if isinstance(name, Precision) else PRECISIONS.get(name)
    if p is None:
        raise ValueError(f"unknown precision {name!r}; choose one of {sorted(PRECISIONS)}")
    if fp32_grad_accum:
        if p.grad_bytes == 4:
            raise ValueError("fp32 gradient accumulation only makes sense when gradients are 16-bit")
        p = Precision(f"{p.name}+fp32acc", p.param_bytes, p.grad_bytes, p.master_bytes, p.state_bytes,
                      p.activation_bytes, grad_accum_bytes=4)
    return p


_OPT_STATES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}


@dataclass(frozen=True)
class ParamBytes:
    """Bytes per parameter of training state, split as ZeRO splits it.

    ``params`` (sharded by ZeRO-3), ``grads`` incl. any fp32 accumulation buffer (sharded from ZeRO-2), and
    ``optimizer`` = fp32 master copy + optimizer states, which is ZeRO's K (sharded from ZeRO-1).
    """

    params: int
    grads: int
    optimizer: int

    @property
    def K(self) -> int:  # noqa: N802  (ZeRO's notation)
        """ZeRO's K: optimizer-state bytes per parameter (12 for mixed-precision Adam)."""
        return self.optimizer

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def bytes_per_param(precision: str | Precision = "mixed", optimizer: OptimizerName = "adamw",
                    fp32_grad_accum: bool = False) -> ParamBytes:
    """Bytes per parameter for a precision policy and optimizer.

    K = master + n_states * state_bytes, with n_states = 0 (SGD), 1 (SGD with momentum), 2 (Adam/AdamW).
    Examples: mixed + Adam = 2 + 2 + (4 + 4 + 4) = 16 (K = 12), +4 with ``fp32_grad_accum``; fp32 + Adam =
    4 + 4 + 8 = 16; pure bf16 + Adam = 2 + 2 + 4 = 8; mixed + SGD = 2 + 2 + 4 = 8 (the master copy stays).
    """
    if optimizer not in _OPT_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {sorted(_OPT_STATES)}")
    p = precision_policy(precision, fp32_grad_accum)
    return ParamBytes(params=p.param_bytes, grads=p.grad_bytes + p.grad_accum_bytes,
                      optimizer=p.master_bytes + _OPT_STATES[optimizer] * p.state_bytes)


def bytes_per_param_table() -> list[dict[str, Any]]:
    """Every precision x optimizer combination: rows of {precision, optimizer, params, grads, optimizer, K,
    total} (bytes per parameter). ``fp32_grad_accum`` rows are added for the 16-bit policies."""
    rows = []
    for prec in PRECISIONS:
        for acc in (False, True):
            if acc and PRECISIONS[prec].grad_bytes == 4:
                continue
            for opt in _OPT_STATES:
                pb = bytes_per_param(prec, opt, fp32_grad_accum=acc)  # type: ignore[arg-type]
                rows.append({"precision": precision_policy(prec, acc).name, "optimizer": opt, "params": pb.params,
                             "grads": pb.grads, "optimizer_state": pb.optimizer, "K": pb.K, "total": pb.total})
    return rows


def weight_bytes(n_params: float, bytes_per_weight: float = 2) -> float:
    """Resident weights: n_params x bytes (bf16 = 2, int8 = 1, int4 = 0.5). 70e9 in bf16 = 140 GB."""
    check_amount("n_params", n_params)
    check_amount("bytes_per_weight", bytes_per_weight, positive=True)
    return n_params * bytes_per_weight


def zero_memory_per_device(psi: float, K: float = 12, N_d: int = 1, stage: int = 0,
                           param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Model-state bytes per data-parallel rank under ZeRO (Rajbhandari et al. 2020, Sec. 5, Figure 1).

    With Ψ parameters, K optimizer bytes per parameter and N_d ranks (16-bit params and grads by default):

    * stage 0 (plain DP): (2 + 2 + K)Ψ
    * stage 1 (P_os, optimizer states sharded): (2 + 2)Ψ + KΨ/N_d
    * stage 2 (P_os+g, + gradients): 2Ψ + (2 + K)Ψ/N_d
    * stage 3 (P_os+g+p, + parameters): (2 + 2 + K)Ψ/N_d

    The paper's example: Ψ = 7.5B, K = 12, N_d = 64 gives 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
    """
    check_stage(stage)
    check_count("N_d", N_d)
    for name, value in (("psi", psi), ("K", K), ("param_bytes", param_bytes), ("grad_bytes", grad_bytes)):
        check_amount(name, value)
    p = param_bytes * psi / (N_d if stage >= 3 else 1)
    g = grad_bytes * psi / (N_d if stage >= 2 else 1)
    o = K * psi / (N_d if stage >= 1 else 1)
    return p + g + o
