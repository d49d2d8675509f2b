"""Running a block alone: the graph's values for its inputs, and one forward and backward.

:func:`forward_pass` runs the captured graph once and keeps every node's value
(the inputs every block is then run with) and its analytic time (the weight the
granularity rule uses); :class:`BlockRunner` cuts one block out of the graph
and runs it: forward, backward, the bytes its backward keeps, its analytic cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from planner.capture.blocks import Block
from planner.capture.subgraph import extract
from planner.capture.trace import Captured
from planner.devices.catalogue import Device
from planner.plan.pieces import clone_written_inputs
from planner.plan.text import few
from planner.plan.unexpected import add_where
from planner.profile.analytic import OpCost, OpCostMode

__all__ = [
    "BlockRunner",
    "analytic_loss_ms",
    "attr",
    "forward_pass",
    "loss_inputs",
    "model_output",
    "requires_grad",
    "storage_key",
]


def forward_pass(
    cap: Captured, device: Device, dtype: str | None
) -> tuple[dict[torch.fx.Node, Any], dict[torch.fx.Node, float]]:
    """Run the graph once: every node's value, and its estimated time on ``device``."""
    values: dict[torch.fx.Node, Any] = {}
    node_time: dict[torch.fx.Node, float] = {}
    mode = OpCostMode(device, dtype_override=dtype)

    class _Run(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            try:
                if n.op in ("call_function", "call_method", "call_module"):
                    with mode.phase(n.name):
                        result = super().run_node(n)
                    node_time[n] = mode.phases[n.name].time_s
                else:
                    result = super().run_node(n)
            except Exception as exc:
                add_where(exc, f"running {_node_where(cap, n)} on the sample batch")
                raise
            values[n] = result
            return result

    with torch.no_grad(), mode:
        _Run(cap.gm).run(*cap.flat_inputs)
    return values, node_time


def _node_where(cap: Captured, n: torch.fx.Node) -> str:
    """``module 'enc.fc' (torch.nn.Linear), op linear``: where a graph node sits in the model."""
    stack = cap.stacks.get(n, ())
    module = f"module '{stack[-1].fqn}' ({stack[-1].type_name})" if stack else "the root module"
    op = getattr(n.target, "__name__", None) or str(n.target)
    return f"{module}, op {op}"


def requires_grad(cap: Captured) -> dict[torch.fx.Node, bool]:
    """Whether each node's value needs a gradient in a training step."""
    rg: dict[torch.fx.Node, bool] = {}
    for node in cap.gm.graph.nodes:
        if node.op == "placeholder":
            rg[node] = False
        elif node.op == "get_attr":
            value = attr(cap.gm, str(node.target))
            rg[node] = isinstance(value, torch.Tensor) and value.requires_grad
        else:
            info = cap.values.get(node)
            float_out = getattr(getattr(info, "dtype", None), "is_floating_point", False)
            rg[node] = bool(float_out) and any(rg.get(a, False) for a in node.all_input_nodes)
    return rg


def attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def storage_key(t: torch.Tensor) -> int:
    """A storage's identity (``data_ptr()`` is 0 for every meta tensor)."""
    return t.untyped_storage()._cdata


class BlockRunner:
    """Runs one block alone: forward, backward, saved bytes, analytic cost."""

    def __init__(
        self,
        cap: Captured,
        block: Block,
        values: dict[torch.fx.Node, Any],
        needs_grad: dict[torch.fx.Node, bool],
    ) -> None:
        self.block = block
        self.module = extract(cap.gm, block.nodes, block.inputs, block.outputs)
        if clone_written_inputs(self.module.graph):  # e.g. relu_ at the block's start
            self.module.recompile()
        self.inputs = []
        for node in block.inputs:
            value = values[node]
            if isinstance(value, torch.Tensor):
                value = value.detach().requires_grad_(needs_grad.get(node, False))
            self.inputs.append(value)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self._exclude = {storage_key(t) for t in self.module.parameters()}
        self._exclude |= {storage_key(t) for t in self.module.buffers()}
        self.saved_bytes = 0
        self.saved_inputs: set[int] = set()
        self.saved_outputs: set[int] = set()
        self._grads: list[torch.Tensor] | None = None

    def forward(self) -> tuple[Any, ...]:
        try:
            return self.module(*self.inputs)
        except Exception as exc:
            add_where(exc, f"running the forward of {self._what()}")
            raise

    def _what(self) -> str:
        b = self.block
        return f"block {b.index} '{b.name}' (modules {few(list(b.modules), 4) or '<root>'})"

    def differentiable(self, outs: Sequence[Any]) -> list[torch.Tensor]:
        return [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]

    def backward(self, outs: Sequence[Any]) -> None:
        diff = self.differentiable(outs)
        if not diff:
            return
        wrt = self.params + [
            t for t in self.inputs if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        self.seed_grads(outs)
        try:
            torch.autograd.grad(diff, wrt, self._grads, allow_unused=True)
        except Exception as exc:
            add_where(exc, f"running the backward of {self._what()}")
            raise

    def seed_grads(self, outs: Sequence[Any]) -> None:
        """The output gradients the backward starts from (made once; none on meta)."""
        if self._grads is None:
            gen = torch.Generator().manual_seed(self.block.index)
            self._grads = [
                torch.empty_like(o)
                if o.is_meta
                else torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device)
                for o in self.differentiable(outs)
            ]

    def cost(self, device: Device, dtype: str | None) -> tuple[OpCost, OpCost]:
        """One forward + backward under OpCostMode; records what the forward saves.

        [Note: saved bytes, each tensor once] The backward keeps one copy of a
        tensor however many ops save it, and a block's input is the storage an
        earlier block produced. So the saved storages are split three ways:
        ``saved_bytes`` (created here, outputs included), ``saved_outputs``
        (which of the block's outputs it saved itself) and ``saved_inputs``
        (which inputs it saved: ``profile_chain`` charges those to the block
        that produced them, once). Summed over blocks, the figures give the
        model's distinct saved bytes, as a stage of contiguous blocks holds them.
        """
        mode = OpCostMode(device, dtype_override=dtype)
        inputs = {
            storage_key(t): k for k, t in enumerate(self.inputs) if isinstance(t, torch.Tensor)
        }
        seen: set[int] = set()
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            storage = t.untyped_storage()
            ptr = storage_key(t)
            if ptr in self._exclude or ptr in seen:
                return t
            seen.add(ptr)
            if ptr in inputs:
                self.saved_inputs.add(inputs[ptr])
            else:
                total += storage.nbytes()
            return t

        self.saved_inputs = set()
        with mode:
            with mode.phase("fwd"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                outs = self.forward()
            self.saved_outputs = {
                k
                for k, o in enumerate(outs)
                if isinstance(o, torch.Tensor) and storage_key(o) in seen
            }
        self.seed_grads(outs)  # outside the mode: making the seed is not the block's work
        with mode, mode.phase("bwd"):
            self.backward(outs)
        self.saved_bytes = total
        return mode.phases.get("fwd", OpCost()), mode.phases.get("bwd", OpCost())


def loss_inputs(out: Any) -> tuple[Any, list[torch.Tensor]]:
    """The model's output cut from its graph (floats requiring grad), and those tensors.

    The loss is timed (and priced) on its own: its backward stops at the output.
    """
    detached = torch.utils._pytree.tree_map(
        lambda t: (
            t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
        ),
        out,
    )
    leaves = [
        t
        for t in torch.utils._pytree.tree_leaves(detached)
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    return detached, leaves


def model_output(cap: Captured, values: dict[torch.fx.Node, Any]) -> Any:
    """The model's output as its forward returns it (a structure, a ``ModelOutput``...),
    from the values :func:`forward_pass` computed: the model is not run again."""
    graph = cap.gm.graph
    return graph.process_outputs(values[graph.output_node()])


def analytic_loss_ms(
    output: Any,
    targets: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    device: Device,
    dtype: str | None,
) -> tuple[float, float]:
    """The loss's forward and backward on the model's ``output`` (:func:`model_output`),
    priced on ``device`` (ms), as a block's are."""
    out, leaves = loss_inputs(output)
    mode = OpCostMode(device, dtype_override=dtype)
    with mode:
        with mode.phase("fwd"):
            loss = loss_fn(out, targets)
        with mode.phase("bwd"):
            if leaves and loss.requires_grad:
                torch.autograd.grad(loss, leaves, allow_unused=True)
    fwd, bwd = mode.phases.get("fwd"), mode.phases.get("bwd")
    return (fwd.time_s * 1e3 if fwd else 0.0, bwd.time_s * 1e3 if bwd else 0.0)
