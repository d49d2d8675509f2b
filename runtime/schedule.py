"""The schedule a plan runs: torch's schedule over this rank's stages, or, for pp = 1, none.

``make_schedule`` picks it by the plan's name: GPipe and 1F1B run one stage per
rank; Interleaved 1F1B and Looped BFS run ``v`` stages per rank (stage i on
pipeline position i mod pp), torch's ``_PipelineScheduleRuntime`` executing
their action lists. A plan with one stage gets ``runtime.accumulate.Accumulate``
(the model under DDP, gradients accumulated over the micro-batches). The loss
the schedule calls is the user's ``loss_fn`` of what the model returns ([Note:
one loss-normalisation rule] in ``runtime.engine``).

The zero-bubble schedules (Interleaved ZB, ZB-V, DualPipeV) split each
backward into the input's part and the weights'; what their stages need is in
``runtime.zero_bubble`` ([Note: a split backward keeps the stage's graph],
[Note: DDP under a split backward], [Note: the V schedules' neighbours on one
rank]). ZB-V and DualPipeV place stages down the ranks and back up
(``planner.plan.schedule.stage_ranks``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from planner.plan.schedule import schedule_problem
from planner.plan.schema import Plan
from runtime.accumulate import Accumulate
from runtime.mesh import pipeline_grid
from runtime.stage import StageModule

__all__ = ["MULTI_STAGE", "SCHEDULES", "check_schedule", "make_schedule"]

SCHEDULES: dict[str, type] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
"""The plan's ``schedule`` name → torch's single-stage-per-rank schedule."""

MULTI_STAGE: dict[str, type] = {
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "looped-bfs": ScheduleLoopedBFS,
    "interleaved-zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
"""The plan's ``schedule`` name → torch's schedule of several stages per rank."""

LossFn = Callable[[Any, Any], Tensor]


def check_schedule(plan: Plan) -> None:
    """Refuse a schedule this runtime does not run, or one the plan's layout cannot.

    Raised on every rank before any communication.
    """
    name, pp, v = plan.schedule, plan.pp, plan.virtual
    if name not in SCHEDULES and name not in MULTI_STAGE:
        known = ", ".join([*SCHEDULES, *MULTI_STAGE])
        raise ValueError(
            f"the plan's schedule {name!r} is not one this runtime runs ({known}); "
            "edit training.schedule in the plan or re-plan"
        )
    problem = schedule_problem(name, pp, plan.micro_batches, v)
    if problem is not None:
        why, fix = problem
        raise ValueError(f"the plan cannot run: {why}; fix: {fix} (re-plan, or edit the plan)")
    if pp == 1 and v > 1:
        raise ValueError(
            f"the plan cannot run: pp 1 with {v} stages per rank: one process runs the "
            f"whole model, and {len(plan.stages)} stages on it would only add transfers; "
            "fix: re-plan with pp 1 (one stage), or set layout.pp to the pipeline ranks wanted"
        )
    if name in MULTI_STAGE and pp > 1:
        _check_ascending(plan)


def _check_ascending(plan: Plan) -> None:
    """torch's multi-stage schedules put stage i on the pp group's rank i mod pp, and a
    group's ranks go by global rank: each replica's pipeline must run up the global ranks."""
    for r, row in enumerate(pipeline_grid(plan)):
        if list(row) != sorted(row):
            raise ValueError(
                f"the plan cannot run {plan.schedule}: replica {r}'s pipeline runs on ranks "
                f"{list(row)} (position 0 … {plan.pp - 1}), but torch's multi-stage schedules "
                "place pipeline position k on the k-th lowest rank of the pipeline's group.\n"
                f"  fix: edit the stages' ranks so that each replica's positions go up the "
                f"ranks (here {sorted(row)}), or re-plan"
            )


def make_schedule(plan: Plan, stages: Sequence[StageModule], loss_fn: LossFn) -> Any:
    """The plan's schedule over this rank's ``stages`` (``Accumulate`` when pp = 1)."""
    first = stages[0]
    if plan.pp == 1:
        return Accumulate(first, plan.micro_batches, loss_fn)
    loss = _on_model_output(loss_fn, first.restore)
    if plan.schedule in MULTI_STAGE:
        return MULTI_STAGE[plan.schedule](
            [s.pipeline_stage for s in stages],
            n_microbatches=plan.micro_batches,
            loss_fn=loss,
            scale_grads=True,
        )
    return SCHEDULES[plan.schedule](
        first.pipeline_stage, n_microbatches=plan.micro_batches, loss_fn=loss, scale_grads=True
    )


def _on_model_output(loss_fn: LossFn, restore: Callable[[Any], Any]) -> LossFn:
    """The schedule's loss: ``loss_fn`` of what the model returns (one process's object)."""

    def stage_loss(output: Any, target: Any) -> Tensor:
        return loss_fn(restore(output), target)

    return stage_loss
