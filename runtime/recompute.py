"""The plan's recompute, run as priced: a recomputing stage keeps only its input per micro-batch.

[Note: recompute as it runs]
The cost model (``planner.cost.stage_memory``, ``stage_time.bwd``) prices a
recomputing stage as one that keeps, for each micro-batch in flight, only the
stage's input, and runs its whole forward again at the start of that
micro-batch's backward: backward time = forward + backward. That is
activation checkpointing of the stage as a whole, which :class:`Recompute`
does with ``torch.utils.checkpoint`` (non-reentrant: it works under DDP and
with keyword inputs, and replays the forward's RNG state, so dropout draws the
same mask twice, and its autocast state, so bf16-mixed recomputes in bf16).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime.wrapper import StageWrapper

__all__ = ["Recompute", "maybe_recompute"]


class Recompute(StageWrapper):
    """``module`` run under activation checkpointing: its activations are recomputed in backward.

    Example::

        stage_module = Recompute(stage_module)      # the same outputs, less memory

    It shows the wrapped module's fx ``graph`` (torch's traced stages read it).
    Its parameters are ``module``'s, under the prefix ``module.``.
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.module, *args, use_reentrant=False, **kwargs)


def maybe_recompute(module: nn.Module, recompute: bool) -> nn.Module:
    """``Recompute(module)`` when the plan's stage recomputes, else ``module`` itself."""
    return Recompute(module) if recompute else module
