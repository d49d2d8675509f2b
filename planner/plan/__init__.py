"""The contract between the planner and the runtime: the plan, and what both sides share.

The runtime imports this package and nothing else of the planner. Its parts:
``schema`` (the plan), ``sections`` (its typed sections), ``choice`` (why its
configuration), ``codec`` (typed records to plain data
and back), ``formats`` (versions), ``files`` (plan files, the atomic write),
``records`` (the profile a plan carries), ``schedule`` (the schedules as data),
``timeline`` (events and trace JSON), ``fingerprint`` (the model's identity),
``modelfile`` and ``batch`` (the model.py contract), ``default_loss``,
``fields`` (option fields declared once, for dataclasses and the command
line), ``units`` and ``text``.

Importing the package itself loads no torch: the names below are pure.
"""

from __future__ import annotations

from planner.plan.choice import ChoiceRecord, FastestRecord
from planner.plan.files import atomic_write, load_plan, plan_text, save_plan
from planner.plan.formats import PLAN_VERSION, SUPPORTED_VERSIONS
from planner.plan.schema import Plan, PlanError, plan_summary
from planner.plan.sections import (
    Candidate,
    ClusterRecord,
    DeviceGroup,
    LayoutPlan,
    LinkRecord,
    ModelInfo,
    NodeRecord,
    Predicted,
    SolverRecord,
    StageMemory,
    StagePlan,
    StepInputs,
    TrainingPlan,
)

__all__ = [
    "PLAN_VERSION",
    "SUPPORTED_VERSIONS",
    "Candidate",
    "ChoiceRecord",
    "ClusterRecord",
    "DeviceGroup",
    "FastestRecord",
    "LayoutPlan",
    "LinkRecord",
    "ModelInfo",
    "NodeRecord",
    "Plan",
    "PlanError",
    "Predicted",
    "SolverRecord",
    "StageMemory",
    "StagePlan",
    "StepInputs",
    "TrainingPlan",
    "atomic_write",
    "load_plan",
    "plan_summary",
    "plan_text",
    "save_plan",
]
