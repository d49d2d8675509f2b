"""Blocks that repeat: price one, give its structural copies the same figures.

[Note: repeated blocks] A 70 B Llama is 80 decoder layers of one shape: an
analytic profile on the meta device would run the same forward and backward
under ``OpCostMode`` 80 times and get the same numbers 80 times. Those numbers
depend on nothing but what :func:`block_signature` writes down: the block's
graph (every node's op, its target object, its arguments with other nodes
named by position and constants by value), and each input and parameter as
metadata (shape, strides, offset, dtype, ``requires_grad``, Parameter or not,
and which of them share a storage). Meta tensors hold no values, so two blocks
with one signature run the same operators on the same shapes: the cost, the
bytes saved for backward and which inputs and outputs were saved are equal by
construction, and are copied instead of recomputed. Anything the signature
cannot state faithfully (a real tensor, whose values a data-dependent op could
read; a submodule call; a constant of an unknown type) makes the block its own
(priced as before).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from planner.devices.catalogue import Device
from planner.profile.analytic import OpCost
from planner.profile.runner import BlockRunner, attr, storage_key

__all__ = ["block_signature", "priced"]

# Constants whose repr says all there is to know about them.
_PLAIN = (
    int,
    float,
    bool,
    str,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    enum.Enum,
)


class _Unstated(Exception):
    """Something in a block the signature cannot state faithfully."""


def priced(
    runners: Sequence[BlockRunner], device: Device, dtype: str | None
) -> list[tuple[OpCost, OpCost]]:
    """``runner.cost(device, dtype)`` for every runner, once per block signature.

    Example::

        fwd_bwd = priced(runners, get_device("h100"), "bf16")   # 80 layers: 1 run

    A runner whose signature was seen gets the first one's forward and backward
    cost (copies) and its saved-bytes figures, as :meth:`BlockRunner.cost`
    would have set them (see [Note: repeated blocks]).
    """
    seen: dict[str, tuple[BlockRunner, tuple[OpCost, OpCost]]] = {}
    out: list[tuple[OpCost, OpCost]] = []
    for runner in runners:
        sig = block_signature(runner)
        if sig is not None and sig in seen:
            first, (fwd, bwd) = seen[sig]
            runner.saved_bytes = first.saved_bytes
            runner.saved_inputs = set(first.saved_inputs)
            runner.saved_outputs = set(first.saved_outputs)
            out.append((dataclasses.replace(fwd), dataclasses.replace(bwd)))
            continue
        cost = runner.cost(device, dtype)
        if sig is not None:
            seen[sig] = (runner, cost)
        out.append(cost)
    return out


def block_signature(runner: BlockRunner) -> str | None:
    """Everything the block's analytic run depends on, as text; None when not statable.

    Example::

        block_signature(runners[3]) == block_signature(runners[4])   # two like layers
    """
    storages: dict[int, int] = {}

    def tensor(t: torch.Tensor) -> str:
        if not t.is_meta:
            raise _Unstated("a tensor with values")
        alias = storages.setdefault(storage_key(t), len(storages))
        return (
            f"{type(t).__name__}{tuple(t.shape)}/{t.stride()}+{t.storage_offset()}"
            f":{t.dtype}:{int(t.requires_grad)}@{alias}"
        )

    def value(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return tensor(v)
        return _constant(v)

    try:
        parts = ["in:" + ",".join(value(v) for v in runner.inputs)]
        parts += _graph(runner.module, tensor)
    except _Unstated:
        return None
    return "\n".join(parts)


def _graph(module: torch.fx.GraphModule, tensor: Any) -> list[str]:
    """One line per node: op, target, arguments (nodes by position, constants by value)."""
    index: dict[torch.fx.Node, int] = {}
    lines = []
    for k, node in enumerate(module.graph.nodes):
        index[node] = k
        if node.op == "call_module":
            raise _Unstated("a submodule call")
        if node.op == "get_attr":
            target = tensor(attr(module, str(node.target)))
        elif node.op in ("call_function", "call_method"):
            target = f"{getattr(node.target, '__name__', node.target)}#{id(node.target)}"
        else:
            target = node.op
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _Ref(index[n]))  # type: ignore[arg-type,return-value]
        lines.append(f"{node.op}|{target}|{_constant(args)}")
    return lines


@dataclasses.dataclass(frozen=True)
class _Ref:
    """Another node of the block, by position."""

    at: int


def _constant(v: Any) -> str:
    if isinstance(v, _Ref):
        return f"%{v.at}"
    if isinstance(v, _PLAIN):
        return f"{type(v).__name__}:{v!r}"
    if isinstance(v, (tuple, list)):
        return f"{type(v).__name__}[{','.join(_constant(x) for x in v)}]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{_constant(k)}={_constant(x)}" for k, x in v.items()) + "}"
    if isinstance(v, slice):
        return f"slice({_constant(v.start)},{_constant(v.stop)},{_constant(v.step)})"
    raise _Unstated(f"a constant of type {type(v).__name__}")
