"""What a stage module reads: the parameters and buffers its graphs reach, and the rest removed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.fx
from torch import nn

__all__ = ["prune_unused", "used_tensors"]


def used_tensors(root: nn.Module) -> set[str]:
    """Names (all aliases) of the parameters and buffers ``root``'s graphs actually read.

    A tensor is used when a ``get_attr`` of a graph reaches it, or when it
    belongs to a module the graph calls that has no graph of its own (a leaf).
    """
    read: set[int] = set()
    seen: set[int] = set()

    def mark(mod: nn.Module) -> None:
        read.update(id(t) for _, t in _state(mod))

    def visit(mod: nn.Module) -> None:
        if id(mod) in seen:
            return
        seen.add(id(mod))
        calls = getattr(mod, "call_modules", None)  # export's dispatcher of repeated calls
        graph = getattr(mod, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            if callable(calls):
                for call in calls():
                    visit(call)
            else:
                mark(mod)
            return
        for node in graph.nodes:
            if node.op == "get_attr":
                target = _resolve(mod, str(node.target))
                if isinstance(target, nn.Module):
                    mark(target)
                elif isinstance(target, torch.Tensor):
                    read.add(id(target))
            elif node.op == "call_module":
                visit(mod.get_submodule(str(node.target)))

    visit(root)
    return {name for name, t in _state(root) if id(t) in read}


def _state(mod: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from mod.named_parameters(remove_duplicate=False)
    yield from mod.named_buffers(remove_duplicate=False)


def _resolve(mod: nn.Module, target: str) -> Any:
    obj: Any = mod
    for atom in target.split("."):
        obj = getattr(obj, atom, None)
        if obj is None:
            return None
    return obj


def prune_unused(module: nn.Module, used: set[str]) -> None:
    """Remove the parameters and buffers ``module`` holds but never reads."""
    for name, _ in list(_state(module)):
        if name in used:
            continue
        owner, _, leaf = name.rpartition(".")
        parent = module.get_submodule(owner) if owner else module
        if leaf in parent._parameters:
            del parent._parameters[leaf]
        elif leaf in parent._buffers:
            del parent._buffers[leaf]
            parent._non_persistent_buffers_set.discard(leaf)
