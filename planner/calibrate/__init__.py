"""Calibration: fit the cost model to a run of a plan, keep the fit, and plan again with it.

``fit`` (:func:`fit`: a plan and its measured run → a ``Calibration`` per device
type, [Note: what a calibration fits, and in which order]; ``compute``, its first
step), ``priced`` (:func:`plan_cost_model`: a plan's cost model, with or without a
calibration), ``command`` (``planner calibrate``: measure, fit, store, re-solve),
``text`` (its report).
"""

from __future__ import annotations

from planner.calibrate.fit import Fit, fit
from planner.calibrate.priced import plan_cost_model

__all__ = ["Fit", "fit", "plan_cost_model"]
