"""The compute part of a calibration: each measured action against its blocks' profiled
time, with the share of it spent beside another computing rank ([Note: what a calibration
fits, and in which order], step 1, in ``planner.calibrate.fit``)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.calibrate.priced import plan_cost_model
from planner.cost.model import CostModel
from planner.cost.stage_time import corun_slowdown
from planner.plan.measured import Interval, Measurement, RankRecord
from planner.plan.records import Calibration
from planner.plan.schema import Plan

__all__ = [
    "SCALE_PRIOR_SD",
    "SCALE_RANGE",
    "Action",
    "bounded_line",
    "compute_scales",
    "measured_actions",
    "shares",
]

_CORUN_GRID = [1.0 + 0.02 * k for k in range(51)]  # 1.00 … 2.00
_BETTER = 0.95  # a fitted co-run slow-down must cut the squared log error by 5 %
SCALE_RANGE = (0.5, 2.0)
"""The compute scale a fit may give ([Note: a scale and a fixed cost per action])."""
SCALE_PRIOR_SD = 0.1
"""How far the profile's compute scale is believed off, one standard deviation ([Note: a
scale and a fixed cost per action])."""


@dataclass(frozen=True)
class Action:
    stage: int
    device: str
    kind: str  # "F" (with the loss on the last stage) or "B"
    ms: float  # measured
    profiled: float  # its blocks' profiled time
    overlap: float  # share of it with another rank computing


def measured_actions(plan: Plan, raw: CostModel, result: Measurement) -> list[Action]:
    """Every counted forward and backward (DDP's last backward left out, dp > 1)."""
    counted = set(result.counted)
    busy = {r.rank: _merged(_compute_spans(r, counted)) for r in result.records}
    n = raw.n_blocks
    out = []
    for rec in result.records:
        st = plan.stages[rec.stage]
        i, j = st.blocks
        dev = raw.basis.stage_types[rec.stage][0]
        tab = raw.basis.tables[dev]
        profiled = {
            "F": tab.fwd[j] - tab.fwd[i] + (tab.loss_fwd if j == n else 0.0),
            "B": tab.bwd[j] - tab.bwd[i] + (tab.loss_bwd if j == n else 0.0),
        }
        if raw.recompute(rec.stage, i, j):
            profiled["B"] += tab.fwd[j] - tab.fwd[i]
        others = _merged([s for r, spans in busy.items() if r != rec.rank for s in spans])
        groups: dict[tuple[str, int, int], list[Interval]] = {}
        for iv in rec.intervals:
            kind = "F" if iv.kind in ("F", "loss") else iv.kind
            if kind not in ("F", "B") or iv.step not in counted:
                continue
            if kind == "B" and plan.dp > 1 and iv.micro_batch == plan.micro_batches - 1:
                continue
            groups.setdefault((kind, iv.step, iv.micro_batch), []).append(iv)
        for (kind, _, _), ivs in groups.items():
            ms = sum(iv.ms for iv in ivs)
            if ms <= 0 or profiled[kind] <= 0:
                continue
            shared = sum(_overlap_s(iv, others) for iv in ivs) * 1e3
            p = profiled[kind]
            out.append(Action(rec.stage, dev, kind, ms, p, min(1.0, shared / ms)))
    return out


def _compute_spans(rec: RankRecord, counted: set[int]) -> list[tuple[float, float]]:
    return [
        (iv.start, iv.end)
        for iv in rec.intervals
        if iv.kind in ("F", "B", "loss", "optimizer") and iv.step in counted
    ]


def _merged(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap_s(iv: Interval, spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(iv.end, b) - max(iv.start, a)) for a, b in spans)


def shares(actions: list[Action]) -> tuple[float, float]:
    """(share of the actions mostly alone, share mostly beside another computing rank)."""
    alone = sum(a.overlap < 0.25 for a in actions) / len(actions)
    busy = sum(a.overlap > 0.75 for a in actions) / len(actions)
    return alone, busy


def compute_scales(
    plan: Plan,
    actions: list[Action],
    types: list[str],
    raw: CostModel,
    shares: tuple[float, float],
) -> tuple[float, dict[str, tuple[float, float]], bool]:
    """(co-run slow-down, {type: (fwd scale, bwd scale)}, whether the slow-down was fitted);
    ``raw``: the plan's uncalibrated cost model, ``shares``: :func:`_shares`."""
    default = corun_slowdown(raw.profile, plan.dp)
    tried = {c: _scales_at(plan, actions, types, c) for c in sorted({*_CORUN_GRID, default})}
    c = min(tried, key=lambda k: (tried[k][0], k != default))
    alone, busy = shares
    if alone >= 0.1 and busy >= 0.1 and tried[c][0] < _BETTER * tried[default][0]:
        return c, tried[c][1], True
    return default, tried[default][1], False


def _scales_at(
    plan: Plan, actions: list[Action], types: list[str], corun: float
) -> tuple[float, dict[str, tuple[float, float]]]:
    """At co-run slow-down ``corun``: the squared log error of the best compute scale per
    device type, and the scales ([Note: a scale and a fixed cost per action])."""
    cm = plan_cost_model(plan, {t: Calibration(corun_slowdown=corun) for t in types})
    alone, busy = 1.0 / cm.time.speeds[0], 1.0 / cm.time.speeds[-1]

    def g(a: Action) -> float:
        return (1 - a.overlap) * alone + a.overlap * busy

    lines = {t: _line([a for a in actions if a.device == t], g) for t in types}
    err = 0.0
    for a in actions:
        slope, fixed = lines[a.device]
        err += math.log(a.ms / (g(a) * (slope * a.profiled + fixed))) ** 2
    return err, {t: (slope, slope) for t, (slope, _) in lines.items()}


def _line(actions: list[Action], g: Callable[[Action], float]) -> tuple[float, float]:
    """(scale, fixed ms) of measured ÷ g = scale × profiled + fixed over the median of each
    stage's forwards and backwards (:func:`bounded_line`), pulled toward the profile's
    own scale, 1, as far as the points scatter ([Note: a scale and a fixed cost per
    action]).

    [Note: a scale and a fixed cost per action] A runtime action costs more than
    its blocks' profiled time by a part that grows with it (the profile's own error)
    and a part that does not (the pipeline's bookkeeping inside the action): fitted
    as one ratio, the fixed part would be scaled up with every larger micro-batch and
    every longer stage (a Llama's 2×1 m4 run, actions of 1.1–1.5 ms profiled and
    2.2–2.7 measured: a ratio of 1.87, which priced its 1×1 layout at +119 %). The
    fixed part is not kept here: the action overhead, fitted last to the step,
    carries every fixed cost per action.

    But a run has few points (a forward and a backward per stage), of nearly one size
    when its stages are balanced, and a line through them takes the profile's error
    on backwards against forwards for a slope (a U-Net's 1×1 run: forward 18 % above
    its profile, backward 0.5 %: slope 0.5 and 21 ms fixed per action). So the
    scale is estimated as the profile being one more measurement: s ~ N(1, τ²) with
    τ = ``SCALE_PRIOR_SD``, the points' scatter σ² (about the line; about the ratio
    through the origin when there are two points or fewer) giving the pull
    K = σ²/τ² in ``bounded_line``. Points on a line (a run the cost model made)
    have no scatter: their line is recovered exactly. Over the calibration
    benchmark's kept launches (8 models × 4 layouts, at c81081e), held out:
    median |error| 10.4 %, worst −46 %; the plain line 11.9 % / −54 %; the ratio
    10.4 % / +119 %.

    The profile measured these blocks on this machine, so the scale is kept within
    ``SCALE_RANGE`` too: its error is a ratio, not a hundredfold (a U-Net's 2×1 m4
    line, unbounded, had a slope of 0.008).
    """
    groups: dict[tuple[int, str], list[Action]] = {}
    for a in actions:
        groups.setdefault((a.stage, a.kind), []).append(a)
    pts = [
        (statistics.median(a.profiled for a in acts), statistics.median(a.ms / g(a) for a in acts))
        for acts in groups.values()
    ]
    return bounded_line(pts, pull=_scatter(pts) / SCALE_PRIOR_SD**2)


def _scatter(pts: list[tuple[float, float]]) -> float:
    """The points' variance about their least-squares line (n − 2 degrees of freedom), or
    about their ratio through the origin when there are two or fewer (n − 1)."""
    n, mx, my, sxx, sxy, sq, sq_xy = _sums(pts)
    if n >= 3 and sxx > 0:
        s = sxy / sxx
        return sum((y - my - s * (x - mx)) ** 2 for x, y in pts) / (n - 2)
    ratio = sq_xy / sq if sq > 0 else 1.0
    return sum((y - ratio * x) ** 2 for x, y in pts) / max(n - 1, 1)


def _sums(pts: list[tuple[float, float]]) -> tuple[int, float, float, float, float, float, float]:
    """(n, mean x, mean y, Σ (x − x̄)², Σ (x − x̄)(y − ȳ), Σ x², Σ xy) of ``pts``."""
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    return n, mx, my, sxx, sxy, sum(x * x for x, _ in pts), sum(x * y for x, y in pts)


def bounded_line(pts: list[tuple[float, float]], pull: float = 0.0) -> tuple[float, float]:
    """(scale, fixed) minimising Σ (y − scale·x − fixed)² + pull·(scale − 1)² over ``pts``
    with the scale within ``SCALE_RANGE`` and fixed ≥ 0.

    The objective is convex and the region a strip, so the optimum is the unconstrained
    one when it lies inside, else the best of each edge's own optimum: the scale at
    either end of its range (fixed: the mean excess, ≥ 0) and fixed 0 (the scale
    clamped). Clamping the unconstrained slope alone misses it: two points of nearly
    the same profiled time (a ResNet's forward, 18.5 ms, and backward, 23.0 ms,
    measured at 15 and 30 ms) give a slope of 3.3 and a negative fixed part, and the
    clamped scale 2.0 then priced the whole step at twice what was measured; through
    the origin, the same points give 1.1.
    """
    lo, hi = SCALE_RANGE
    _, mx, my, sxx, sxy, sq, sq_xy = _sums(pts)
    if sxx + pull > 0:
        slope = (sxy + pull) / (sxx + pull)
        if lo <= slope <= hi and my - slope * mx >= 0:
            return slope, my - slope * mx
    candidates = [(s, max(0.0, my - s * mx)) for s in (lo, hi)]
    if sq + pull > 0:
        ratio = (sq_xy + pull) / (sq + pull)
        candidates.append((min(max(ratio, lo), hi), 0.0))

    def err(c: tuple[float, float]) -> float:
        return sum((y - c[0] * x - c[1]) ** 2 for x, y in pts) + pull * (c[0] - 1) ** 2

    return min(candidates, key=lambda c: (err(c), abs(c[0] - 1.0)))
