"""Executes a planner Plan: pipeline stages × data-parallel replicas (torch.distributed)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "Mesh",
    "ParallelModel",
    "PlanMismatch",
    "StageError",
    "StageModule",
    "TiedParams",
    "build_stage",
    "build_tied",
    "check_plan",
    "init_mesh",
    "tied_sets",
]

# Exports resolve lazily: `import runtime` stays cheap (no torch.distributed import).
_WHERE = {
    "Mesh": "runtime.mesh",
    "PlanMismatch": "runtime.mesh",
    "check_plan": "runtime.mesh",
    "init_mesh": "runtime.mesh",
    "StageError": "runtime.stages",
    "StageModule": "runtime.stages",
    "build_stage": "runtime.stages",
    "TiedParams": "runtime.tied",
    "build_tied": "runtime.tied",
    "tied_sets": "runtime.tied",
    "ParallelModel": "runtime.engine",
}

if TYPE_CHECKING:
    from runtime.engine import ParallelModel
    from runtime.mesh import Mesh, PlanMismatch, check_plan, init_mesh
    from runtime.stages import StageError, StageModule, build_stage
    from runtime.tied import TiedParams, build_tied, tied_sets


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
