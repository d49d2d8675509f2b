"""The schedule a plan runs: torch's GPipe or 1F1B over the stages, or, for pp = 1, none.

``make_schedule`` picks it by the plan's name; a plan with one stage gets
``runtime.accumulate.Accumulate`` (the model under DDP, gradients accumulated
over the micro-batches). The loss the schedule calls is the user's
``loss_fn`` of what the model returns ([Note: one loss-normalisation rule] in
``runtime.engine``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from planner.plan.schedule import schedule_problem
from planner.plan.schema import Plan
from runtime.accumulate import Accumulate
from runtime.stage import StageModule

__all__ = ["SCHEDULES", "check_schedule", "make_schedule"]

SCHEDULES: dict[str, type] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
"""The plan's ``schedule`` name → torch's single-stage-per-rank schedule."""

LossFn = Callable[[Any, Any], Tensor]


def check_schedule(plan: Plan) -> None:
    """Refuse a schedule this runtime does not run, or one the plan's layout cannot."""
    if plan.schedule not in SCHEDULES:
        raise ValueError(
            f"the plan's schedule {plan.schedule!r} is not one this runtime runs "
            f"({', '.join(SCHEDULES)}); edit training.schedule in the plan or re-plan"
        )
    problem = schedule_problem(plan.schedule, plan.pp, plan.micro_batches)
    if problem is not None:
        why, fix = problem
        raise ValueError(f"the plan cannot run: {why}; fix: {fix} (re-plan, or edit the plan)")


def make_schedule(plan: Plan, stage: StageModule, loss_fn: LossFn) -> Any:
    """The plan's schedule over this rank's ``stage`` (``Accumulate`` when pp = 1)."""
    if plan.pp == 1:
        return Accumulate(stage, plan.micro_batches, loss_fn)
    return SCHEDULES[plan.schedule](
        stage.pipeline_stage,
        n_microbatches=plan.micro_batches,
        loss_fn=_on_model_output(loss_fn, stage.restore),
        scale_grads=True,
    )


def _on_model_output(loss_fn: LossFn, restore: Callable[[Any], Any]) -> LossFn:
    """The schedule's loss: ``loss_fn`` of what the model returns (one process's object)."""

    def stage_loss(output: Any, target: Any) -> Tensor:
        return loss_fn(restore(output), target)

    return stage_loss
