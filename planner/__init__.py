"""Automatic pipeline + data-parallel partitioning for PyTorch models.

``planner profile model.py`` profiles a model block by block; ``planner plan``
searches and solves for the fastest placement and writes a plan file. Public
names are imported lazily so that ``import planner`` stays cheap (torch loads
on first use).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = [
    "ModelProfile",
    "Plan",
    "PlanOptions",
    "ProfileOptions",
    "__version__",
    "auto_parallel",
    "load_plan",
    "plan_model",
    "profile_model",
]

_WHERE = {
    "auto_parallel": "planner.auto",
    "profile_model": "planner.profile.profiler",
    "ProfileOptions": "planner.options",
    "ModelProfile": "planner.plan.records",
    "Plan": "planner.plan.schema",
    "load_plan": "planner.plan.files",
    "plan_model": "planner.planning",
    "PlanOptions": "planner.options",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
