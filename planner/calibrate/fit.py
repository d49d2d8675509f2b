"""Fit a calibration from a run of a plan: its measured actions against the cost model.

[Note: what a calibration fits, and in which order] One run of one plan
(``Measurement``: every rank's timed forward and backward actions, optimizer
steps and steps, on clocks aligned across ranks) against the same plan priced
by the cost model from the profiles the plan carries, uncalibrated:

1. **compute, per device type, and the co-run slow-down**: each forward and
   backward action's measured time ÷ g(x) is modelled as ``scale × profiled +
   fixed`` (profiled: its blocks' time, the loss on the last stage), where x
   is the share of the action during which another rank computed too (from the
   aligned intervals) and g the cost model's own slow-down of a computing
   process, from alone (x = 0) to every stage computing (x = 1) ([Note: shared
   cores]); a straight line through each stage's median forward and backward
   ([Note: a scale and a fixed cost per action]). For each co-run slow-down c
   on a grid the line is fitted; the c kept is the one whose fit is best
   (least squared log error), and is reported fitted only when the run has
   actions both mostly alone and mostly overlapped and the fit is clearly
   better than at the default. DDP's all-reduce inside each stage's last
   backward (dp > 1) is left out.
2. **the optimizer step**: Σ over stages of the measured step ÷ Σ predicted.
3. **the all-reduce** (dp > 1, m > 1): the last backward's excess over the
   other backwards, per stage, Σ measured ÷ Σ predicted ``reduce_ms``.
4. **transfers** (pp > 1): the gap between a micro-batch's action ending on
   one stage and starting on the next, when the next was waiting for it; the
   median gap beyond the predicted transfer is ``p2p_extra_ms`` (≥ 0).
5. **the action overhead**, last: the fixed cost per action (≥ 0) that makes
   the simulated step of the plan's placement equal its measured step
   (bisection: the step only grows with it). So the fitted step matches the
   run by construction; how well a calibration predicts is measured on other
   runs (``planner calibrate --check``, ``bench accuracy``).

Each figure keeps its default (and is not named in ``Calibration.fitted``) when
the run cannot determine it: a single process has no co-run, transfers or
all-reduce.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from planner.cost.basis import Layout
from planner.cost.model import CostModel
from planner.cost.stage_time import corun_slowdown
from planner.devices.cluster_file import from_record
from planner.options import Training
from planner.plan.calibration import calibrated, uncalibrated
from planner.plan.measured import Interval, Measurement, RankRecord, median
from planner.plan.records import Calibration, ModelProfile
from planner.plan.schema import Plan

__all__ = ["Fit", "fit", "plan_cost_model"]

_CORUN_GRID = [1.0 + 0.02 * k for k in range(51)]  # 1.00 … 2.00
_BETTER = 0.95  # a fitted co-run slow-down must cut the squared log error by 5 %


@dataclass(frozen=True)
class Fit:
    """A calibration per device type, and the figures it came from."""

    calibrations: dict[str, Calibration]
    actions: int  # forward and backward actions the compute fit used
    overlap: tuple[float, float]  # share of actions mostly alone, mostly overlapped
    hops: int  # transfers the p2p fit used


def plan_cost_model(plan: Plan, calibrations: dict[str, Calibration] | None = None) -> CostModel:
    """The cost model of ``plan``'s layout, from the profiles the plan carries, taken
    uncalibrated and then given ``calibrations`` (per device type; none: uncalibrated)."""
    from planner.profile.sizes import at_batch_size

    by_device: dict[str, list[ModelProfile]] = {}
    for p in plan.profiles:
        by_device.setdefault(p.device, []).append(uncalibrated(p))
    profs = {k: at_batch_size(v, plan.micro_batch_size) for k, v in by_device.items()}
    if calibrations:
        profs = {
            k: calibrated(p, calibrations[k]) if k in calibrations else p for k, p in profs.items()
        }
    training = Training(
        global_batch=plan.global_batch, optimizer=plan.optimizer, precision=plan.precision
    )
    layout = Layout(
        pp=plan.pp,
        dp=plan.dp,
        micro_batches=plan.micro_batches,
        schedule=plan.schedule,
        ranks=tuple(tuple(s.ranks) for s in plan.stages),
    )
    return CostModel(profs, from_record(plan.cluster), training, layout)


def fit(plan: Plan, result: Measurement) -> Fit:
    """The calibration of ``plan``'s cost model that ``result`` (a run of it) supports.

    See [Note: what a calibration fits, and in which order].

    Raises:
        ValueError: ``result`` is not a run of ``plan`` (other ranks or stages, another
            batch), or it holds no counted forward action.
    """
    _check_run(plan, result)
    raw = plan_cost_model(plan)
    actions = _actions(plan, raw, result)
    if not any(a.kind == "F" for a in actions):
        raise ValueError("the run recorded no forward action in its counted steps")
    types = sorted({a.device for a in actions})
    corun, scales, corun_fitted = _compute(plan, actions, types)
    fitted = ["fwd_scale"] + (["bwd_scale"] if any(a.kind == "B" for a in actions) else [])
    fitted += ["corun_slowdown"] if corun_fitted else []
    cals = {
        t: Calibration(
            fwd_scale=scales[t][0],
            bwd_scale=scales[t][1],
            corun_slowdown=corun if corun_fitted else None,
        )
        for t in types
    }
    counted = set(result.counted)
    cm = plan_cost_model(plan, cals)
    opt = _optimizer(plan, cm, result, counted)
    red = _allreduce(plan, cm, result, counted)
    extra, hops = _p2p(plan, cm, result, counted)
    figures: dict[str, float] = {}
    if opt is not None:
        figures["optimizer_scale"] = opt
    if red is not None:
        figures["allreduce_scale"] = red
    if extra is not None:
        figures["p2p_extra_ms"] = extra
    cals = {t: replace(c, **figures) for t, c in cals.items()}
    fitted += list(figures)
    overhead = _overhead(plan, cals, result.step_ms)
    fitted.append("action_overhead_ms")
    cals = {t: replace(c, action_overhead_ms=overhead) for t, c in cals.items()}
    starts = [st.blocks[0] for st in plan.stages]
    after = plan_cost_model(plan, cals).step_ms(starts)
    source = (
        f"pp {plan.pp} × dp {plan.dp}, m {plan.micro_batches} × {plan.micro_batch_size}, "
        f"{plan.schedule}, on {plan.world_size} {'/'.join(types)} process"
        f"{'es' if plan.world_size != 1 else ''}; {len(result.counted)} step"
        f"{'s' if len(result.counted) != 1 else ''} counted"
    )
    cals = {
        t: replace(
            c,
            fitted=tuple(fitted),
            source=source,
            measured_step_ms=result.step_ms,
            before_ms=plan.predicted.step_ms,
            after_ms=after,
        )
        for t, c in cals.items()
    }
    alone = sum(a.overlap < 0.25 for a in actions) / len(actions)
    busy = sum(a.overlap > 0.75 for a in actions) / len(actions)
    return Fit(cals, len(actions), (alone, busy), hops)


def _check_run(plan: Plan, result: Measurement) -> None:
    ranks = sorted(r for st in plan.stages for r in st.ranks)
    got = sorted(r.rank for r in result.records)
    if got != ranks or result.global_batch != plan.global_batch:
        raise ValueError(
            f"the measurements are not a run of this plan: ranks {got} and batch "
            f"{result.global_batch}, the plan has ranks {ranks} and batch {plan.global_batch}"
        )
    if not result.counted or not math.isfinite(result.step_ms):
        raise ValueError("the run has no counted step: run more steps than --warmup-steps")


# --------------------------------------------------------------------------- compute


@dataclass(frozen=True)
class _Action:
    stage: int
    device: str
    kind: str  # "F" (with the loss on the last stage) or "B"
    ms: float  # measured
    profiled: float  # its blocks' profiled time
    overlap: float  # share of it with another rank computing


def _actions(plan: Plan, raw: CostModel, result: Measurement) -> list[_Action]:
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
            out.append(_Action(rec.stage, dev, kind, ms, p, min(1.0, shared / ms)))
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


def _compute(
    plan: Plan, actions: list[_Action], types: list[str]
) -> tuple[float, dict[str, tuple[float, float]], bool]:
    """(co-run slow-down, {type: (fwd scale, bwd scale)}, whether the slow-down was fitted)."""
    default = corun_slowdown(plan_cost_model(plan).profile)
    tried = {c: _scales_at(plan, actions, types, c) for c in sorted({*_CORUN_GRID, default})}
    c = min(tried, key=lambda k: (tried[k][0], k != default))
    alone = sum(a.overlap < 0.25 for a in actions) / len(actions)
    busy = sum(a.overlap > 0.75 for a in actions) / len(actions)
    if alone >= 0.1 and busy >= 0.1 and tried[c][0] < _BETTER * tried[default][0]:
        return c, tried[c][1], True
    return default, tried[default][1], False


def _scales_at(
    plan: Plan, actions: list[_Action], types: list[str], corun: float
) -> tuple[float, dict[str, tuple[float, float]]]:
    """At co-run slow-down ``corun``: the squared log error of the best compute scale per
    device type, and the scales ([Note: a scale and a fixed cost per action])."""
    cm = plan_cost_model(plan, {t: Calibration(corun_slowdown=corun) for t in types})
    alone, busy = 1.0 / cm.time.speeds[0], 1.0 / cm.time.speeds[-1]

    def g(a: _Action) -> float:
        return (1 - a.overlap) * alone + a.overlap * busy

    lines = {t: _line([a for a in actions if a.device == t], g) for t in types}
    err = 0.0
    for a in actions:
        slope, fixed = lines[a.device]
        err += math.log(a.ms / (g(a) * (slope * a.profiled + fixed))) ** 2
    return err, {t: (slope, slope) for t, (slope, _) in lines.items()}


def _line(actions: list[_Action], g: Callable[[_Action], float]) -> tuple[float, float]:
    """(scale, fixed ms) of measured ÷ g = scale × profiled + fixed, least squares over the
    median of each stage's forwards and backwards; fixed ≥ 0.

    [Note: a scale and a fixed cost per action] A runtime action costs more than
    its blocks' profiled time by a part that grows with it (the profile's own error)
    and a part that does not (the pipeline's bookkeeping inside the action): fitted
    as one ratio, the fixed part would be scaled up with every larger micro-batch and
    every longer stage. The fixed part is not kept here: the action overhead, fitted
    last to the step, carries every fixed cost per action.
    """
    groups: dict[tuple[int, str], list[_Action]] = {}
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
        if slope > 0 and fixed >= 0:
            return slope, fixed
    through_origin = sum(x * y for x, y in pts) / max(sum(x * x for x, _ in pts), 1e-12)
    return through_origin, 0.0


# --------------------------------------------------------------------------- the rest


def _optimizer(plan: Plan, cm: CostModel, result: Measurement, counted: set[int]) -> float | None:
    """Σ measured ÷ Σ predicted optimizer step over the stages (None: not measured)."""
    measured = predicted = 0.0
    for st in plan.stages:
        got = [
            d
            for r in result.records
            if r.stage == st.index
            for d in r.durations("optimizer", counted)
        ]
        if not got:
            return None
        measured += statistics.median(got)
        predicted += cm.time.optimizer_ms(st.index, *st.blocks)
    return measured / predicted if predicted > 0 and measured > 0 else None


def _allreduce(plan: Plan, cm: CostModel, result: Measurement, counted: set[int]) -> float | None:
    """Σ over stages of the last backward's excess over the others ÷ Σ predicted all-reduce
    (None: dp 1, or a single micro-batch, or nothing to compare)."""
    m = plan.micro_batches
    if plan.dp == 1 or m == 1:
        return None
    measured = predicted = 0.0
    for st in plan.stages:
        recs = [r for r in result.records if r.stage == st.index]
        last = [
            iv.ms
            for r in recs
            for iv in r.intervals
            if iv.kind == "B" and iv.step in counted and iv.micro_batch == m - 1
        ]
        rest = [d for r in recs for d in r.durations("B", counted, skip_mb=m - 1)]
        if not last or not rest:
            return None
        measured += max(0.0, median(last) - median(rest))
        predicted += cm.time.reduce_ms(st.index, *st.blocks)
    return measured / predicted if predicted > 0 and measured > 0 else None


def _p2p(
    plan: Plan, cm: CostModel, result: Measurement, counted: set[int]
) -> tuple[float | None, int]:
    """(the median transfer time beyond the predicted one, ≥ 0; hops used), (None, 0) for
    pp 1 or no transfer whose receiver was waiting."""
    if plan.pp == 1:
        return None, 0
    by = {(r.stage, r.replica): r for r in result.records}
    extra = []
    for (s, rep), sender in by.items():
        receiver = by.get((s + 1, rep))
        if receiver is None:
            continue
        fwd_ms, bwd_ms = cm.time.cut(s, plan.stages[s + 1].blocks[0])
        extra += [g - fwd_ms for g in _gaps(sender, receiver, "F", counted)]
        extra += [g - bwd_ms for g in _gaps(receiver, sender, "B", counted)]
    if not extra:
        return None, 0
    return max(0.0, statistics.median(extra)), len(extra)


def _gaps(src: RankRecord, dst: RankRecord, kind: str, counted: set[int]) -> list[float]:
    """ms from ``kind`` of a micro-batch ending on ``src`` to it starting on ``dst``, when
    ``dst`` was waiting (its previous action ended before ``src``'s did)."""
    ends = {
        (iv.step, iv.micro_batch): iv.end
        for iv in src.intervals
        if iv.kind == kind and iv.step in counted
    }
    mine = sorted(
        (iv.start, iv.end, iv.kind, iv.step, iv.micro_batch)
        for iv in dst.intervals
        if iv.kind in ("F", "B", "loss") and iv.step in counted
    )
    out = []
    for k, (start, _, kd, step, mb) in enumerate(mine):
        sent = ends.get((step, mb))
        if kd != kind or sent is None or start < sent:
            continue
        if k and mine[k - 1][1] > sent:  # busy when it arrived: no wait to measure
            continue
        out.append((start - sent) * 1e3)
    return out


def _overhead(plan: Plan, cals: dict[str, Calibration], measured_ms: float) -> float:
    """The action overhead (ms, ≥ 0) at which the plan's placement's simulated step is the
    measured one (0 when even without it the step is predicted slower)."""
    starts = [st.blocks[0] for st in plan.stages]

    def step(o: float) -> float:
        with_o = {t: replace(c, action_overhead_ms=o) for t, c in cals.items()}
        return plan_cost_model(plan, with_o).step_ms(starts)

    if step(0.0) >= measured_ms:
        return 0.0
    lo, hi = 0.0, 1.0
    while step(hi) < measured_ms and hi < 1e6:
        lo, hi = hi, hi * 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < measured_ms else (lo, mid)
    return (lo + hi) / 2
