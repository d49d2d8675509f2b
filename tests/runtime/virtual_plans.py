"""Plans of several stages per rank for the runtime's tests: planned by the search with
pp 2 × v 2 pinned (:func:`planned_virtual`), or a planned 4-stage plan made into pp 2 × v 2,
as ``planner.plan`` documents it (tests/plan/test_plan_consistency.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from small_examples import batch, build, loss_for

from planner.devices import from_gpus
from planner.options import PlanOptions, SearchOptions, Training
from planner.plan import Plan, load_plan
from planner.plan.schedule import stage_ranks
from planner.planning import plan_model

__all__ = ["BATCH", "planned_4", "planned_virtual", "virtual_plan"]

BATCH = 8


def planned_4(model: str, dp: int, m: int, optimizer: str) -> Plan:
    """``model`` planned as 4 stages (pp 4 × dp), GPipe."""
    torch.manual_seed(0)
    x, y = batch(model, BATCH, 0)
    return plan_model(
        build(model),
        (x, y),
        cluster=from_gpus(4 * dp, "h100"),
        loss_fn=loss_for(model),
        options=PlanOptions(
            training=Training(global_batch=BATCH, optimizer=optimizer),
            search=SearchOptions(pp=4, dp=dp, micro_batches=m, schedule="gpipe"),
        ),
        model_file=f"{model}.py",
    )


def planned_virtual(model: str, schedule: str, dp: int, m: int, optimizer: str, path: Path) -> Path:
    """``model`` planned by the search as pp 2 × v 2 × ``dp`` running ``schedule`` (pinned),
    saved at ``path``: the plan the planner writes, run as it is."""
    torch.manual_seed(0)
    x, y = batch(model, BATCH, 0)
    plan = plan_model(
        build(model),
        (x, y),
        cluster=from_gpus(2 * dp, "h100"),
        loss_fn=loss_for(model),
        options=PlanOptions(
            training=Training(global_batch=BATCH, optimizer=optimizer),
            search=SearchOptions(pp=2, dp=dp, micro_batches=m, schedule=schedule, virtual=2),
        ),
        model_file=f"{model}.py",
    )
    assert (plan.pp, plan.virtual, plan.dp, len(plan.stages)) == (2, 2, dp, 4), plan.layout
    assert plan.stage_ranks == stage_ranks(schedule, 2, 2)
    path.write_text(yaml.safe_dump(plan.to_dict(), sort_keys=False))
    load_plan(path)
    return path


def virtual_plan(
    plan: Plan, schedule: str, path: Path, edit: Callable[[dict[str, Any]], None] | None = None
) -> Path:
    """``plan`` (4 stages) made into pp 2 × v 2 running ``schedule``, saved at ``path``.

    Replica r's pipeline rank k is global rank 2r + k; stage i runs on the
    pipeline rank ``stage_ranks(schedule, 2, 2)[i]``.
    """
    data = plan.to_dict()
    data["layout"] |= {"pp": 2, "virtual": 2}
    data["training"]["schedule"] = schedule
    data.pop("step", None)  # the step inputs priced 4 ranks of one stage
    on = stage_ranks(schedule, 2, 2)
    for k, st in enumerate(data["stages"]):
        st["ranks"] = [2 * r + on[k] for r in range(plan.dp)]
    if edit is not None:
        edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_plan(path)  # it loads: the plan format's checks pass
    return path
