"""The model split at a plan's split points: a module per stage, keeping the model's names.

Two ways, the same result (a submodule per stage whose parameters and buffers
keep the model's FQNs): ``pipeline`` (``torch.distributed.pipelining``, the
primary path) and ``fx`` (the fallback for models torch.export cannot take);
``used`` finds what each stage module actually reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from planner.plan.schema import Plan
from runtime.split.errors import Example, StageError, cause_line
from runtime.split.fx import split_model
from runtime.split.pipeline import split_pipeline

__all__ = ["Example", "Parts", "StageError", "split_for_plan", "split_model"]

log = logging.getLogger(__name__)


@dataclass
class Parts:
    """The whole model split: every stage's module, and how.

    ``pipe`` is torch's Pipe (the ``pipeline`` path); ``shapes`` each stage's
    example inputs and outputs (the ``fx`` path); ``reason`` why ``pipeline``
    was not used (None when it was); ``restore`` turns the last stage's output
    into what the model returns (the loss's first argument).
    """

    modules: list[nn.Module]
    method: str
    reason: str | None = None
    pipe: Any = None
    shapes: list[tuple[Any, Any]] = field(default_factory=list)
    restore: Callable[[Any], Any] = field(default=lambda out: out)


def split_for_plan(model: nn.Module, plan: Plan, example: Example, split: str) -> Parts:
    """Split ``model`` at ``plan``'s split points: ``pipeline`` first ("auto"), or as forced.

    Raises:
        StageError: the split does not give the plan's pp · v stages, or both ways
            failed (the message says why each did).
    """
    points = plan.split_points
    reason: str | None = None
    if split in ("auto", "pipeline"):
        try:
            pipe, restore = split_pipeline(model, points, example)
        except Exception as exc:
            if split == "pipeline":
                raise StageError(
                    f"torch.distributed.pipelining.pipeline() could not split the model at "
                    f"{points}: {type(exc).__name__}: {cause_line(exc)}"
                ) from exc
            reason = f"{type(exc).__name__}: {cause_line(exc)}"
            log.warning("pipeline() failed (%s); splitting a symbolic_trace graph instead", reason)
        else:
            _check_count(pipe.num_stages, plan)
            mods = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
            return Parts(modules=mods, method="pipeline", pipe=pipe, restore=restore)
    try:
        mods, shapes = split_model(model, points, example)
    except StageError as exc:
        if reason is None:
            raise
        raise StageError(f"{exc}\n  (pipeline() failed first: {reason})") from exc
    return Parts(modules=list(mods), method="fx", reason=reason, shapes=shapes)


def _check_count(n: int, plan: Plan) -> None:
    if n != len(plan.stages):
        has = (
            f"pp = {plan.pp}"
            if plan.virtual == 1
            else (f"{len(plan.stages)} stages (pp {plan.pp} × virtual {plan.virtual})")
        )
        raise StageError(
            f"splitting at the plan's split points {plan.split_points} gave {n} stages, but "
            f"the plan has {has}.\n  why: a split point module is not called in the "
            "forward, or is called where torch.export cannot cut (inside another call).\n"
            "  fix: re-plan the model (`planner plan`), or edit the plan's split points to "
            "module calls on the forward's main path"
        )
