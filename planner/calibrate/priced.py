"""The cost model of a plan as it was priced, from the profiles the plan carries, with or
without a calibration: what the fit compares a run with, and what the benchmarks re-price."""

from __future__ import annotations

from planner.cost.basis import Layout
from planner.cost.model import CostModel
from planner.devices.cluster_file import from_record
from planner.options import Training
from planner.plan.calibration import calibrated, uncalibrated
from planner.plan.records import Calibration, ModelProfile
from planner.plan.schema import Plan

__all__ = ["plan_cost_model"]


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
        virtual=plan.virtual,
        dp_mode=plan.dp_mode,
    )
    return CostModel(profs, from_record(plan.cluster), training, layout)
