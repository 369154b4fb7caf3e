"""Bytes per GPU by category: the result every memory estimate returns, its units and its input checks.

All sizes are in bytes; GB means 10^9 bytes, GiB 2^30. ``MemoryBudget`` is what ``course_lib.estimates.memory``'s
``training_memory`` and ``inference_memory`` return and what ``course_lib.measure.memtrack.MemoryTracker`` measures:
bytes per category, a read-only mapping with ``.total`` and a readable ``str``. The checks refuse nonsense inputs of
every estimator (seq_len=0, micro_batch=-1, tp=0) by name, never replacing them by a default.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

__all__ = ["GB", "GiB", "MemoryBudget", "check_amount", "check_count", "compare_budgets", "format_bytes"]

GB = 10**9
GiB = 2**30

# ----------------------------------------------------------------------------------------------------------------
# Input checks: nonsense (seq_len=0, micro_batch=-1, tp=0) is refused by name, never replaced by a default


def check_count(name: str, value: object, minimum: int = 1, none: str = "") -> None:
    """``value`` must be an int >= ``minimum``; None too where ``none`` says what None means."""
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        default = f" (or None: {none})" if none else ""
        raise ValueError(f"{name} must be an int >= {minimum}{default}, got {value!r}")


def check_amount(name: str, value: object, positive: bool = False) -> None:
    """``value`` must be a number >= 0 (> 0 where ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (value > 0 if positive else value >= 0):
        raise ValueError(f"{name} must be a number {'> 0' if positive else '>= 0'}, got {value!r}")


# ----------------------------------------------------------------------------------------------------------------
# Results: bytes by category


def format_bytes(n: float, unit: str | None = None, *, digits: int | None = None) -> str:
    """The course's one byte formatter, decimal units: ``1.23 GB``-style (two decimals); ``unit`` forces one of
    B, kB, MB, GB, TB, KiB, MiB, GiB; ``digits`` gives that many significant digits instead
    (``format_bytes(4e6, digits=3)`` -> ``4 MB``, ``format_bytes(1500, digits=3)`` -> ``1.5 kB``)."""
    units = {"B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    if unit is not None and unit not in units:
        raise ValueError(f"unit must be one of {', '.join(units)} (or None to pick one), got {unit!r}")
    if unit is None:
        unit = next((u for u in ("TB", "GB", "MB", "kB") if abs(n) >= units[u]), "B")
    if digits is not None:
        return f"{n / units[unit]:.{digits}g} {unit}"
    if unit == "B":
        return f"{n:,.0f} B"
    return f"{n / units[unit]:,.2f} {unit}"


def _pick_unit(n: float) -> str:
    return next((u for u in ("TB", "GB", "MB", "kB") if abs(n) >= {"TB": 1e12, "GB": 1e9, "MB": 1e6, "kB": 1e3}[u]),
                "B")


@dataclass(eq=False)
class MemoryBudget(Mapping[str, float]):
    """Bytes per GPU by category, in a fixed order: a read-only ``dict`` with a total.

    ``budget["activations"]``, ``budget.total``, ``budget.gb()`` ({category: decimal GB}), ``dict(budget)``;
    ``str(budget)`` is a small table (GB for real models; a smaller unit is picked automatically when the
    total is below 1 GB, or ask ``budget.to_string("GB")``). ``notes`` say which assumptions produced it
    (e.g. which pipeline stage is the worst).
    """

    parts: dict[str, float]
    label: str = ""
    notes: list[str] = field(default_factory=list)

    def __getitem__(self, key: str) -> float:
        return self.parts[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)

    @property
    def total(self) -> float:
        """Sum of all categories (bytes)."""
        return float(sum(self.parts.values()))

    def gb(self) -> dict[str, float]:
        """{category: decimal GB}, handy for plotting."""
        return {k: v / GB for k, v in self.parts.items()}

    def to_string(self, unit: str | None = None) -> str:
        unit = unit or _pick_unit(self.total)
        width = max([len(k) for k in self.parts] + [5])
        lines = [self.label] if self.label else []
        for k, v in self.parts.items():
            share = f"{100 * v / self.total:5.1f}%" if self.total else ""
            lines.append(f"  {k:<{width}}  {format_bytes(v, unit):>14}  {share}")
        lines.append(f"  {'total':<{width}}  {format_bytes(self.total, unit):>14}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_string()

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={format_bytes(v)}" for k, v in self.parts.items())
        return f"MemoryBudget({self.label!r}: {inner}; total={format_bytes(self.total)})"


def compare_budgets(budgets: Mapping[str, Mapping[str, float]], unit: str = "GB") -> str:
    """A side-by-side table: one column per budget (e.g. estimate vs measured), one row per category."""
    names = list(budgets)
    cats: list[str] = []
    for b in budgets.values():
        cats += [k for k in b if k not in cats]
    w = max([len(c) for c in cats] + [5])
    col = max([len(n) for n in names] + [14])
    lines = [f"  {'':<{w}}  " + "  ".join(f"{n:>{col}}" for n in names)]
    for c in [*cats, "total"]:
        vals = [sum(b.values()) if c == "total" else b.get(c, 0.0) for b in budgets.values()]
        lines.append(f"  {c:<{w}}  " + "  ".join(f"{format_bytes(v, unit):>{col}}" for v in vals))
    return "\n".join(lines)

