# An fx node's args are typed as any Argument (SymInt, slice, None...); the pipe's graph
# holds only Nodes there, checked at the top of relay().
# mypy: disable-error-code="union-attr"
"""Make a ``pipeline()`` split runnable as planned: each stage reads only the stage before it.

torch's traced stages send each output straight to every stage that reads it.
Three things then break on real models, at the first step:

* a value read by two or more later stages cannot get its gradient back
  (``PipeliningMetadataError: Backward of skip connections not supported
  yet``): a rotary table, an attention mask or a position index made early and
  read by every layer;
* a model input read past the first stage (an attention mask read by the
  layers, a first stage that ends before the input is first used) is never
  delivered: the schedule feeds the inputs to the first stage only;
* gloo sends only contiguous tensors (``input tensor has to be contiguous``),
  and a stage's output or an input's gradient is often a view (a transposed
  attention residual, a channels-last permute, a broadcast mask of stride 0).

:func:`relay` rewrites the Pipe's graphs so that

1. the first stage takes every model input, in the model's order (names kept,
   so keyword inputs still bind);
2. stage ``i`` takes only stage ``i - 1``'s outputs: a value made at stage
   ``a`` and read at stage ``b > a + 1`` is an output of ``a``, an input and an
   output of every stage in between (relayed), and an input of ``b``; each
   output goes to exactly one stage, so every gradient has one way back;
3. every output a stage sends is contiguous (``Tensor.contiguous``: a copy only
   for a tensor that is not), and so is every gradient it sends back;
4. a received activation the stage writes into in place is cloned first
   (``planner.plan.pieces``: the profiler times blocks the same way).

This is what the planner prices: at every split point, the bytes of every
tensor live across it (a relayed value crosses each split point it skips).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import Tensor

from planner.plan.pieces import clone_written_inputs
from runtime.split.errors import StageError

__all__ = ["contiguous_grad", "relay"]

Source = tuple[str, Any]
"""A value of the pipe: ``("input", placeholder name)`` or ``("stage", (k, output index))``."""


class _ContiguousGrad(torch.autograd.Function):
    """The identity forward; the gradient made contiguous on its way back (a send needs it)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def contiguous_grad(x: Tensor) -> Tensor:
    """``x`` itself in the forward; its gradient arrives contiguous."""
    return _ContiguousGrad.apply(x)


def _dense(val: Any) -> Any:
    """A meta tensor like ``val`` with contiguous strides (what is sent, and the receive buffer)."""
    if isinstance(val, Tensor):
        return torch.empty(val.shape, dtype=val.dtype, device="meta")
    return val


def relay(pipe: Any) -> None:
    """Rewrite ``pipe`` (torch's ``Pipe``) in place as the module docstring says.

    A part of the model's output made before the last stage (T5's encoder
    state) is relayed to the last stage too, which returns it after its own.

    Raises:
        StageError: the pipe's graph is not a chain of stage calls (nothing the
            planner's split points produce).
    """
    root = pipe.split_gm
    graph: torch.fx.Graph = root.graph
    stages = [x for x in graph.nodes if x.op == "call_module"]
    inputs = [x for x in graph.nodes if x.op == "placeholder"]
    output = graph.output_node()
    index = {node: i for i, node in enumerate(stages)}
    _check_chain(graph, index)
    n = len(stages)

    def source(arg: torch.fx.Node) -> Source:
        if arg.op == "placeholder":
            return ("input", arg.name)
        if arg.op == "call_module":
            return ("stage", (index[arg], None))
        return ("stage", (index[arg.args[0]], arg.args[1]))

    last_reader: dict[Source, int] = {}
    for node in stages:
        for arg in node.args:
            src = source(arg)
            last_reader[src] = max(last_reader.get(src, -1), index[node])
    # A part of the model's output made before the last stage (T5's encoder state) is
    # relayed to the last stage, which returns it after its own outputs.
    tail = list(
        dict.fromkeys(
            src
            for src in map(source, _nodes_in(output.args))
            if src[0] == "input" or src[1][0] != n - 1
        )
    )
    for src in tail:
        last_reader[src] = n - 1

    def made_at(src: Source) -> int:
        return 0 if src[0] == "input" else int(src[1][0])

    # Stage i's inputs, in order: its own arguments first, then what it relays.
    wanted: list[list[Source]] = [[("input", p.name) for p in inputs]]
    for i in range(1, n):
        order = list(dict.fromkeys(source(a) for a in stages[i].args))
        order += [s for s, last in last_reader.items() if made_at(s) < i < last and s not in order]
        if i == n - 1:
            order += [s for s in tail if s not in order]
        wanted.append(order)

    vals = _values(inputs, stages, root)
    for i, node in enumerate(stages):
        mod = root.get_submodule(str(node.target))
        here = [source(a) for a in node.args]
        sends = wanted[i + 1] if i + 1 < n else None
        _rewrite_stage(mod, i, here, wanted[i], sends, vals, tail if i == n - 1 else [])
    _rewrite_root(graph, stages, inputs, wanted, vals)
    if tail:
        own = sum(1 for k, j in (s[1] for s in vals if s[0] == "stage") if k == n - 1)
        _rewrite_output(graph, stages[-1], output, tail, source, own)
    # The old getitems, now read by nobody: torch's stage numbers a stage's outputs by
    # its getitem users in order, so a stale one would shift every send after it.
    for node in list(graph.nodes):
        if node.op == "call_function" and not node.users:
            graph.erase_node(node)
    for i, node in enumerate(stages[:-1]):
        order = [u.args[1] for u in node.users]
        if order != list(range(len(wanted[i + 1]))):
            raise StageError(f"stage {i}'s outputs are read as {order}, not in order")
    graph.lint()
    root.recompile()


def _check_chain(graph: torch.fx.Graph, index: dict[torch.fx.Node, int]) -> None:
    """The pipe's graph is inputs, stage calls and their getitems, and the output."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            if node.args[0] not in index:
                raise StageError(f"the pipe's graph indexes {node.args[0]}, not a stage's output")
        elif node.op not in ("placeholder", "call_module", "output"):
            raise StageError(f"the pipe's graph holds a {node.op} node ({node.name}) among stages")
        elif node.op == "call_module" and node.kwargs:
            raise StageError(f"stage {node.name} takes keyword arguments in the pipe's graph")


def _nodes_in(arg: Any) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(arg, found.append)
    return found


def _placeholders(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [x for x in graph.nodes if x.op == "placeholder"]


def _meta(value: Any) -> Any:
    return value.meta.get("val") if isinstance(value, torch.fx.Node) else value


def _values(
    inputs: Sequence[torch.fx.Node], stages: Sequence[torch.fx.Node], root: Any
) -> dict[Source, Any]:
    """The example value (``meta["val"]``) of every model input and stage output."""
    vals: dict[Source, Any] = {("input", p.name): p.meta.get("val") for p in inputs}
    for k, node in enumerate(stages):
        graph = root.get_submodule(str(node.target)).graph
        for p, arg in zip(_placeholders(graph), node.args, strict=True):
            if arg.op == "placeholder" and vals.get(("input", arg.name)) is None:
                vals[("input", arg.name)] = p.meta.get("val")
        out = graph.output_node().args[0]
        if isinstance(out, (tuple, list)):
            for j, leaf in enumerate(out):
                vals[("stage", (k, j))] = _meta(leaf)
        else:
            vals[("stage", (k, None))] = _meta(out)
    return vals


def _rewrite_stage(
    mod: Any,
    i: int,
    here: list[Source],
    takes: list[Source],
    sends: list[Source] | None,
    vals: dict[Source, Any],
    tail: list[Source],
) -> None:
    """Stage ``i``'s graph: placeholders for ``takes`` (in order); outputs ``sends``, dense.

    ``here`` is the source of each of its placeholders now (in order). The last
    stage (``sends`` None) keeps its outputs, and returns ``tail`` after them.
    """
    graph: torch.fx.Graph = mod.graph
    local: dict[Source, torch.fx.Node] = {}
    for p, src in zip(_placeholders(graph), here, strict=True):
        if src in local:  # one value passed twice: one placeholder
            p.replace_all_uses_with(local[src])
            graph.erase_node(p)
        else:
            local[src] = p
    anchor = next(x for x in graph.nodes if x.op != "placeholder")
    for src in takes:
        if src not in local:
            with graph.inserting_before(anchor):
                p = graph.placeholder(_name_for(src, i))
            p.meta["val"] = vals.get(src)
            local[src] = p
    for src in takes:  # placeholders in the order the pipe will pass them
        anchor.prepend(local[src])
    if i > 0:  # received activations: dense buffers, and dense gradients back
        clone_written_inputs(graph, mod)  # a leaf buffer written in place (relu_ at the start)
        anchor = next(x for x in graph.nodes if x.op != "placeholder")
        for src in takes:
            p = local[src]
            val = p.meta.get("val")
            if not isinstance(val, Tensor):
                continue
            p.meta["val"] = _dense(val)
            if val.is_floating_point():
                users = list(p.users)
                with graph.inserting_before(anchor):
                    guard = graph.call_function(contiguous_grad, (p,))
                guard.meta["val"] = p.meta["val"]
                for user in users:
                    user.replace_input_with(p, guard)
                local[src] = guard
    if sends is not None:
        out_node = graph.output_node()
        made: Any = out_node.args[0]
        results = []
        for src in sends:
            if src[0] == "stage" and src[1][0] == i:
                j = src[1][1]
                value = made if j is None else made[j]
            else:
                value = local[src]
            if isinstance(_meta(value), Tensor):
                with graph.inserting_before(out_node):
                    dense = graph.call_method("contiguous", (value,))
                dense.meta["val"] = _dense(_meta(value))
                value = dense
            results.append(value)
        out_node.args = (tuple(results),)
    elif tail:
        out_node = graph.output_node()
        made = out_node.args[0]
        own = tuple(made) if isinstance(made, (tuple, list)) else (made,)
        out_node.args = (own + tuple(local[src] for src in tail),)
    graph.lint()
    mod.recompile()


def _rewrite_output(
    graph: torch.fx.Graph,
    last: torch.fx.Node,
    output: torch.fx.Node,
    tail: list[Source],
    source: Any,
    own: int,
) -> None:
    """The pipe's output reads everything from the last stage (which now returns a tuple).

    ``own``: how many outputs the last stage made itself (1 for a single value).
    """
    items = {u.args[1]: u for u in last.users if u.op == "call_function"}

    def item(j: int) -> torch.fx.Node:
        if j not in items:
            with graph.inserting_before(output):
                items[j] = graph.call_function(operator.getitem, (last, j))
        return items[j]

    def remap(leaf: torch.fx.Node) -> torch.fx.Node:
        src = source(leaf)
        if src in tail:
            return item(own + tail.index(src))
        return item(0) if leaf is last else leaf

    output.args = torch.fx.node.map_arg(output.args, remap)


def _name_for(src: Source, i: int) -> str:
    if src[0] == "input":
        return str(src[1])
    k, j = src[1]
    return f"relayed_{k}_{'out' if j is None else j}_to_{i}"


def _rewrite_root(
    graph: torch.fx.Graph,
    stages: Sequence[torch.fx.Node],
    inputs: Sequence[torch.fx.Node],
    wanted: list[list[Source]],
    vals: dict[Source, Any],
) -> None:
    """The pipe's graph: stage 0 takes the inputs; stage i one getitem per output of i - 1."""
    stages[0].args = tuple(inputs)
    for i in range(1, len(stages)):
        prev, at, items = stages[i - 1], stages[i - 1], []
        for j, src in enumerate(wanted[i]):
            with graph.inserting_after(at):
                item = graph.call_function(operator.getitem, (prev, j))
            item.meta["val"] = _dense(vals.get(src))
            items.append(item)
            at = item
        stages[i].args = tuple(items)
