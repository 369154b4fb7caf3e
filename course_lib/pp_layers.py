"""Which blocks each pipeline stage holds: the one rule the runtime (``course_lib.parallel.pp``) and the memory
estimator (``course_lib.memory``) share. It stands outside ``parallel/`` so that the estimator, like the
topology predictions, reads it without importing the runtime.

n = p x v (virtual) stages of a model with L blocks: equal counts L / n by default -- ``course_lib.mesh``'s
constraint "pp x v divides n_layer" -- or an explicit ``split`` (any counts >= 1 summing to L, e.g. from
``parallel.pp_balance.balance_stages``). Stage s holds the contiguous blocks ``stage_layers(split)[s]``.
"""

from __future__ import annotations

from collections.abc import Sequence


def layer_split(n_layer: int, n_stages: int, split: Sequence[int] | None = None) -> list[int]:
    """Blocks per (virtual) stage: ``split`` checked, or equal counts (``n_layer`` must then divide evenly)."""
    if split is None:
        if n_layer % n_stages:
            raise ValueError(
                f"n_layer={n_layer} blocks do not divide into {n_stages} equal stages (p x v = {n_stages}): "
                f"choose n_layer divisible by {n_stages}, or give split=[blocks per stage] (e.g. from balance_stages)"
            )
        return [n_layer // n_stages] * n_stages
    split = list(split)
    if len(split) != n_stages:
        raise ValueError(f"split needs one block count per (virtual) stage, {n_stages} = p x v, got {len(split)}: "
                         f"{split}")
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in split):
        raise ValueError(f"every stage needs a whole number >= 1 of blocks, got split={split}")
    if sum(split) != n_layer:
        raise ValueError(f"split={split} sums to {sum(split)} blocks, but the model has n_layer={n_layer}")
    return split


def stage_layers(split: Sequence[int]) -> list[range]:
    """The global block indices of each stage: [2, 1, 3] -> range(0, 2), range(2, 3), range(3, 6)."""
    starts = [sum(split[:s]) for s in range(len(split))]
    return [range(a, a + c) for a, c in zip(starts, split, strict=True)]
