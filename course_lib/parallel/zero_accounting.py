"""What ZeRO holds and sends, by the paper's categories: the model-state bytes that live on a rank now (summed
over the storages that exist, so it is a *measurement* of the implementation) and the exact bytes each rank sends
per step (what the ring collectives of ``course_lib.comm`` move for this implementation's padded units).

The formulas they are checked against (ZeRO, Rajbhandari et al. 2020, Sec. 5 and 7; Ψ parameters, N data-parallel
ranks, K optimizer bytes per parameter) are ``course_lib.estimates.model_states.zero_memory_per_device`` for memory
and, for communication, 2 (N-1)/N V per step for stages 0-2 and 3 (N-1)/N V for stage 3 (V = Ψ x bytes per element).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from course_lib import comm
from course_lib.parallel.zero_unit import ShardedModel

__all__ = ["comm_bytes_per_step", "model_state_bytes"]


def model_state_bytes(zdp: ShardedModel, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Live bytes of model states on this rank, by ZeRO's categories, summing the storages that exist now.

    * ``parameters``: the compute-dtype weights: the full flat buffers (0 bytes while resharded) and, when the
      shard *is* the weights (fp32), the shards;
    * ``gradients``: the module parameters' ``.grad`` (views of the flat gradient buffers) and the shards' grads;
    * ``optimizer_state``: every tensor in ``optimizer.state`` (Adam's m and v, the ``step`` counters) and the
      fp32 master shards under mixed precision (model_states.py's convention: the master copy is part of K).

    A storage is counted once (views share it), in the first category that claims it. Transient buffers of
    the collectives (a bf16 cast of a shard) are not model states and are not counted."""
    seen: set[int] = set()

    def total(tensors: Iterable[torch.Tensor | None]) -> int:
        n = 0
        for t in tensors:
            if t is None:
                continue
            st = t.untyped_storage()
            if st._cdata not in seen:
                seen.add(st._cdata)
                n += st.nbytes()
        return n

    fp32_weights = zdp.param_dtype == torch.float32
    units = zdp.units
    shards = [s for u in units for s in u.optimizer_params()]
    params = total([t for u in units for t in u.weight_tensors()] + (shards if fp32_weights else []))
    grads = total([p.grad for u in units for p in u.params] + [s.grad for s in shards])
    opt_tensors = [] if fp32_weights else list(shards)
    if optimizer is not None:
        opt_tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {"parameters": params, "gradients": grads, "optimizer_state": total(opt_tensors)}


def comm_bytes_per_step(padded_numels: Sequence[int], world_size: int, stage: int,
                        reshard_after_forward: bool | None = None, element_size: int = 4,
                        rank: int = 0) -> dict[str, int]:
    """Bytes rank ``rank`` sends per training step in this implementation, by collective (ring algorithm).

    ``padded_numels``: the units' flat sizes in ``ZeroDataParallel.units`` order (the root last): multiples of
    N in stages 1-3, so every ring chunk is equal and each all-gather or reduce-scatter of V bytes sends exactly
    (N-1)/N V; stage 0 does not pad (the all-reduce's chunks may differ by one element: ``comm.ring_bytes``).
    Stage 3 all-gathers every unit in forward, and again in backward every unit freed after forward
    (``reshard_after_forward``: None = all but the root, True = all, False = none)."""
    n = world_size

    def sent(op: str, numels: Sequence[int]) -> int:
        return sum(comm.ring_bytes(op, p, element_size, n, rank)[0] for p in numels)

    out = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    if stage == 0:
        out["all_reduce"] = sent("all_reduce", padded_numels)
        return out
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0..3, got {stage}")
    if any(p % n for p in padded_numels):
        raise ValueError(f"padded sizes {list(padded_numels)} must be multiples of world_size={n}")
    out["reduce_scatter"] = out["all_gather"] = sent("all_gather", padded_numels)
    if stage == 3:
        if reshard_after_forward is None:
            again = padded_numels[:-1]
        else:
            again = padded_numels if reshard_after_forward else []
        out["all_gather"] += sent("all_gather", again)
    return out
