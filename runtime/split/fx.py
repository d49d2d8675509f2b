"""The fallback split, for models torch.export cannot take: a ``symbolic_trace`` graph cut by hand.

Each node goes to the stage whose split point it follows (by the module it
belongs to), every value a later stage needs is passed along the chain; the
example shapes are measured here, so torch's metadata inference never runs a
forward (``PipelineStage(input_args=..., output_args=...)``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from planner.plan.pieces import clone_written_inputs
from runtime.split.errors import Example, StageError, cause_line
from runtime.split.relay import contiguous_grad

__all__ = ["split_model"]


def split_model(
    model: nn.Module, points: list[str], example: Example
) -> tuple[list[torch.fx.GraphModule], list[tuple[Any, Any]]]:
    """Split ``model`` at ``points`` with ``torch.fx.symbolic_trace`` (the fallback path).

    Example::

        mods, shapes = split_model(model, ["layers.4"], ((x,), {}))
        out = mods[1](*mods[0](x))          # == model(x)

    Stage 0 takes the model's own arguments. Every later stage takes, and every
    stage but the last returns, a tuple of the tensors still needed further on
    (skip connections are passed along the chain). The last stage returns the
    model's output.

    Returns:
        The stage modules (sharing the model's submodules and tensors), and for
        each stage its example ``(inputs, outputs)`` tensors (of ``example``'s
        batch size) for ``PipelineStage(input_args=..., output_args=...)``.

    Raises:
        StageError: tracing failed, a split point is never reached or leaves a
            stage empty, or a non-tensor value would cross a split point.
    """
    try:
        traced = torch.fx.symbolic_trace(model)
    except Exception as exc:
        raise StageError(
            f"torch.fx.symbolic_trace could not trace the model either: {type(exc).__name__}: "
            f"{cause_line(exc)}\n  fix: remove data-dependent Python control flow from "
            "forward(), or make the model exportable with torch.export"
        ) from exc
    nodes = list(traced.graph.nodes)
    n_stages = len(points) + 1
    stage_of = _assign(nodes, points)
    users: dict[torch.fx.Node, int] = {}  # node -> last stage that reads it
    for node in nodes:
        if node not in stage_of:
            continue
        last = -1
        for user in node.users:
            last = max(last, n_stages - 1 if user.op == "output" else stage_of[user])
        users[node] = last
    order = {n: k for k, n in enumerate(nodes)}
    live_in: list[list[torch.fx.Node]] = [[]] + [
        sorted((n for n in stage_of if stage_of[n] < s and users[n] >= s), key=order.__getitem__)
        for s in range(1, n_stages)
    ]
    output = next(n for n in nodes if n.op == "output")
    mods = [
        _stage_graph(traced, nodes, stage_of, live_in, output, s, n_stages) for s in range(n_stages)
    ]
    try:
        shapes = _example_shapes(model, mods, live_in, example)
    except Exception as exc:
        if not any(p.is_meta for p in model.parameters()):
            raise
        raise StageError(
            "the fx split runs the stages once on the example micro-batch to learn what "
            "crosses each split point, and on this model built on the meta device (--init-from) "
            f"that failed: {type(exc).__name__}: {cause_line(exc)}\n  why: the forward reads "
            "a tensor's values (e.g. bool(x.all()), x.item()), which meta tensors do not have.\n"
            "  fix: run without --init-from (a full build), or remove the data-dependent "
            "Python from forward()"
        ) from exc
    return mods, shapes


def _module_path(node: torch.fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    last = list(stack.values())[-1]
    return str(last[0] if isinstance(last, tuple) else last)


def _assign(nodes: list[torch.fx.Node], points: list[str]) -> dict[torch.fx.Node, int]:
    """Each compute node's stage: the number of split points whose module has begun."""
    stage_of: dict[torch.fx.Node, int] = {}
    cur = 0
    first: dict[int, torch.fx.Node] = {}
    for node in nodes:
        if node.op == "placeholder":
            stage_of[node] = 0
            continue
        if node.op in ("get_attr", "output"):
            continue  # parameters are re-read in every stage that uses them
        path = _module_path(node)
        for j in range(len(points) - 1, cur - 1, -1):
            if path == points[j] or path.startswith(points[j] + "."):
                cur = j + 1
                break
        stage_of[node] = cur
        first.setdefault(cur, node)
    empty = [s for s in range(1, len(points) + 1) if s not in first]
    if empty or cur != len(points):
        names = [points[s - 1] for s in empty] or points[cur:]
        raise StageError(
            f"split point(s) {names} start no stage of the traced graph (split points "
            f"{points}): the module is never called, or called out of order.\n"
            "  fix: re-plan the model, or edit the plan's split points to module calls on the "
            "forward's main path, in execution order"
        )
    return stage_of


def _stage_graph(
    traced: torch.fx.GraphModule,
    nodes: list[torch.fx.Node],
    stage_of: dict[torch.fx.Node, int],
    live_in: list[list[torch.fx.Node]],
    output: torch.fx.Node,
    s: int,
    n_stages: int,
) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}

    def lookup(n: torch.fx.Node) -> torch.fx.Node:
        if n not in env:
            assert n.op == "get_attr", f"{n} is needed by stage {s} but not passed to it"
            env[n] = graph.node_copy(n)
        return env[n]

    for n in live_in[s] if s > 0 else []:
        env[n] = graph.placeholder(n.name)
    for n in nodes:
        if stage_of.get(n) == s:
            env[n] = graph.node_copy(n, lookup)
    if s < n_stages - 1:  # what a stage sends is contiguous (runtime.split.relay says why)
        sent = [graph.call_method("contiguous", (lookup(n),)) for n in live_in[s + 1]]
        graph.output(tuple(sent))
    else:
        graph.output(torch.fx.node.map_arg(output.args[0], lookup))
    if s > 0:  # received activations: cloned where written in place, gradients sent dense
        clone_written_inputs(graph, traced)
        anchor = next(x for x in graph.nodes if x.op != "placeholder")
        for p in [x for x in graph.nodes if x.op == "placeholder"]:
            users = list(p.users)
            with graph.inserting_before(anchor):
                guard = graph.call_function(contiguous_grad, (p,))
            for user in users:
                user.replace_input_with(p, guard)
    gm = torch.fx.GraphModule(traced, graph, class_name=f"Stage{s}")
    gm.graph.lint()
    return gm


def _example_shapes(
    model: nn.Module,
    mods: list[torch.fx.GraphModule],
    live_in: list[list[torch.fx.Node]],
    example: Example,
) -> list[tuple[Any, Any]]:
    """Run the chain once on ``example`` (no grad, RNG and buffers restored) for the shapes."""
    args, kwargs = example
    shapes: list[tuple[Any, Any]] = []
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        try:
            inputs: tuple[Any, ...] = tuple(args)
            out: Any = mods[0](*args, **kwargs)
            for s in range(len(mods)):
                if s > 0:
                    inputs = tuple(out)
                    out = mods[s](*inputs)
                if s < len(mods) - 1:
                    _check_tensors(out, live_in[s + 1], s)
                    outs = tuple(_meta_like(t) for t in out)
                else:
                    outs = tuple(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
                ins = tuple(
                    t if s == 0 else _meta_like(t) for t in inputs if isinstance(t, torch.Tensor)
                )
                shapes.append((ins, outs))
        finally:
            for b, v in saved:
                b.copy_(v)
    return shapes


def _check_tensors(out: tuple[Any, ...], names: list[torch.fx.Node], s: int) -> None:
    bad = [
        f"{n.name} ({type(v).__name__})"
        for n, v in zip(names, out, strict=True)
        if not isinstance(v, torch.Tensor)
    ]
    if bad:
        raise StageError(
            f"non-tensor value(s) {bad} cross the split between stages {s} and {s + 1}; "
            "pipeline stages exchange tensors only.\n  fix: move the split point, or compute "
            "the value inside the stage that uses it"
        )


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    """A detached copy whose ``requires_grad`` says whether a gradient flows back through it."""
    return t.detach().clone().requires_grad_(t.is_floating_point())
