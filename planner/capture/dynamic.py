"""Which of a model's outputs have a data-dependent dim 0, and the operation that made it so.

``torch.export`` gives a size that depends on tensor values (``nonzero``, a
boolean mask ``x[mask]``, ``masked_select``, ``unique``, ``.item()``) an
*unbacked* symbol (``u0``) and records, on the node that produced it, which
symbol it binds (``node.meta["unbacked_bindings"]``). An output whose dim 0 holds
such a symbol has a batch size set by the data: :func:`data_dependent_outputs`
finds those outputs and, for each, the operation, module call and source line
that bound the symbol. A graph from ``symbolic_trace`` has no symbolic sizes:
nothing is found there.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._pytree import tree_leaves

from planner.capture.trace import Captured

__all__ = ["SizeOrigin", "data_dependent_outputs"]

# What people write for the aten operations that make a size depend on values.
_FRIENDLY = {
    "index": "boolean-mask indexing x[mask]",
    "nonzero": "torch.nonzero",
    "masked_select": "torch.masked_select",
    "_unique2": "torch.unique",
    "unique_dim": "torch.unique",
    "unique_consecutive": "torch.unique_consecutive",
    "repeat_interleave": "torch.repeat_interleave",
    "_local_scalar_dense": "a tensor's value read as a number (.item(), int(t))",
}
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n(?P<code>.*)')
_TORCH = os.path.dirname(torch.__file__)


@dataclass(frozen=True)
class SizeOrigin:
    """The operation that made a size depend on tensor values.

    ``op``: e.g. "torch.nonzero (aten.nonzero.default)"; ``module``: the module
    call it ran in, e.g. "'gate.select' (Select)" ("'<root>' (Net)" in the model's
    own forward); ``source``: "file:line" and the line's code, when torch kept it.
    """

    op: str
    module: str
    source: str | None = None

    def __str__(self) -> str:
        at = f" at {self.source}" if self.source else ""
        return f"{self.op} in module {self.module}{at}"


def data_dependent_outputs(cap: Captured) -> list[tuple[SizeOrigin, ...] | None]:
    """For each tensor the graph returns (flattened, in order): where its dim 0 comes from.

    Example::

        for i, origins in enumerate(data_dependent_outputs(cap)):
            if origins:
                print(f"output {i}: dim 0 set by", origins[0])

    Returns:
        One entry per flat output: ``None`` when its dim 0 does not depend on
        tensor values (or is unknown: a ``symbolic_trace`` graph), else the
        operations that bound the symbols of that size (at least one).
    """
    graph = cap.gm.graph
    output = graph.output_node()
    flat = tree_leaves(output.args[0])  # export's are flat already; constants stay in place
    binders: dict[object, torch.fx.Node] = {}
    for node in graph.nodes:
        for sym in node.meta.get("unbacked_bindings") or {}:
            binders.setdefault(sym, node)
    found: list[tuple[SizeOrigin, ...] | None] = []
    for node in flat:
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        symbols: Iterable[object] = ()
        if isinstance(val, torch.Tensor) and val.dim() > 0:
            symbols = free_unbacked_symbols(val.shape[0])
        nodes = {binders.get(s) or _first_with(graph, s) for s in symbols}
        origins = [_origin(cap, n) for n in graph.nodes if n in nodes]
        found.append(tuple(origins) if origins else None)
    return found


def _first_with(graph: torch.fx.Graph, symbol: object) -> torch.fx.Node | None:
    """The first node whose value's shape holds ``symbol`` (when no node says it binds it)."""
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and symbol in free_unbacked_symbols(val.shape):
            return node
    return None


def _origin(cap: Captured, node: torch.fx.Node) -> SizeOrigin:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    name = str(getattr(packet, "__name__", None) or getattr(target, "__name__", target))
    friendly = _FRIENDLY.get(name, name)
    op = f"{friendly} ({target})" if friendly != str(target) else friendly
    stack = cap.stacks.get(node) or ()
    if stack:
        fqn, type_name = stack[-1].fqn, stack[-1].type_name
    else:  # the root module's own forward
        raw = node.meta.get("nn_module_stack") or {}
        root = next(iter(raw.values()), ("", ""))[1]
        fqn, type_name = "<root>", root if isinstance(root, str) else root.__qualname__
    module = f"'{fqn}' ({type_name.rsplit('.', 1)[-1]})"
    return SizeOrigin(op=op, module=module, source=_source(node))


def _source(node: torch.fx.Node) -> str | None:
    """``file:line: code`` of the innermost frame outside torch that made ``node``."""
    frames = list(_FRAME.finditer(node.meta.get("stack_trace") or ""))
    mine = [f for f in frames if not f["file"].startswith(_TORCH)]
    if not mine:
        return None
    f = mine[-1]
    return f"{f['file']}:{f['line']}: {f['code'].strip()}"
