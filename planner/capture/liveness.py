"""Liveness on a captured graph: which values cross a split point, and their bytes.

Every value defined before a point and used at or after it crosses it: skip
connections, long residuals and model inputs still needed later all count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx

from planner.capture.trace import Captured, TensorInfo

__all__ = [
    "Live",
    "crossing",
    "float_bytes",
    "liveness",
    "strided_bytes",
    "tensor_bytes",
    "unsendable_crossing",
]


@dataclass
class Live:
    """Where each value of the graph is defined and last used, by call-node position."""

    define: dict[torch.fx.Node, int]  # -1 for model inputs
    last_use: dict[torch.fx.Node, int]  # len(ops) when the model's output reads it


def liveness(cap: Captured, ops: list[torch.fx.Node], pos: dict[torch.fx.Node, int]) -> Live:
    """Each placeholder's and call node's definition and last use (``len(ops)``: the output)."""
    end = len(ops)
    define: dict[torch.fx.Node, int] = {}
    last_use: dict[torch.fx.Node, int] = {}
    for node in cap.gm.graph.nodes:
        if node.op == "placeholder":
            define[node] = -1
        elif node in pos:
            define[node] = pos[node]
        else:
            continue
        uses = [pos.get(u, end if u.op == "output" else -1) for u in node.users]
        last_use[node] = max(uses, default=define[node])
    return Live(define, last_use)


def crossing(live: Live, p: int) -> list[torch.fx.Node]:
    """Values defined before ``p`` and used at or after it."""
    return [n for n, d in live.define.items() if d < p <= live.last_use[n]]


def unsendable_crossing(cap: Captured, live: Live, p: int) -> str | None:
    """A value crossing position ``p`` that a pipeline stage cannot send, described, or None.

    Stages exchange tensors of fixed shapes (receive buffers are made once):
    a non-tensor ("a non-tensor value crosses it ('x' is a tuple)") or a tensor
    whose shape depends on the data ("... has a data-dependent shape") blocks
    the split point.
    """
    for node in crossing(live, p):
        info = cap.values.get(node)
        if not isinstance(info, TensorInfo):
            kind = info or "value of unknown type"
            return f"a non-tensor value crosses it ('{node.name}' is a {kind})"
        if info.data_dependent:
            return (
                f"a tensor of data-dependent shape crosses it ('{node.name}', "
                f"{list(info.shape)} on the traced batch: nonzero, masking or the like); "
                "stages exchange fixed-size buffers"
            )
    return None


def strided_bytes(cap: Captured, node: torch.fx.Node) -> int:
    """Bytes of the tensor ``node`` produces if it is not contiguous (a send copies it), else 0."""
    info = cap.values.get(node)
    return info.nbytes if isinstance(info, TensorInfo) and not info.contiguous else 0


def float_bytes(cap: Captured, node: torch.fx.Node) -> int:
    """Bytes of the tensor ``node`` produces if it is of a floating dtype (it can carry a
    gradient), else 0."""
    info = cap.values.get(node)
    if not isinstance(info, TensorInfo):
        return 0
    return info.nbytes if info.dtype.is_floating_point or info.dtype.is_complex else 0


def tensor_bytes(cap: Captured, node: torch.fx.Node) -> int:
    """Bytes of the tensor ``node`` produces (0 for a non-tensor)."""
    info = cap.values.get(node)
    return info.nbytes if isinstance(info, TensorInfo) else 0
