"""The one owner of time and memory: a placement in, its predicted step out.

``basis`` (the layout and the blocks' tables), ``stage_time`` (a stage's
compute, sends, all-reduce, tied exchange, optimizer step; ``agreement``, the
norm read before the optimizer step), ``stage_memory``
(a stage's peak, by kind), ``model`` (:class:`CostModel`: segments for the
solver, :meth:`CostModel.predict` for a placement), ``simulate`` (the step's
timeline, the only producer of one), ``step_time`` (the closed form, bounds),
``segment_bound`` (bounds per segment, for the step solver).

Pure: no torch, no PuLP.
"""

from __future__ import annotations

from planner.cost.basis import Layout, state_bytes
from planner.cost.model import CostModel, Prediction, StagePrediction
from planner.cost.simulate import replay, simulate
from planner.cost.stage_memory import MemoryBreakdown
from planner.cost.stage_time import ACTION_OVERHEAD_MS, cpu_speeds
from planner.cost.step_time import closed_form, work_bound

__all__ = [
    "ACTION_OVERHEAD_MS",
    "CostModel",
    "Layout",
    "MemoryBreakdown",
    "Prediction",
    "StagePrediction",
    "closed_form",
    "cpu_speeds",
    "replay",
    "simulate",
    "state_bytes",
    "work_bound",
]
