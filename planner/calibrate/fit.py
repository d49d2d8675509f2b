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
   better than at the default; it prices layouts without replicas only, and a
   run with replicas (dp > 1) does not fit it ([Note: whose co-run a
   calibration fits] in ``planner.cost.stage_time``). DDP's all-reduce inside
   each stage's last backward (dp > 1) is left out.
2. **the optimizer step**: Σ over stages of the measured step ÷ Σ predicted.
3. **the all-reduce** (dp > 1, m > 1): the last backward's excess over the
   other backwards, per stage, Σ measured ÷ Σ predicted ``reduce_ms``.
4. **transfers** (pp > 1): the gap between a micro-batch's action ending on
   one stage and starting on the next, when the next was waiting for it; the
   median gap beyond the predicted transfer is ``p2p_extra_ms`` (≥ 0).
5. **the action overhead**, last: the fixed cost per action (≥ 0) that makes
   the simulated step of the plan's placement equal its measured step
   (bisection: the step only grows with it). When the step is predicted
   slower than measured even without it, the compute scales are lowered by one
   factor instead (not below ``SCALE_RANGE``'s floor). So the fitted step
   matches the run by construction, unless the floor stops it; how well a
   calibration predicts is measured on other runs (``planner calibrate
   --check``, ``bench accuracy``).

Each figure keeps its default (and is not named in ``Calibration.fitted``) when
the run cannot determine it: a single process has no co-run, transfers or
all-reduce.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from planner.calibrate.compute import SCALE_RANGE, compute_scales, measured_actions, shares
from planner.calibrate.priced import plan_cost_model
from planner.cost.model import CostModel
from planner.plan.measured import Measurement, RankRecord, median
from planner.plan.records import Calibration
from planner.plan.schema import Plan

__all__ = ["Fit", "fit"]


@dataclass(frozen=True)
class Fit:
    """A calibration per device type, and the figures it came from."""

    calibrations: dict[str, Calibration]
    actions: int  # forward and backward actions the compute fit used
    overlap: tuple[float, float]  # share of actions mostly alone, mostly overlapped
    hops: int  # transfers the p2p fit used


def fit(plan: Plan, result: Measurement) -> Fit:
    """The calibration of ``plan``'s cost model that ``result`` (a run of it) supports.

    See [Note: what a calibration fits, and in which order].

    Raises:
        ValueError: ``result`` is not a run of ``plan`` (other ranks or stages, another
            batch), or it holds no counted forward action.
    """
    _check_run(plan, result)
    raw = plan_cost_model(plan)
    actions = measured_actions(plan, raw, result)
    if not any(a.kind == "F" for a in actions):
        raise ValueError("the run recorded no forward action in its counted steps")
    types = sorted({a.device for a in actions})
    overlap = shares(actions)
    corun, scales, corun_fitted = compute_scales(plan, actions, types, raw, overlap)
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
    figures = {"optimizer_scale": opt, "allreduce_scale": red, "p2p_extra_ms": extra}
    fitted += [name for name, value in figures.items() if value is not None]
    cals = {
        t: replace(
            c,
            optimizer_scale=c.optimizer_scale if opt is None else opt,
            allreduce_scale=c.allreduce_scale if red is None else red,
            p2p_extra_ms=c.p2p_extra_ms if extra is None else extra,
        )
        for t, c in cals.items()
    }
    cals = _overhead(plan, cals, result.step_ms)
    fitted.append("action_overhead_ms")
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
    return Fit(cals, len(actions), overlap, hops)


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


def _overhead(
    plan: Plan, cals: dict[str, Calibration], measured_ms: float
) -> dict[str, Calibration]:
    """``cals`` with the action overhead (ms, ≥ 0) at which the plan's placement's simulated
    step is the measured one.

    When even without overhead the step is predicted slower than measured, the compute
    scales are lowered instead, by one factor (each scale no lower than ``SCALE_RANGE``'s
    floor), so that the fit still reproduces the run it came from (a fit that does not:
    ResNet's 1×1 fit at 4ed565b priced its own 51 ms launches at 110.9 ms)."""
    starts = [st.blocks[0] for st in plan.stages]

    def with_(o: float, k: float = 1.0) -> dict[str, Calibration]:
        return {
            t: replace(
                c,
                action_overhead_ms=o,
                fwd_scale=max(SCALE_RANGE[0], k * c.fwd_scale),  # k ≤ 1
                bwd_scale=max(SCALE_RANGE[0], k * c.bwd_scale),
            )
            for t, c in cals.items()
        }

    def step(o: float, k: float = 1.0) -> float:
        return plan_cost_model(plan, with_(o, k)).step_ms(starts)

    if step(0.0) >= measured_ms:  # the factor k: step(0, k) is measured, or the floor
        if step(0.0, 0.0) >= measured_ms:
            return with_(0.0, 0.0)
        return with_(0.0, _bisect(lambda k: step(0.0, k), measured_ms, 1.0))
    hi = 1.0
    while step(hi) < measured_ms and hi < 1e6:
        hi *= 2
    return with_(_bisect(step, measured_ms, hi))


def _bisect(f: Callable[[float], float], target: float, hi: float) -> float:
    """x in [0, hi] with f(x) = target, f growing (f(0) < target ≤ f(hi))."""
    lo = 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2
