"""Turn a captured graph into a chain of blocks: candidate split points, crossing bytes, ties.

A *split point* is the start of a module call, in execution order. The chain is
chosen by a granularity rule: start from the root's module calls and descend
into a call while it is a container (``nn.Sequential``, ``nn.ModuleList`` ...)
or holds more than ``1 / target_blocks`` of the model's work, as long as it has
module calls inside. Code that sits between calls (residual adds, reshapes in a
parent's forward) stays in the block before it.

For every split point we compute liveness on the graph: every value defined
before the point and used at or after it crosses it (skip connections, long
residuals and model inputs still needed later all count). A split point where a
non-tensor value (a tuple, a list, a Python number) or a tensor whose shape
depends on the data (after ``nonzero``) crosses is excluded: a pipeline stage
sends only tensors, into buffers of fixed shapes. So is the second call of a module called
twice: a split point is named by one module FQN.

Tied parameters (one tensor under several names) are found by identity and
reported with the blocks that use them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import networkx as nx
import torch.fx
from torch import nn

from planner.capture.liveness import (
    Live,
    crossing,
    float_bytes,
    liveness,
    strided_bytes,
    tensor_bytes,
    unsendable_crossing,
)
from planner.capture.tied import param_identity, tied_sets
from planner.capture.trace import Captured, ModuleCall, TensorInfo

__all__ = ["Block", "BlockChain", "SplitPointExcluded", "build_blocks"]

log = logging.getLogger(__name__)

_CONTAINERS = (
    "torch.nn.modules.container.Sequential",
    "torch.nn.modules.container.ModuleList",
    "torch.nn.modules.container.ModuleDict",
)


@dataclass(frozen=True)
class SplitPointExcluded:
    """A module-call start that cannot be a split point, and why."""

    fqn: str
    reason: str


@dataclass
class Block:
    """A contiguous run of graph nodes that starts at a split point.

    Attributes:
        index: position in the chain.
        name: the split point (FQN of the module call the block starts with).
        modules: FQNs of the module calls (at the chosen granularity) inside.
        nodes: the block's call nodes, in execution order.
        inputs: values defined outside the block that its nodes read (model
            inputs or earlier blocks' nodes), in graph order.
        outputs: the block's values read after the block (by later blocks or the
            model's output), in graph order.
        params: attribute targets (``get_attr``) the block reads.
        boundary_bytes: bytes of every tensor live across this block's start.
        crossing: those tensors, described: "name: dtype[shape]" as traced.
        copy_bytes: the part of ``boundary_bytes`` in tensors that are not
            contiguous: a stage sending them makes a dense copy first.
        grad_bytes: the part of ``boundary_bytes`` in floating-point tensors, whose
            gradients come back (integer ids and masks have none).
        output_bytes: bytes of ``outputs``.
        weight: the work estimate the granularity rule used.
    """

    index: int
    name: str
    modules: list[str]
    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node] = field(default_factory=list)
    outputs: list[torch.fx.Node] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    boundary_bytes: int = 0
    crossing: list[str] = field(default_factory=list)
    copy_bytes: int = 0
    grad_bytes: int = 0
    output_bytes: int = 0
    weight: float = 0.0


@dataclass
class BlockChain:
    """The model as a chain of blocks.

    Attributes:
        blocks: the chain.
        tied: groups of parameter FQNs that are one tensor, each with the
            indices of the blocks that use it.
        excluded: module-call starts that were candidate split points but are
            not legal, with the reason.
        param_owner: for each parameter/buffer attribute target, the canonical
            FQN (first name of the tensor in ``named_parameters``/``named_buffers``).
    """

    blocks: list[Block]
    tied: list[tuple[tuple[str, ...], tuple[int, ...]]]
    excluded: list[SplitPointExcluded]
    param_owner: dict[str, str]

    @property
    def split_points(self) -> list[str]:
        return [b.name for b in self.blocks[1:]]


@dataclass
class _Call:
    """A node of the module-call tree."""

    call: ModuleCall
    first: int  # index of the first call node in the call
    last: int  # index of the last call node in the call
    children: list[_Call] = field(default_factory=list)
    weight: float = 0.0


def build_blocks(
    cap: Captured,
    model: nn.Module,
    *,
    target_blocks: int = 64,
    node_weight: Callable[[torch.fx.Node], float] | None = None,
    split_points: Sequence[str] | None = None,
) -> BlockChain:
    """Cut a captured model into a chain of blocks.

    Example::

        cap = capture(model, (x,))
        chain = build_blocks(cap, model, target_blocks=64)
        print([b.name for b in chain.blocks], [b.boundary_bytes for b in chain.blocks])

    Args:
        cap: the captured graph.
        model: the model it was captured from (for parameter identity).
        target_blocks: descend into any module call holding more than
            ``1/target_blocks`` of the work. Set it to at least the largest
            pipeline depth you want to balance; larger values give finer chains
            (and slower solves).
        node_weight: the work of one call node (e.g. its measured or analytic
            time); defaults to the bytes the node produces, a cheap proxy.
        split_points: use exactly these split points (module FQNs, in
            execution order) instead of the granularity rule: the same chain
            at another batch size, or a plan's stages.

    Raises:
        ValueError: a requested split point is not a module call of the graph,
            is out of order, or has a non-tensor value crossing it.

    Returns:
        The ``BlockChain``.
    """
    if target_blocks < 1:
        raise ValueError(f"target_blocks must be ≥ 1, got {target_blocks}")
    ops = list(cap.call_nodes())
    if not ops:
        raise ValueError(
            "the captured graph has no operations: the model's forward computes nothing"
        )
    weight_of = node_weight or (lambda n: float(tensor_bytes(cap, n)) + 1.0)
    weights = [weight_of(n) for n in ops]
    pos = {n: i for i, n in enumerate(ops)}

    roots = _call_tree(cap, ops, weights)
    live = liveness(cap, ops, pos)
    excluded: list[SplitPointExcluded] = []
    if split_points is not None:
        starts = _forced_starts(cap, roots, live, split_points)
    else:
        units = _choose_units(roots, sum(weights) / target_blocks)
        starts, excluded = _unit_starts(cap, live, units)
    blocks = _make_blocks(cap, ops, weights, roots, starts, live)
    owner, aliases = param_identity(model)
    tied = tied_sets([b.params for b in blocks], owner, aliases)
    return BlockChain(blocks=blocks, tied=tied, excluded=excluded, param_owner=owner)


def _unit_starts(
    cap: Captured, live: Live, units: list[_Call]
) -> tuple[list[tuple[int, str]], list[SplitPointExcluded]]:
    """The units that can start a block (position, FQN), and those excluded, with why."""
    excluded: list[SplitPointExcluded] = []
    starts: list[tuple[int, str]] = []
    seen_fqns: set[str] = set()
    for unit in units:
        fqn = unit.call.fqn
        if fqn in seen_fqns:
            excluded.append(SplitPointExcluded(fqn, "the module is called more than once"))
            continue
        seen_fqns.add(fqn)
        p = unit.first
        if not starts:
            starts.append((0, fqn))
            continue
        blocker = unsendable_crossing(cap, live, p)
        if blocker is not None:
            excluded.append(SplitPointExcluded(fqn, blocker))
            continue
        starts.append((p, fqn))
    return starts, excluded


# --------------------------------------------------------------------------- call tree


def _call_tree(cap: Captured, ops: list[torch.fx.Node], weights: list[float]) -> list[_Call]:
    """The tree of module calls; each call spans [first, last] of ``ops``."""
    tree = nx.DiGraph()
    root = ("", "")
    tree.add_node(root)
    info: dict[tuple[str, str], _Call] = {}
    for i, node in enumerate(ops):
        parent = root
        for call in cap.stacks.get(node, ()):
            key = (call.key, call.fqn)
            if key not in info:
                info[key] = _Call(call=call, first=i, last=i)
                tree.add_edge(parent, key)
            entry = info[key]
            entry.last = i
            entry.weight += weights[i]
            parent = key
    for key, entry in info.items():
        entry.children = sorted((info[c] for c in tree.successors(key)), key=lambda c: c.first)
    return sorted((info[c] for c in tree.successors(root)), key=lambda c: c.first)


def _choose_units(roots: list[_Call], max_weight: float) -> list[_Call]:
    """Descend into containers and into calls heavier than ``max_weight``."""
    units: list[_Call] = []
    stack = list(reversed(roots))
    while stack:
        unit = stack.pop()
        heavy = unit.weight > max_weight
        if unit.children and (unit.call.type_name in _CONTAINERS or heavy):
            stack.extend(reversed(unit.children))
            if unit.children[0].first != unit.first:
                # Code of the call before its first child: keep it as a unit of
                # its own so that the split point still sits at the call's start.
                units.append(unit)
        else:
            units.append(unit)
    units.sort(key=lambda u: u.first)
    return units


def _all_calls(roots: list[_Call]) -> Iterator[_Call]:
    stack = list(reversed(roots))
    while stack:
        call = stack.pop()
        yield call
        stack.extend(reversed(call.children))


def _forced_starts(
    cap: Captured, roots: list[_Call], live: Live, split_points: Sequence[str]
) -> list[tuple[int, str]]:
    first: dict[str, int] = {}
    for call in _all_calls(roots):
        first.setdefault(call.call.fqn, call.first)
    if not split_points:
        return [(0, roots[0].call.fqn if roots else "")]
    starts: list[tuple[int, str]] = []
    for k, fqn in enumerate(split_points):
        if fqn not in first:
            known = ", ".join(list(first)[:8])
            raise ValueError(
                f"split point {fqn!r} is not a module call of this model (calls include: "
                f"{known}, ...); the plan or chain was made for a different model"
            )
        p = first[fqn]
        if k == 0:
            starts.append((0, fqn))
            continue
        if p <= starts[-1][0]:
            raise ValueError(
                f"split point {fqn!r} does not come after {starts[-1][1]!r} in execution order"
            )
        blocker = unsendable_crossing(cap, live, p)
        if blocker is not None:
            raise ValueError(f"split point {fqn!r} cannot be used: {blocker}")
        starts.append((p, fqn))
    return starts


# --------------------------------------------------------------------------- blocks


def _make_blocks(
    cap: Captured,
    ops: list[torch.fx.Node],
    weights: list[float],
    roots: list[_Call],
    starts: list[tuple[int, str]],
    live: Live,
) -> list[Block]:
    bounds = [p for p, _ in starts] + [len(ops)]
    blocks: list[Block] = []
    for k, (p, name) in enumerate(starts):
        q = bounds[k + 1]
        nodes = ops[p:q]
        inside = set(nodes)
        modules = _maximal_calls(roots, p, q)
        inputs: list[torch.fx.Node] = []
        params: list[str] = []
        for node in nodes:
            for arg in node.all_input_nodes:
                if arg.op == "get_attr":
                    if arg.target not in params:
                        params.append(str(arg.target))
                elif arg not in inside and arg not in inputs:
                    inputs.append(arg)
        outputs = [n for n in nodes if live.last_use.get(n, -1) >= q]
        cross = crossing(live, p) if k else []  # block 0 starts at the model's inputs
        block = Block(
            index=k,
            name=name,
            modules=modules,
            nodes=nodes,
            inputs=sorted(inputs, key=lambda n: live.define[n]),
            outputs=outputs,
            params=params,
            boundary_bytes=sum(tensor_bytes(cap, n) for n in cross),
            copy_bytes=sum(strided_bytes(cap, n) for n in cross),
            grad_bytes=sum(float_bytes(cap, n) for n in cross),
            crossing=[_described(cap, n) for n in cross],
            output_bytes=sum(tensor_bytes(cap, n) for n in outputs),
            weight=sum(weights[p:q]),
        )
        blocks.append(block)
    return blocks


def _described(cap: Captured, node: torch.fx.Node) -> str:
    """ "x: float32[4, 64, 256]" (a split point's crossings are tensors: blockers excluded)."""
    info = cap.values.get(node)
    if isinstance(info, TensorInfo):
        dtype = str(info.dtype).removeprefix("torch.")
        return f"{node.name}: {dtype}[{', '.join(str(int(d)) for d in info.shape)}]"
    return f"{node.name}: {info}"


def _maximal_calls(roots: list[_Call], p: int, q: int) -> list[str]:
    """FQNs of the outermost module calls lying inside [p, q) (or starting there)."""
    out: list[str] = []
    stack = list(reversed(roots))
    while stack:
        call = stack.pop()
        if call.last < p or call.first >= q:
            continue
        if call.first >= p and call.last < q:
            out.append(call.call.fqn)
        else:
            stack.extend(reversed(call.children))
    return out
