"""The model as a torch.fx graph, cut into a chain of blocks.

``trace`` (:func:`capture`: ``torch.export``, then ``symbolic_trace``),
``explain`` (why both failed, and where), ``blocks`` (the chain: split points,
granularity), ``liveness`` (what crosses a split point), ``tied`` (one tensor
under several names), ``subgraph`` (a runnable module cut from a run of nodes),
``dynamic`` (outputs whose dim 0 depends on the values, and the op behind it).
"""

from __future__ import annotations

from planner.capture.blocks import Block, BlockChain, SplitPointExcluded, build_blocks
from planner.capture.subgraph import extract
from planner.capture.trace import Captured, CaptureError, ModuleCall, TensorInfo, capture

__all__ = [
    "Block",
    "BlockChain",
    "CaptureError",
    "Captured",
    "ModuleCall",
    "SplitPointExcluded",
    "TensorInfo",
    "build_blocks",
    "capture",
    "extract",
]
