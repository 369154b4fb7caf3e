"""Which blocks each pipeline stage holds: the one rule the runtime (``pp``) and the memory
estimator (``course_lib.estimates.memory``) share; it imports nothing, so the estimator and the
topology predictions read it without the runtime.

n = p x v (virtual) stages of a model with L blocks: equal counts L / n by default (the mesh's
constraint "pp x v divides n_layer") or an explicit ``split`` (counts >= 1 summing to L, e.g.
``pp_balance.balance_stages``'s). Stage s holds the contiguous blocks ``stage_layers(split)[s]``.

When n does not divide L, ``ends_split`` is the rule the planner recommends (pass it as ``split``):
every stage gets ceil(L / n) blocks, and the shortfall n ceil(L / n) - L is taken one block at a
time from the last stage, the first, the second-to-last, the second, ...: the stages that also hold
the LM head and the embedding lighten first. Llama 3's 126 layers on 16 stages give 7, 8, ..., 8, 7
("The Llama 3 Herd of Models", Dubey et al. 2024, Sec. 3.3.2: one layer fewer on the first and the
last stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache


def layer_split(n_layer: int, n_stages: int, split: Sequence[int] | None = None) -> list[int]:
    """Blocks per (virtual) stage: ``split``, checked, or equal counts (n_layer / n_stages each)."""
    if split is None:
        if n_layer % n_stages:
            raise ValueError(
                f"n_layer={n_layer} blocks do not divide into {n_stages} equal stages (p x v = "
                f"{n_stages}): choose n_layer divisible by {n_stages}, or give split=[blocks per "
                "stage] (e.g. from balance_stages)")
        return [n_layer // n_stages] * n_stages
    if isinstance(split, tuple):  # a layout's split is read by many calls: check it once (cached)
        try:
            return list(_checked_split(n_layer, n_stages, split, tuple(map(type, split))))
        except TypeError:  # an unhashable entry: the check below says what is wrong with it
            pass
    return _check_split(n_layer, n_stages, list(split))


@lru_cache(maxsize=4096)
def _checked_split(n_layer: int, n_stages: int, split: tuple[int, ...],
                   types: tuple[type, ...]) -> tuple[int, ...]:
    """``_check_split`` of a tuple, cached (``types`` in the key: 1.0 == 1 must not pass as int)."""
    return tuple(_check_split(n_layer, n_stages, list(split)))


def _check_split(n_layer: int, n_stages: int, split: list[int]) -> list[int]:
    """``split`` if it has a whole count >= 1 per stage summing to ``n_layer``, else ValueError."""
    if len(split) != n_stages:
        raise ValueError(f"split needs one block count per (virtual) stage, {n_stages} = p x v, "
                         f"got {len(split)}: {split}")
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in split):
        raise ValueError(f"every stage needs a whole number >= 1 of blocks, got split={split}")
    if sum(split) != n_layer:
        raise ValueError(f"split={split} sums to {sum(split)} blocks, but the model has "
                         f"n_layer={n_layer}")
    return split


def ends_split(n_layer: int, n_stages: int) -> list[int]:
    """Blocks per stage by the rule above: equal counts when ``n_stages`` divides ``n_layer``, else
    ceil(L/n) each, the shortfall taken from the ends inwards (last, first, second-to-last, ...)."""
    return list(_ends_split(n_layer, n_stages))


@lru_cache(maxsize=4096)
def _ends_split(n_layer: int, n_stages: int) -> tuple[int, ...]:
    for name, value in (("n_layer", n_layer), ("n_stages", n_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if n_stages > n_layer:
        raise ValueError(f"{n_stages} stages need at least one block each, but the model has "
                         f"n_layer={n_layer}: use at most {n_layer} (virtual) stages")
    per = -(-n_layer // n_stages)
    split = [per] * n_stages
    order = [i for pair in zip(range(n_stages - 1, -1, -1), range(n_stages), strict=True)
             for i in pair]
    order = list(dict.fromkeys(order))  # last, first, second-to-last, second, ...
    shortfall = per * n_stages - n_layer
    for k in range(shortfall):  # shortfall < n_stages, so each stage loses at most one block
        split[order[k]] -= 1
    return tuple(split)


def stage_layers(split: Sequence[int]) -> list[range]:
    """Each stage's global block indices: [2, 1, 3] -> range(0, 2), range(2, 3), range(3, 6)."""
    starts = [sum(split[:s]) for s in range(len(split))]
    return [range(a, a + c) for a, c in zip(starts, split, strict=True)]
