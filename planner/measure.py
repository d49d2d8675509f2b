"""Running blocks alone: the graph's values for their inputs, the block runner, timed rounds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch import nn

from planner.blocks import Block
from planner.capture import Captured
from planner.catalogue import Device
from planner.opcost import OpCostMode
from planner.subgraph import extract

if TYPE_CHECKING:
    from planner.profile import ProfileOptions, Progress

MIN_MEASURE_S = 1.0
"""Timed rounds continue until they add up to this many seconds (see adaptive repeats)."""
MAX_REPEATS = 50
"""...or until this many timed rounds."""


# --------------------------------------------------------------------------- forward pass


def _forward_pass(
    cap: Captured, device: Device, dtype: str | None
) -> tuple[dict[torch.fx.Node, Any], dict[torch.fx.Node, float]]:
    """Run the graph once: every node's value, and its estimated time on ``device``."""
    values: dict[torch.fx.Node, Any] = {}
    node_time: dict[torch.fx.Node, float] = {}
    mode = OpCostMode(device, dtype_override=dtype)

    class _Run(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            if n.op in ("call_function", "call_method", "call_module"):
                with mode.phase(n.name):
                    result = super().run_node(n)
                node_time[n] = mode.phases[n.name].time_s
            else:
                result = super().run_node(n)
            values[n] = result
            return result

    with torch.no_grad(), mode:
        _Run(cap.gm).run(*cap.flat_inputs)
    return values, node_time


def _requires_grad(cap: Captured) -> dict[torch.fx.Node, bool]:
    """Whether each node's value needs a gradient in a training step."""
    rg: dict[torch.fx.Node, bool] = {}
    for node in cap.gm.graph.nodes:
        if node.op == "placeholder":
            rg[node] = False
        elif node.op == "get_attr":
            attr = _attr(cap.gm, str(node.target))
            rg[node] = isinstance(attr, torch.Tensor) and attr.requires_grad
        else:
            info = cap.values.get(node)
            float_out = getattr(getattr(info, "dtype", None), "is_floating_point", False)
            rg[node] = bool(float_out) and any(rg.get(a, False) for a in node.all_input_nodes)
    return rg


def _attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------- one block


class _BlockRunner:
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
        self.inputs = []
        for node in block.inputs:
            value = values[node]
            if isinstance(value, torch.Tensor):
                value = value.detach().requires_grad_(needs_grad.get(node, False))
            self.inputs.append(value)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self._exclude = {t.untyped_storage().data_ptr() for t in self.module.parameters()}
        self._exclude |= {t.untyped_storage().data_ptr() for t in self.module.buffers()}
        self.saved_bytes = 0
        self._grads: list[torch.Tensor] | None = None

    def forward(self) -> tuple[Any, ...]:
        return self.module(*self.inputs)

    def differentiable(self, outs: Sequence[Any]) -> list[torch.Tensor]:
        return [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]

    def backward(self, outs: Sequence[Any]) -> None:
        diff = self.differentiable(outs)
        if not diff:
            return
        wrt = self.params + [
            t for t in self.inputs if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if self._grads is None:
            gen = torch.Generator().manual_seed(self.block.index)
            self._grads = [
                torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in diff
            ]
        torch.autograd.grad(diff, wrt, self._grads, allow_unused=True)

    def cost(self, device: Device, dtype: str | None) -> tuple[Any, Any]:
        """One forward + backward under OpCostMode; records saved-for-backward bytes."""
        mode = OpCostMode(device, dtype_override=dtype)
        seen: set[int] = set()
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._exclude and ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
            return t

        with mode:
            with mode.phase("fwd"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                outs = self.forward()
            with mode.phase("bwd"):
                self.backward(outs)
        self.saved_bytes = total
        from planner.opcost import OpCost

        return mode.phases.get("fwd", OpCost()), mode.phases.get("bwd", OpCost())


# --------------------------------------------------------------------------- measuring


def _measure(
    model: nn.Module,
    cap: Captured,
    runners: list[_BlockRunner],
    targets: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    options: ProfileOptions,
    progress: Progress | None,
) -> tuple[list[float], list[float], tuple[float, float], tuple[float | None, float | None], int]:
    n = len(runners)
    fwd: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    loss_f: list[float] = []
    loss_b: list[float] = []
    whole_f: list[float] = []
    whole_b: list[float] = []
    params = [p for p in model.parameters() if p.requires_grad]
    args, kwargs = _unflatten(cap)
    whole_grads: list[torch.Tensor] | None = None
    # [Note: adaptive repeats] A short model is timed for more rounds: at least
    # `repeats`, and more until the timed rounds add up to MIN_MEASURE_S (at most
    # MAX_REPEATS), so a millisecond-scale model is not at the mercy of one hiccup.
    rounds = options.warmup + options.repeats
    started: float | None = None
    r = 0
    while True:
        keep = r >= options.warmup
        if keep and started is None:
            started = time.perf_counter()
        kept = r - options.warmup
        if kept >= options.repeats and started is not None:
            spent = time.perf_counter() - started
            if spent >= MIN_MEASURE_S or kept >= max(MAX_REPEATS, options.repeats):
                break
            rounds = r + 1
        for k, runner in enumerate(runners):
            t0 = time.perf_counter()
            outs = runner.forward()
            t1 = time.perf_counter()
            runner.backward(outs)
            t2 = time.perf_counter()
            del outs
            if keep:
                fwd[k].append((t1 - t0) * 1e3)
                bwd[k].append((t2 - t1) * 1e3)
            if progress is not None:
                progress("blocks", r * (n + 1) + k + 1, rounds * (n + 1))
        # The whole model, unsplit, and the loss on its output.
        t0 = time.perf_counter()
        out = model(*args, **kwargs)
        t1 = time.perf_counter()
        flat_out = [
            o
            for o in torch.utils._pytree.tree_leaves(out)
            if isinstance(o, torch.Tensor) and o.requires_grad
        ]
        if whole_grads is None:
            gen = torch.Generator().manual_seed(0)
            whole_grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in flat_out]
        if flat_out:
            torch.autograd.grad(flat_out, params, whole_grads, allow_unused=True)
        t2 = time.perf_counter()
        if keep:
            whole_f.append((t1 - t0) * 1e3)
            whole_b.append((t2 - t1) * 1e3)
        if loss_fn is not None:
            lf, lb = _time_loss(out, targets, loss_fn)
            if keep:
                loss_f.append(lf)
                loss_b.append(lb)
        del out
        if progress is not None:
            progress("blocks", (r + 1) * (n + 1), rounds * (n + 1))
        r += 1
    med = statistics.median
    hf, hb = _harness_overhead()
    return (
        [_net(med(x), hf) for x in fwd],
        [_net(med(x), hb) for x in bwd],
        (med(loss_f), med(loss_b)) if loss_f else (0.0, 0.0),
        (med(whole_f), med(whole_b)),
        len(whole_f),
    )


def _net(measured: float, overhead: float) -> float:
    """A block's time less the timing harness's own cost (never below 10 % of the reading)."""
    return max(measured - overhead, 0.1 * measured)


def _harness_overhead(rounds: int = 60) -> tuple[float, float]:
    """Forward and backward time (ms) of a block that does nothing, timed like a block.

    [Note: harness overhead] Timing a block alone costs a module call and an
    ``autograd.grad`` call that the whole model does not pay per block; left
    in, it inflates Σ blocks by ~0.03 ms per block here (≈ 4 % of the 9-block
    MLP example). It is measured with the same harness and subtracted.
    """
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (x, 1.0)),))
    module = torch.fx.GraphModule(nn.Module(), graph)
    inp = torch.zeros(1, requires_grad=True)
    grad = [torch.ones(1)]
    fwd, bwd = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = module(inp)
        t1 = time.perf_counter()
        torch.autograd.grad(list(out), [inp], grad)
        t2 = time.perf_counter()
        fwd.append((t1 - t0) * 1e3)
        bwd.append((t2 - t1) * 1e3)
    return statistics.median(fwd[10:]), statistics.median(bwd[10:])


def _time_loss(
    out: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
) -> tuple[float, float]:
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
    t0 = time.perf_counter()
    loss = loss_fn(detached, targets)
    t1 = time.perf_counter()
    if leaves and loss.requires_grad:
        torch.autograd.grad(loss, leaves, allow_unused=True)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def _loss_cost(
    model: nn.Module,
    cap: Captured,
    targets: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    device: Device,
    dtype: str | None,
) -> tuple[float, float]:
    args, kwargs = _unflatten(cap)
    with torch.no_grad():
        out = model(*args, **kwargs)
    out = torch.utils._pytree.tree_map(
        lambda t: (
            t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
        ),
        out,
    )
    mode = OpCostMode(device, dtype_override=dtype)
    with mode:
        with mode.phase("fwd"):
            loss = loss_fn(out, targets)
        with mode.phase("bwd"):
            leaves = [
                t
                for t in torch.utils._pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if leaves and loss.requires_grad:
                torch.autograd.grad(loss, leaves, allow_unused=True)
    fwd, bwd = mode.phases.get("fwd"), mode.phases.get("bwd")
    return (fwd.time_s * 1e3 if fwd else 0.0, bwd.time_s * 1e3 if bwd else 0.0)


def _unflatten(cap: Captured) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The sample batch as the model's forward takes it."""
    return cap.sample_args, cap.sample_kwargs
