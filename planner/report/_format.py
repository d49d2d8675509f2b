"""Figures as short text for the reports: times, sizes, counts, shares, ranks, events."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from planner.plan import StagePlan
from planner.simulate import Event

_GIB = 2**30
_MIB = 2**20
_STATE = ("params", "grads", "optimizer")
_OTHER = ("buffers", "comm_buffers", "tied_copies")
_NEAR = 0.9  # a stage above this share of its device's memory is flagged


def _ms(x: float) -> str:
    """A time in ms: 1234.5, 12.35, 1.234, 0.050, 0.00123."""
    a = abs(x)
    if a == 0 or not math.isfinite(a):
        return f"{x:g}"
    return format(x, ".1f" if a >= 100 else ".2f" if a >= 10 else ".3f" if a >= 0.01 else ".3g")


def _num(x: float) -> str:
    """Three significant figures or so: 123, 12.3, 1.23, 0 (inf when unbounded)."""
    a = abs(x)
    if a == 0 or not math.isfinite(a):
        return f"{x:g}"
    return format(x, ".0f" if a >= 100 else ".1f" if a >= 10 else ".2f")


def _bytes(n: float) -> str:
    return f"{_num(n / _GIB)} GiB" if abs(n) >= _GIB else f"{_num(n / _MIB)} MiB"


def _count(n: float) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:g}"


def _pct(x: float, digits: int = 0) -> str:
    return f"{100 * x:.{digits}f} %"


def _ranks(ranks: Sequence[int]) -> str:
    """Ranks in short: "0–7" for a run, "0,2,…,14" for a long stride, else "0,4"."""
    r = list(ranks)
    steps = {b - a for a, b in itertools.pairwise(r)}
    if len(r) >= 3 and steps == {1}:
        return f"{r[0]}–{r[-1]}"
    if len(r) > 4 and len(steps) == 1:
        return f"{r[0]},{r[1]},…,{r[-1]}"
    return ",".join(map(str, r))


def _modules(mods: Sequence[str]) -> str:
    if len(mods) <= 1:
        return f"{mods[0]} (1)" if mods else "(none)"
    return f"{mods[0]} … {mods[-1]} ({len(mods)})"


def _memory(st: StagePlan) -> tuple[float, float, float, float, float]:
    """(params + grads + optimizer, activations, other, total, capacity), bytes."""
    m = st.memory
    state = sum(m.get(k, 0.0) for k in _STATE)
    other = sum(m.get(k, 0.0) for k in _OTHER)
    act = m.get("activations", 0.0)
    return state, act, other, m.get("total", state + act + other), m.get("capacity", math.inf)


def _share(total: float, capacity: float) -> float:
    return total / capacity if 0 < capacity < math.inf else 0.0


def _level(share: float) -> str:
    return "over" if share > 1 else "near" if share > _NEAR else ""


def _event_name(e: Event) -> str:
    """The event's label: "F3", "B3", "send F3", "send B3", "sync"."""
    if e.kind.startswith("send_"):
        return f"send {e.kind[5:]}{e.micro_batch}"
    return e.kind if e.micro_batch < 0 else f"{e.kind}{e.micro_batch}"
