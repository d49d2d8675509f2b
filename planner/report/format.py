"""Figures as short text for the reports: times, sizes, counts, shares, ranks, module lists."""

from __future__ import annotations

import math
from collections.abc import Sequence

from planner.plan.text import fmt_ranks
from planner.plan.units import GIB, MIB

__all__ = [
    "NEAR",
    "OTHER",
    "STATE",
    "fmt_bytes",
    "fmt_count",
    "fmt_modules",
    "fmt_ms",
    "fmt_num",
    "fmt_pct",
    "fmt_ranks",
    "level",
]

STATE = ("params", "grads", "optimizer")
"""The memory kinds that are state: parameters, gradients, optimizer state."""
OTHER = ("buffers", "comm_buffers", "tied_copies")
"""The memory kinds the tables group as "other"."""
NEAR = 0.9
"""A stage above this share of its device's memory is flagged."""


def fmt_ms(x: float) -> str:
    """A time in ms: 1234.5, 12.35, 1.234, 0.050, 0.00123."""
    a = abs(x)
    if a == 0 or not math.isfinite(a):
        return f"{x:g}"
    return format(x, ".1f" if a >= 100 else ".2f" if a >= 10 else ".3f" if a >= 0.01 else ".3g")


def fmt_num(x: float) -> str:
    """Three significant figures or so: 123, 12.3, 1.23, 0 (inf when unbounded)."""
    a = abs(x)
    if a == 0 or not math.isfinite(a):
        return f"{x:g}"
    return format(x, ".0f" if a >= 100 else ".1f" if a >= 10 else ".2f")


def fmt_bytes(n: float) -> str:
    """ "1.50 GiB" or "12.0 MiB"."""
    return f"{fmt_num(n / GIB)} GiB" if abs(n) >= GIB else f"{fmt_num(n / MIB)} MiB"


def fmt_count(n: float) -> str:
    """ "1.1 B", "9.0 M", "12.0 k"."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:g}"


def fmt_pct(x: float, digits: int = 0) -> str:
    """ "42 %" (``digits`` decimals)."""
    return f"{100 * x:.{digits}f} %"


def fmt_modules(mods: Sequence[str]) -> str:
    """ "blocks.0 … blocks.7 (8)": the first and last module, and how many."""
    if len(mods) <= 1:
        return f"{mods[0]} (1)" if mods else "(none)"
    return f"{mods[0]} … {mods[-1]} ({len(mods)})"


def level(share: float) -> str:
    """How full a stage is: "over" its capacity, "near" it, or ""."""
    return "over" if share > 1 else "near" if share > NEAR else ""
