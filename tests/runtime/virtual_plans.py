"""Plans of several stages per rank for the runtime's tests: a planned 4-stage plan made
into pp 2 × v 2, as ``planner.plan`` documents it (tests/plan/test_plan_consistency.py)."""

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

__all__ = ["BATCH", "planned_4", "virtual_plan"]

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
