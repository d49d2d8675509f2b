"""Executes a planner Plan: pipeline stages × data-parallel replicas (torch.distributed).

It imports ``planner.plan`` (the contract) and nothing else of the planner.
The parts: ``options`` (every knob), ``launch`` (``planner run``), ``agent``
and ``rendezvous`` (torchrun, on loopback), ``lifecycle`` and ``lock`` (a
job dies with its launcher; one run per checkpoint folder), ``worker``
(``python -m runtime``), ``failure`` (how a worker ends), ``checks`` (before
any communication), ``data`` (the model file's dataset, sharded over the
replicas), ``mesh`` (the dp × pp process groups), ``materialize`` and
``weights`` (a stage built without the whole model, filled by name),
``split`` (the model cut at the split points), ``stage`` (this rank's stage,
DDP), ``accumulate`` (pp = 1: the model under DDP), ``schedule``,
``recompute`` and ``precision`` (the plan's recompute and bf16-mixed, as
priced), ``tied`` (tied weights across stages), ``gradients`` (the global
norm, clipping, non-finite steps), ``engine`` (:class:`ParallelModel`),
``checkpoint`` and ``measure``.
"""

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
    "build_stages",
    "build_tied",
    "check_plan",
    "init_mesh",
    "tied_sets",
]

# Exports resolve lazily: `import runtime` stays cheap (no torch.distributed import).
_WHERE = {
    "Mesh": "runtime.mesh",
    "PlanMismatch": "runtime.checks",
    "check_plan": "runtime.checks",
    "init_mesh": "runtime.mesh",
    "StageError": "runtime.split.errors",
    "StageModule": "runtime.stage",
    "build_stage": "runtime.stage",
    "build_stages": "runtime.stage",
    "TiedParams": "runtime.tied",
    "build_tied": "runtime.tied",
    "tied_sets": "runtime.tied",
    "ParallelModel": "runtime.engine",
}

if TYPE_CHECKING:
    from runtime.checks import PlanMismatch, check_plan
    from runtime.engine import ParallelModel
    from runtime.mesh import Mesh, init_mesh
    from runtime.split.errors import StageError
    from runtime.stage import StageModule, build_stage, build_stages
    from runtime.tied import TiedParams, build_tied, tied_sets


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
