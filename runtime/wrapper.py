"""A stage module wrapped for how it runs, still showing its graph to torch.

The runtime wraps a stage's module for the plan's promises: recompute
(``runtime.recompute.Recompute``), the dtypes sent on the wire
(``runtime.precision.SendAs``), outputs a split backward may detach
(``runtime.zero_bubble.Detachable``). torch's traced stage reads
``submod.graph`` to lay out its buffers on the first step, so each wrapper
shows the wrapped module's fx graph; its parameters are the module's, under
the prefix ``module.``.
"""

from __future__ import annotations

import torch.fx
from torch import nn

__all__ = ["StageWrapper"]


class StageWrapper(nn.Module):
    """``module`` wrapped (subclasses say how), showing its fx ``graph``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    @property
    def graph(self) -> torch.fx.Graph:
        graph = self.module.graph
        assert isinstance(graph, torch.fx.Graph)
        return graph
