"""Calibration: fit the cost model to a run of a plan, keep the fit, and plan again with it.

``fit`` (:func:`fit`: a plan and its measured run → a ``Calibration`` per device
type, [Note: what a calibration fits, and in which order]), ``loop`` (the
``planner calibrate`` command's work: measure, fit, store, re-solve, report).
"""

from __future__ import annotations

from planner.calibrate.fit import Fit, fit, plan_cost_model

__all__ = ["Fit", "fit", "plan_cost_model"]
