"""A piece of the model's graph run on its own (a profiled block, a pipeline stage): one rule.

A piece's inputs are tensors it did not make: in the profiler, leaves that
require grad; in a pipeline stage, the receive buffers of the activations (also
leaves that require grad). The model's own graph may write into such a value
in place: ``relu_`` or ``hardswish_`` right after the split point, ``out +=
identity`` in a residual block. Autograd refuses that on a leaf ("a leaf
Variable that requires grad is being used in an in-place operation"), and a
repeated forward would write into the same input again. So every input a piece
writes into is cloned first, inside the piece: its forward then works on its
own copy (one copy of that input's bytes, timed with the piece), and the
gradient flows through the clone unchanged. Both the profiler and the runtime
apply :func:`clone_written_inputs`, so what is timed is what runs.
"""

from __future__ import annotations

import operator

import torch.fx
from torch import nn

__all__ = ["clone_written_inputs", "is_view_of", "writes_into"]

_VIEW_METHODS = {
    "view",
    "view_as",
    "reshape",
    "transpose",
    "permute",
    "t",
    "expand",
    "expand_as",
    "narrow",
    "select",
    "squeeze",
    "unsqueeze",
    "flatten",
    "unflatten",
    "unfold",
    "split",
    "chunk",
    "diagonal",
    "as_strided",
    "detach",
}

_IN_PLACE_OPERATORS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imod,
    operator.ipow,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.ilshift,
    operator.irshift,
    operator.imatmul,
}


def writes_into(node: torch.fx.Node, value: torch.fx.Node, root: nn.Module | None = None) -> bool:
    """Whether ``node`` writes into ``value``.

    An ATen op by its schema; a Tensor method ending in ``_``; ``operator.iadd``
    and the like; a call of a submodule of ``root`` built with ``inplace=True``
    (``nn.ReLU(inplace=True)`` in a ``symbolic_trace`` graph), or a traced
    submodule (a GraphModule, as ``pipeline()`` stages hold) that writes into it.
    """
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        for arg, given in zip(schema.arguments, node.args, strict=False):
            info = arg.alias_info
            if info is not None and info.is_write and given is value:
                return True
        for arg in schema.arguments:
            info = arg.alias_info
            if info is not None and info.is_write and node.kwargs.get(arg.name) is value:
                return True
        return False
    if node.op == "call_method" and isinstance(node.target, str):
        name = node.target
        return name.endswith("_") and not name.endswith("__") and node.args[:1] == (value,)
    if node.op == "call_function" and getattr(node.target, "__name__", "").startswith("i"):
        return node.target in _IN_PLACE_OPERATORS and node.args[:1] == (value,)
    if node.op == "call_module" and root is not None:
        module = root.get_submodule(str(node.target))
        if getattr(module, "inplace", False) is True and node.args[:1] == (value,):
            return True
        graph = getattr(module, "graph", None)
        if isinstance(graph, torch.fx.Graph):  # a traced submodule (GraphModule, unflattened)
            inner = [n for n in graph.nodes if n.op == "placeholder"]
            return any(
                arg is value and k < len(inner) and _written(inner[k], module)
                for k, arg in enumerate(node.args)
            )
    return False


def is_view_of(node: torch.fx.Node, value: torch.fx.Node) -> bool:
    """Whether ``node``'s result shares ``value``'s memory (a transpose, a reshape view...)."""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        if not schema.returns or schema.returns[0].alias_info is None:
            return False
        return not schema.returns[0].alias_info.is_write and node.args[:1] == (value,)
    if node.op == "call_method" and node.target in _VIEW_METHODS:
        return node.args[:1] == (value,)
    if node.op == "call_function" and node.target is operator.getitem:
        return node.args[:1] == (value,)
    return False


def _written(p: torch.fx.Node, root: nn.Module | None) -> bool:
    """Whether the graph writes into ``p`` or into a view of it."""
    seen, todo = {p}, [p]
    while todo:
        value = todo.pop()
        for user in value.users:
            if writes_into(user, value, root):
                return True
            if user not in seen and is_view_of(user, value):
                seen.add(user)
                todo.append(user)
    return False


def clone_written_inputs(graph: torch.fx.Graph, root: nn.Module | None = None) -> list[str]:
    """Clone, right after it, every placeholder the graph writes into (itself or a view of
    it); the names cloned.

    The graph is edited in place (the caller recompiles its GraphModule);
    ``root`` owns the graph's submodules (for ``call_module`` nodes).
    """
    cloned = []
    for p in [n for n in graph.nodes if n.op == "placeholder"]:
        if not _written(p, root):
            continue
        users = list(p.users)
        anchor = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(anchor):
            copy = graph.call_method("clone", (p,))
        if "val" in p.meta:
            copy.meta["val"] = p.meta["val"]
        for user in users:
            user.replace_input_with(p, copy)
        cloned.append(p.name)
    return cloned
