"""Running blocks alone: the graph's values for their inputs, the block runner, timed rounds."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch import nn

from planner.blocks import Block, BlockChain
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
QUIET_SHARE = 0.10
"""A timed round is quiet when other processes kept under this share of the cores busy."""
MAX_MEASURE_S = 15.0
"""On a busy machine, rounds go on for at most this long waiting for quiet ones."""


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


def _storage_key(t: torch.Tensor) -> int:
    """A storage's identity (``data_ptr()`` is 0 for every meta tensor)."""
    return t.untyped_storage()._cdata


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
        self._exclude = {_storage_key(t) for t in self.module.parameters()}
        self._exclude |= {_storage_key(t) for t in self.module.buffers()}
        self.saved_bytes = 0
        self.saved_inputs: set[int] = set()
        self.saved_outputs: set[int] = set()
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
        self.seed_grads(outs)
        torch.autograd.grad(diff, wrt, self._grads, allow_unused=True)

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

    def cost(self, device: Device, dtype: str | None) -> tuple[Any, Any]:
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
            _storage_key(t): k for k, t in enumerate(self.inputs) if isinstance(t, torch.Tensor)
        }
        seen: set[int] = set()
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            storage = t.untyped_storage()
            ptr = _storage_key(t)
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
                if isinstance(o, torch.Tensor) and _storage_key(o) in seen
            }
        self.seed_grads(outs)  # outside the mode: making the seed is not the block's work
        with mode, mode.phase("bwd"):
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
) -> tuple[
    list[float],
    list[float],
    tuple[float, float],
    tuple[float | None, float | None],
    int,
    str | None,
]:
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
    # [Note: quiet rounds] On a shared machine another process's burst slows some
    # rounds (and a multi-threaded round far more: its threads wait on each other).
    # Each round's load is read from /proc/stat; rounds continue (up to
    # MAX_MEASURE_S) until `repeats` were quiet, and only quiet rounds count, or,
    # failing that, the least loaded half.
    load = _Load()
    rounds = options.warmup + options.repeats
    started: float | None = None
    r = 0
    while True:
        keep = r >= options.warmup
        if keep and started is None:
            started = time.perf_counter()
            load.start()
        kept = r - options.warmup
        if kept >= options.repeats and started is not None:
            spent = time.perf_counter() - started
            enough = spent >= MIN_MEASURE_S and load.quiet() >= options.repeats
            if enough or kept >= max(MAX_REPEATS, options.repeats) or spent >= MAX_MEASURE_S:
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
        if keep:
            load.round_done()
        if progress is not None:
            progress("blocks", (r + 1) * (n + 1), rounds * (n + 1))
        r += 1
    use = load.selection()

    def med(xs: list[float]) -> float:
        return statistics.median(xs[i] for i in use)

    hf, hb = _harness_overhead()
    return (
        [_net(med(x), hf) for x in fwd],
        [_net(med(x), hb) for x in bwd],
        (med(loss_f), med(loss_b)) if loss_f else (0.0, 0.0),
        (med(whole_f), med(whole_b)),
        len(use),
        load.note(),
    )


def _busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (Linux), else None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class _Load:
    """Other processes' share of the cores per timed round ([Note: quiet rounds]).

    /proc/stat counts in 10 ms ticks, so rounds are read in windows of at least
    ``window_s``; every round of a window gets the window's share.
    """

    def __init__(self, window_s: float = 0.2) -> None:
        self.window_s = window_s
        self.shares: list[float] = []
        self.pending = 0
        self.cores = os.cpu_count() or 1

    def start(self) -> None:
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_s(), time.process_time()

    def round_done(self) -> None:
        self.pending += 1
        if time.perf_counter() - self.t0 >= self.window_s:
            self._close_window()

    def _close_window(self) -> None:
        if not self.pending:
            return
        wall = time.perf_counter() - self.t0
        busy = _busy_s()
        share = 0.0
        if busy is not None and self.busy0 is not None and wall > 0:
            own = time.process_time() - self.own0
            share = max(0.0, busy - self.busy0 - own) / (wall * self.cores)
        self.shares += [share] * self.pending
        self.pending = 0
        self.start()

    def quiet(self) -> int:
        return sum(x < QUIET_SHARE for x in self.shares)

    def selection(self) -> list[int]:
        """Indices of the rounds to keep: the quiet ones, else the least loaded half."""
        self._close_window()
        quiet = [i for i, x in enumerate(self.shares) if x < QUIET_SHARE]
        if len(quiet) >= min(3, len(self.shares)):
            return quiet
        order = sorted(range(len(self.shares)), key=lambda i: self.shares[i])
        return sorted(order[: max(1, len(order) // 2)])

    def note(self) -> str | None:
        if self.quiet() == len(self.shares):
            return None
        kept = len(self.selection())
        return (
            f"{self.quiet()} of {len(self.shares)} timed rounds were quiet (other processes "
            f"under {QUIET_SHARE:.0%} of the cores); the times are medians of {kept}"
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


def _interpreter_ms(
    cap: Captured, values: dict[torch.fx.Node, Any], chain: BlockChain, rounds: int = 7
) -> list[float]:
    """Per block, the ms that running its nodes through ``torch.fx.Interpreter`` adds.

    [Note: interpreter overhead] The runtime's stage modules (``pipeline()``'s
    unflattened export modules) run their graphs with a new
    ``torch.fx.Interpreter`` per call: building it (last uses of every value)
    and stepping through the nodes in Python costs some 20 µs per node here,
    1-2 ms per forward of a CNN stage, where the block timings (generated code)
    spend none. It is timed by replaying the whole graph with every op's result
    taken from ``values`` (only the interpreter's own work is left) and shared
    among the blocks by their node counts. Added to measured CPU forward times;
    on a GPU it overlaps the kernels.
    """
    current: list[torch.fx.Node] = []

    class _Replay(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            current[:] = [n]
            return super().run_node(n)

        def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
            return values[current[0]]

        call_method = call_function
        call_module = call_function

    spent = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        _Replay(cap.gm).run(*cap.flat_inputs)
        spent.append(time.perf_counter() - t0)
    per_node = statistics.median(spent[1:]) * 1e3 / max(1, sum(len(b.nodes) for b in chain.blocks))
    return [per_node * len(b.nodes) for b in chain.blocks]


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
