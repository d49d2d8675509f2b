"""Cut a runnable GraphModule out of a run of nodes of a captured graph.

Used to time one block alone, and to build a stage from a run of blocks. The
new module takes the run's external inputs as positional arguments and returns
a tuple of its outputs; parameters and buffers stay shared with the source.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx

__all__ = ["extract"]


def extract(
    gm: torch.fx.GraphModule,
    nodes: Sequence[torch.fx.Node],
    inputs: Sequence[torch.fx.Node],
    outputs: Sequence[torch.fx.Node],
) -> torch.fx.GraphModule:
    """A GraphModule computing ``outputs`` from ``inputs`` with ``nodes``.

    Example::

        sub = extract(cap.gm, block.nodes, block.inputs, block.outputs)
        outs = sub(*input_values)          # always a tuple

    Args:
        gm: the source graph module (owner of the parameters).
        nodes: the call nodes to copy, in execution order.
        inputs: values the nodes read that are defined outside them.
        outputs: values to return.
    """
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, node in enumerate(inputs):
        env[node] = graph.placeholder(f"in{i}_{node.name}")
    attrs: dict[str, torch.fx.Node] = {}

    def lookup(n: torch.fx.Node) -> torch.fx.Node:
        if n in env:
            return env[n]
        if n.op == "get_attr":
            target = str(n.target)
            if target not in attrs:
                attrs[target] = graph.get_attr(target)
            return attrs[target]
        raise AssertionError(f"node {n.name} is read by the run but is not one of its inputs")

    for node in nodes:
        env[node] = graph.node_copy(node, lookup)
    graph.output(tuple(env[n] for n in outputs))
    graph.lint()
    return torch.fx.GraphModule(gm, graph, class_name="Block")
