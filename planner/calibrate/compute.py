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

__all__ = ["SCALE_RANGE", "Action", "compute_scales", "measured_actions", "shares"]

_CORUN_GRID = [1.0 + 0.02 * k for k in range(51)]  # 1.00 … 2.00
_BETTER = 0.95  # a fitted co-run slow-down must cut the squared log error by 5 %
SCALE_RANGE = (0.5, 2.0)
"""The compute scale a fit may give ([Note: a scale and a fixed cost per action])."""


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
    default = corun_slowdown(raw.profile)
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
    """(scale, fixed ms) of measured ÷ g = scale × profiled + fixed, least squares over the
    median of each stage's forwards and backwards; fixed ≥ 0.

    [Note: a scale and a fixed cost per action] A runtime action costs more than
    its blocks' profiled time by a part that grows with it (the profile's own error)
    and a part that does not (the pipeline's bookkeeping inside the action): fitted
    as one ratio, the fixed part would be scaled up with every larger micro-batch and
    every longer stage. The fixed part is not kept here: the action overhead, fitted
    last to the step, carries every fixed cost per action.

    A run of one layout has two stages' forwards and backwards, four points: when
    their measured times hardly follow their profiled ones, the line's slope falls
    toward 0 and the fixed part takes everything (a U-Net's 2×1 m4 run: scale 0.008,
    then 12.6 ms of overhead per action), a fit that prices another micro-batch size
    at a fraction of its work (−63 % on its 1×2 m1 layout). The profile measured
    these blocks on this machine, so the scale is kept within ``SCALE_RANGE``: its
    error is a ratio, not a hundredfold.
    """
    groups: dict[tuple[int, str], list[Action]] = {}
    for a in actions:
        groups.setdefault((a.stage, a.kind), []).append(a)
    pts = [
        (statistics.median(a.profiled for a in acts), statistics.median(a.ms / g(a) for a in acts))
        for acts in groups.values()
    ]
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx > 0:
        slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
        fixed = my - slope * mx
        if SCALE_RANGE[0] <= slope <= SCALE_RANGE[1] and fixed >= 0:
            return slope, fixed
        if slope > SCALE_RANGE[1] or (slope < SCALE_RANGE[0] and fixed >= 0):
            slope = min(max(slope, SCALE_RANGE[0]), SCALE_RANGE[1])
            return slope, max(0.0, my - slope * mx)
    through_origin = sum(x * y for x, y in pts) / max(sum(x * x for x, _ in pts), 1e-12)
    return min(max(through_origin, SCALE_RANGE[0]), SCALE_RANGE[1]), 0.0
