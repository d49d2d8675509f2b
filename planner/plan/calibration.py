"""A calibration applied to a profile, and taken off again.

A :class:`~planner.plan.records.Calibration` (fitted by ``planner calibrate``,
stored with the profile cache, applied by ``planner.profile.sizes`` when a
plan's profiles are made) corrects the cost model in two places: the compute
scales multiply the profile's times here, so that every reader of a profile (the bounds, the
heuristics, the stage figures, the plan's record) sees the same numbers; the
other figures (the action overhead, the co-run slow-down, the optimizer,
transfer and all-reduce scales) are read by ``stage_time`` and ``step_time``
from the profile while they price a layout.

Pure: no torch.
"""

from __future__ import annotations

from dataclasses import replace

from planner.plan.records import Calibration, ModelProfile

__all__ = ["calibrated", "uncalibrated"]


def calibrated(profile: ModelProfile, calibration: Calibration) -> ModelProfile:
    """``profile`` with ``calibration`` applied (a calibration already there is taken off
    first).

    Example::

        prof = calibrated(prof, Calibration(fwd_scale=1.1, bwd_scale=1.2))
        prof.blocks[0].fwd_ms   # 1.1 × the profiled figure
    """
    raw = uncalibrated(profile)
    return _scaled(raw, calibration.fwd_scale, calibration.bwd_scale, calibration)


def uncalibrated(profile: ModelProfile) -> ModelProfile:
    """``profile`` as it was profiled (its calibration taken off)."""
    cal = profile.calibration
    if cal is None:
        return profile
    fwd = 1.0 / cal.fwd_scale if cal.fwd_scale > 0 else 1.0
    bwd = 1.0 / cal.bwd_scale if cal.bwd_scale > 0 else 1.0
    return _scaled(profile, fwd, bwd, None)


def _scaled(
    profile: ModelProfile, fwd: float, bwd: float, calibration: Calibration | None
) -> ModelProfile:
    blocks = tuple(replace(b, fwd_ms=b.fwd_ms * fwd, bwd_ms=b.bwd_ms * bwd) for b in profile.blocks)
    return replace(
        profile,
        blocks=blocks,
        loss_fwd_ms=profile.loss_fwd_ms * fwd,
        loss_bwd_ms=profile.loss_bwd_ms * bwd,
        calibration=calibration,
    )
