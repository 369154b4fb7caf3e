"""What parallel training costs, on paper: pipeline bubbles, collective communication, FLOPs and MFU.

Units: bytes, seconds, bytes per second, FLOPs; GB and TB are decimal (1e9, 1e12), as vendors write them.

Communication uses the alpha-beta model: a message of ``s`` bytes between two ranks takes ``alpha + s / beta``
(``alpha`` latency in seconds, ``beta`` bandwidth in bytes/s of one direction of the link). A collective on n
ranks runs ``steps`` such messages one after the other (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan
2009), so its time is ``steps * (alpha + bytes_per_step / beta)``; for the ring algorithms that is
``steps * alpha + bytes_per_rank / beta``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from course_lib.parallel.schedules import SCHEDULE_NAMES

# ------------------------------------------------------------------------------------------ pipelines

ScheduleName = Literal["gpipe", "one_f_one_b", "interleaved_one_f_one_b", "zb_h1"]


def bubble_ratio(schedule: ScheduleName, p: int, m: int, v: int = 1) -> float:
    """Megatron-LM's bubble time over ideal time (Narayanan et al. 2021), for p stages of equal cost.

    * ``gpipe``, ``one_f_one_b``: (p-1)/m: the warm-up and cool-down last (p-1) (t_f + t_b), the ideal m (t_f + t_b);
    * ``interleaved_one_f_one_b``: (p-1)/(v*m): each of the v chunks costs 1/v of a stage, so does each bubble step
      (exact in ``simulate`` for m >= p, p dividing m or not: ``schedules.interleaved_groups``);
    * ``zb_h1``: (p-1)/(3m) when F, I (backward for the input) and W (for the weights) cost the same. In general
      the ZB-H1 bubble is (p-1)(t_f + t_i - t_w) (Qi et al. 2023); ``schedule_run.simulate`` reproduces it exactly
      when t_w <= min(t_f, t_i) and m >= p, so this formula refuses m < p.

    ``schedule_run.simulate(...).bubble_ratio`` gives the same numbers for the schedules of
    ``course_lib.parallel.schedules``.
    """
    _check_pipeline(schedule, p, m, v)
    if schedule == "interleaved_one_f_one_b":
        return (p - 1) / (v * m)
    if schedule == "zb_h1":
        return (p - 1) / (3 * m)
    return (p - 1) / m


def bubble_fraction(schedule: ScheduleName, p: int, m: int, v: int = 1) -> float:
    """Idle share of all rank-time: bubble / (ideal + bubble) = r / (1 + r) with r = ``bubble_ratio``.

    GPipe and 1F1B: (p-1)/(m+p-1) (Huang et al. 2019); interleaved: (p-1)/(v*m + p-1); ZB-H1 with equal
    F, I, W costs: (p-1)/(3m + p-1).
    """
    ratio = bubble_ratio(schedule, p, m, v)
    return ratio / (1 + ratio)


def _check_pipeline(schedule: str, p: int, m: int, v: int) -> None:
    for name, value in (("p", p), ("m", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {schedule!r}: {', '.join(SCHEDULE_NAMES)} (schedules.SCHEDULE_ALIASES "
                         f"maps the other accepted names to these)")
    if schedule != "interleaved_one_f_one_b" and v != 1:
        raise ValueError(f"{schedule} has one stage per rank: v must be 1, got {v}")
    if schedule == "interleaved_one_f_one_b" and m < p:
        raise ValueError(f"the interleaved 1F1B bubble formula holds for m >= p (groups of at least p micro-batches); "
                         f"got m={m} < p={p}")
    if schedule == "zb_h1" and m < p:
        raise ValueError(f"the ZB-H1 bubble formula holds for m >= p; got m={m} < p={p}")


# -------------------------------------------------------------------------------------- collectives

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]


def collective_steps(op: Collective, nbytes: float, n: int) -> tuple[int, float]:
    """(number of sequential messages, bytes in each) of the classic algorithm for ``op`` on ``n`` ranks.

    ``nbytes`` (V) is the full tensor: the all-reduced tensor, the gathered output of all_gather, the input of
    reduce_scatter, each rank's send buffer of all_to_all, the broadcast tensor.

    * all_reduce: ring reduce-scatter then ring all-gather, 2(n-1) steps of V/n;
    * all_gather, reduce_scatter: ring, n-1 steps of V/n;
    * all_to_all: n-1 rounds, each rank sending V/n to one other rank per round (pairwise exchange);
    * broadcast: binomial tree, ceil(log2 n) steps of the whole V (MPICH's short-message algorithm; NCCL
      pipelines a ring instead, which approaches (n-1) alpha + V/beta for large V).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (number of ranks) must be a positive integer, got {n!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if op == "all_reduce":
        return 2 * (n - 1), nbytes / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1, nbytes / n
    if op == "broadcast":
        return math.ceil(math.log2(n)), nbytes
    raise ValueError(f"unknown collective {op!r}: all_reduce, all_gather, reduce_scatter, all_to_all or broadcast")


def collective_bytes_per_rank(op: Collective, nbytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in ``op`` over V = ``nbytes`` on ``n`` ranks.

    all_gather, reduce_scatter, all_to_all: (n-1)/n * V; all_reduce: 2(n-1)/n * V. broadcast: V, what every
    rank but the root receives (the tree's root sends ceil(log2 n) * V).
    """
    steps, step_bytes = collective_steps(op, nbytes, n)
    if op == "broadcast":
        return float(nbytes) if n > 1 else 0.0
    return steps * step_bytes


def collective_time(op: Collective, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Alpha-beta time of ``op``: steps * (alpha + bytes_per_step / beta), alpha in s, beta in bytes/s."""
    if alpha < 0 or beta <= 0:
        raise ValueError(f"need alpha >= 0 (seconds) and beta > 0 (bytes/s), got alpha={alpha}, beta={beta}")
    steps, step_bytes = collective_steps(op, nbytes, n)
    return steps * (alpha + step_bytes / beta)


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of ``time = alpha + size / beta``; returns (alpha in s, beta in bytes/s).

    For point-to-point timings pass the message sizes; for a collective, divide each time by its step count
    and pass the bytes per step (``collective_steps``).
    """
    if len(sizes) != len(times):
        raise ValueError(f"sizes and times differ in length: {len(sizes)} vs {len(times)}")
    if len(set(sizes)) < 2:
        raise ValueError("fitting a line needs at least two different message sizes")
    n = len(sizes)
    mean_s, mean_t = sum(sizes) / n, sum(times) / n
    slope = sum((s - mean_s) * (t - mean_t) for s, t in zip(sizes, times, strict=True)) / sum(
        (s - mean_s) ** 2 for s in sizes
    )
    if slope <= 0:
        raise ValueError(f"time does not grow with size (slope {slope:.3g} s/byte): no bandwidth to fit")
    return mean_t - slope * mean_s, 1 / slope


# ----------------------------------------------------------------------------------------- FLOPs, MFU


def training_flops_per_token(
    n_params: float, n_layer: int = 0, d_model: int = 0, seq_len: int = 0, full_recompute: bool = False
) -> float:
    """FLOPs to train on one token, forward + backward (a multiply-add counts as 2 FLOPs).

    Weights: 2N forward and 4N backward, 6N (Kaplan et al. 2020), N being the parameters that take part in
    matrix multiplies (leave out the input embedding lookup; keep the output head). Attention scores and their
    weighted sum add 4 * L * h * s forward per token, 12 * L * h * s in all (Chowdhery et al. 2022, PaLM,
    appendix B; s the sequence length, not halved for a causal mask). Full activation recomputation runs the
    forward twice: + 2N + 4 * L * h * s. Leave it False for MFU, which counts model FLOPs only; True gives
    the hardware FLOPs (HFU).
    """
    forward = 2 * n_params + 4 * n_layer * d_model * seq_len
    return 3 * forward + (forward if full_recompute else 0)


def mfu(
    tokens_per_s: float,
    n_params: float,
    peak_flops: float,
    n_gpus: int = 1,
    n_layer: int = 0,
    d_model: int = 0,
    seq_len: int = 0,
) -> float:
    """Model FLOPs utilisation: model FLOPs per second achieved over the peak of the ``n_gpus`` devices.

    ``tokens_per_s`` is the whole job's throughput; ``peak_flops`` one device's dense peak
    (``hardware.gpu(key).peak_flops``). Recomputation does not count (PaLM's definition), so MFU is comparable
    across recompute settings.
    """
    if peak_flops <= 0 or n_gpus < 1:
        raise ValueError(f"need peak_flops > 0 and n_gpus >= 1, got {peak_flops}, {n_gpus}")
    return tokens_per_s * training_flops_per_token(n_params, n_layer, d_model, seq_len) / (n_gpus * peak_flops)


# ------------------------------------------------------------------------- small-message all-reduce

AllReduceAlgorithm = Literal["ring", "one_shot", "two_shot", "best"]
ALL_REDUCE_ALGORITHMS: tuple[str, ...] = ("ring", "one_shot", "two_shot")
SHOT_MAX_BYTES = 8 * 2**20
"""Largest message the one- and two-shot kernels take: vLLM's custom all-reduce registers an 8 MiB buffer per
rank and hands larger messages to NCCL."""


def all_reduce_time(nbytes: float, n: int, alpha: float, beta: float,
                    algorithm: AllReduceAlgorithm = "best") -> float:
    """Alpha-beta time of an all-reduce of V = ``nbytes`` on ``n`` ranks, by algorithm (seconds).

    * ``ring``: reduce-scatter + all-gather rings, ``2(n-1) alpha + 2(n-1)/n V / beta`` (``collective_time``);
      latency grows with n, which is what the large gradient messages of training can afford;
    * ``one_shot``: every rank reads the whole buffer of each of the n-1 others over the switch and reduces
      locally: ``alpha + (n-1) V / beta``, one latency step whatever n;
    * ``two_shot``: each rank reduces its 1/n slice from every peer (a one-step reduce-scatter), then every rank
      gathers the n slices (a one-step all-gather): ``2 alpha + 2(n-1)/n V / beta``;
    * ``best``: the cheapest of the three, what a serving engine picks per message size; one- and two-shot only
      up to ``SHOT_MAX_BYTES`` (their staging buffer), larger messages go to the ring. In this model two-shot
      moves the ring's bytes in fewer steps; what the model leaves out (the buffer, the SMs the kernel occupies,
      the n-1 peers sharing each link) is why engines still use the ring for large messages.

    The one- and two-shot kernels are those of vLLM's custom all-reduce and TensorRT-LLM's AllReduce plugin
    (one-shot for small messages, two-shot for medium ones, the ring of NCCL for large ones); NCCL's LL and tree
    protocols and NVLink SHARP give the same effect: a decode step's all-reduce of a few kB costs about one link
    latency, not 2(n-1) of them. Both need every pair of ranks to be one hop apart (NVSwitch, NVLink mesh).
    """
    if alpha < 0 or beta <= 0:
        raise ValueError(f"need alpha >= 0 (seconds) and beta > 0 (bytes/s), got alpha={alpha}, beta={beta}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (number of ranks) must be a positive integer, got {n!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if n == 1:
        return 0.0
    times = {"ring": collective_time("all_reduce", nbytes, n, alpha, beta),
             "one_shot": alpha + (n - 1) * nbytes / beta,
             "two_shot": 2 * alpha + 2 * (n - 1) / n * nbytes / beta}
    if algorithm == "best":
        return min(times.values()) if nbytes <= SHOT_MAX_BYTES else times["ring"]
    if algorithm not in times:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}: choose one of "
                         f"{', '.join((*ALL_REDUCE_ALGORITHMS, 'best'))}")
    return times[algorithm]
