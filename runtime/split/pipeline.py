"""The primary split: ``torch.distributed.pipelining.pipeline()`` at the plan's split points."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.pipelining import pipe_split, pipeline

from runtime.split.errors import Example, StageError

__all__ = ["split_pipeline"]


def split_pipeline(model: nn.Module, points: list[str], example: Example) -> Any:
    """``pipeline()`` with a ``pipe_split()`` before the FIRST call of each split point module.

    ``split_spec={fqn: SplitPoint.BEGINNING}`` would split before *every* call
    of the module (a ReLU applied twice in a residual block gives two splits),
    but a plan's split point is the start of the module's first call (the
    planner never proposes a later call). So the markers are forward pre-hooks
    that fire once per trace; they are removed afterwards, leaving the model as
    it was.
    """
    args, kwargs = example
    armed = dict.fromkeys(points, True)

    def marker(fqn: str) -> Any:
        def hook(module: nn.Module, inputs: Any) -> None:
            if armed[fqn]:
                armed[fqn] = False
                pipe_split()

        return hook

    handles = []
    modes = [(m, m.training) for m in model.modules()]
    try:
        for fqn in points:
            try:
                mod = model.get_submodule(fqn)
            except AttributeError as exc:
                raise StageError(f"split point {fqn!r} is not a submodule of the model") from exc
            handles.append(mod.register_forward_pre_hook(marker(fqn)))
        return pipeline(model, mb_args=tuple(args), mb_kwargs=dict(kwargs) or None)
    finally:
        for handle in handles:
            handle.remove()
        for m, training in modes:
            m.training = training
