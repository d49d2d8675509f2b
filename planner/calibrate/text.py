"""The report of ``planner calibrate``: the fitted figures, the step before, after and
measured, and whether the plan changed."""

from __future__ import annotations

import shutil
import sys

from planner.calibrate.fit import Fit
from planner.calibrate.priced import plan_cost_model
from planner.cost.stage_time import ACTION_OVERHEAD_MS, CPU_CORUN_SLOWDOWN
from planner.plan.fold import output_width, wrap
from planner.plan.measured import Measurement
from planner.plan.records import Calibration
from planner.plan.schema import Plan
from planner.plan.text import ERROR_CONVENTION, fmt_error

__all__ = ["layout_line", "summary"]


def layout_line(plan: Plan) -> str:
    """'pp 2 × dp 1, m 8 × 1, 1f1b, 1 thread per process'."""
    threads = {d.threads for n in plan.cluster.nodes for d in n.devices} - {0}
    line = (
        f"pp {plan.pp} × dp {plan.dp}, m {plan.micro_batches} × {plan.micro_batch_size}, "
        f"{plan.schedule}"
    )
    if threads:
        t = max(threads)
        line += f", {t} thread{'s' if t != 1 else ''} per process"
    return line


def summary(
    plan: Plan, result: Measurement, fitted: Fit, new: Plan, checked_ms: float | None
) -> str:
    """The report (see the module docstring)."""
    measured_ms = result.step_ms
    cals = fitted.calibrations
    any_cal = next(iter(cals.values()))
    before = plan.profiles[0].calibration if plan.profiles else None
    lines = [f"calibration from a run of {any_cal.source}:"]
    lines += _figures(before, cals, plan.cluster.backend)
    alone, busy = fitted.overlap
    lines.append(
        f"  (from {fitted.actions} forward and backward actions, {alone:.0%} mostly alone and "
        f"{busy:.0%} mostly beside another computing rank; {fitted.hops} transfers)"
    )
    after = any_cal.after_ms
    lines += [
        f"step of the plan as run ({layout_line(plan)}):",
        f"  predicted before {plan.predicted.step_ms:.1f} ms "
        f"({fmt_error(plan.predicted.step_ms, measured_ms, 1)}), after {after:.1f} ms "
        f"({fmt_error(after, measured_ms, 1)}, fitted to this run); "
        f"measured {measured_ms:.1f} ms",
        *_stages(plan, result, cals),
        f"planned again with the calibration: {layout_line(new)}, "
        f"predicted {new.predicted.step_ms:.1f} ms",
        f"  {_changed(plan, new)}",
    ]
    if all(p.calibration is None for p in new.profiles):
        threads = max((p.threads for p in new.profiles), default=0)
        lines.append(
            f"  its processes have {threads} threads, for which no calibration exists: its "
            "figures are uncalibrated (calibrate it too: planner calibrate on the new plan)"
        )
    if checked_ms is not None:
        lines.append(
            f"  measured (--check, a run the fit did not see): {checked_ms:.1f} ms, "
            f"error {fmt_error(new.predicted.step_ms, checked_ms, 1)}"
        )
    lines.append(ERROR_CONVENTION)
    width = output_width(sys.stdout.isatty(), shutil.get_terminal_size().columns)
    return "\n".join(
        piece if k == 0 else "    " + piece
        for line in lines
        for k, piece in enumerate(wrap(line, width - 4))
    )


def _stages(plan: Plan, result: Measurement, cals: dict[str, Calibration]) -> list[str]:
    """Per stage, ms per micro-batch: forward and backward, predicted before → after |
    measured (DDP's last backward, which holds the all-reduce, left out: dp > 1)."""
    after = plan_cost_model(plan, cals).predict([s.blocks[0] for s in plan.stages])
    skip = plan.micro_batches if plan.dp > 1 and plan.micro_batches > 1 else None
    out = []
    for st, new in zip(plan.stages, after.stages, strict=True):
        got = result.stage_figures(st.index, skip_last_backward=skip)
        out.append(
            f"  stage {st.index}, ms per micro-batch (before → after | measured): "
            f"forward {st.fwd_ms:.2f} → {new.fwd_ms:.2f} | {got['fwd_ms']:.2f}, "
            f"backward {st.bwd_ms:.2f} → {new.bwd_ms:.2f} | {got['bwd_ms']:.2f}"
        )
    return out


def _figures(before: Calibration | None, cals: dict[str, Calibration], backend: str) -> list[str]:
    """One row per figure: the value the plan was priced with, the fitted one."""
    b = before or Calibration()
    any_cal = next(iter(cals.values()))
    fitted = set(any_cal.fitted)
    overhead = ACTION_OVERHEAD_MS.get(backend, 0.0)

    def ms(x: float | None, default: float) -> str:
        return f"{default if x is None else x:.2f} ms"

    def corun(x: float | None) -> str:
        return f"{CPU_CORUN_SLOWDOWN if x is None else x:.2f}"

    rows: list[tuple[str, str, str, str]] = []
    for dev, c in cals.items():
        rows.append(
            (f"forward, {dev}", f"× {b.fwd_scale:.2f}", f"× {c.fwd_scale:.2f}", "fwd_scale")
        )
        rows.append(
            (f"backward, {dev}", f"× {b.bwd_scale:.2f}", f"× {c.bwd_scale:.2f}", "bwd_scale")
        )
    c = any_cal
    rows += [
        ("co-run slow-down", corun(b.corun_slowdown), corun(c.corun_slowdown), "corun_slowdown"),
        (
            "optimizer step",
            f"× {b.optimizer_scale:.2f}",
            f"× {c.optimizer_scale:.2f}",
            "optimizer_scale",
        ),
        (
            "all-reduce",
            f"× {b.allreduce_scale:.2f}",
            f"× {c.allreduce_scale:.2f}",
            "allreduce_scale",
        ),
        (
            "transfer between stages",
            f"+ {b.p2p_extra_ms:.2f} ms",
            f"+ {c.p2p_extra_ms:.2f} ms",
            "p2p_extra_ms",
        ),
        (
            "fixed cost per action",
            ms(b.action_overhead_ms, overhead),
            ms(c.action_overhead_ms, overhead),
            "action_overhead_ms",
        ),
    ]
    out = [f"  {'figure':<26}{'before':>12}{'fitted':>12}"]
    for name, old, new, field in rows:
        note = "" if field in fitted else "  (kept: this run cannot tell)"
        out.append(f"  {name:<26}{old:>12}{new:>12}{note}")
    return out


def _changed(old: Plan, new: Plan) -> str:
    """Whether the re-solved plan differs from the plan as run, and how."""
    a, b = layout_line(old), layout_line(new)
    splits_a = [s.split_point for s in old.stages]
    splits_b = [s.split_point for s in new.stages]
    if a == b and splits_a == splits_b:
        return "the plan is the same (layout and split points)"
    if a == b:
        return f"the plan changed: split points {splits_a[1:]} → {splits_b[1:]}"
    return f"the plan changed: {a} → {b}"
