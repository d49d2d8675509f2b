"""Per-block forward/backward time and memory: measured here, or analytic for a catalogue device.

*Measured*: each block is cut out of the captured graph and timed alone on this
machine's CPU (or GPU) with its real inputs: ``warmup`` rounds, then
``repeats`` rounds, the median kept. Rounds interleave the blocks, the loss and
the whole unsplit model, so that all of them see the same machine load; the
whole-model figure checks that splitting did not distort the cost. The torch
thread count is fixed for the run and recorded.

*Analytic*: each block runs once under ``OpCostMode``, which counts FLOPs
(``torch.utils.flop_counter``'s formulas) and bytes moved per operator and
prices them on a catalogue device with a roofline.

Both record the bytes autograd saves for backward (parameters excluded), the
parameter and buffer bytes each block owns, and the bytes crossing every split
point. The model is left as found: parameters, buffers (BatchNorm statistics),
``.grad``, ``.training`` and the RNG state are restored.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from planner import cache as _cache
from planner.blocks import Block, BlockChain, build_blocks
from planner.capture import Captured, capture, fingerprint
from planner.catalogue import Device, get_device, local_cpu
from planner.opcost import OpCostMode
from planner.records import BlockCost, ModelProfile, TiedSet
from planner.subgraph import extract

__all__ = ["ProfileOptions", "profile_chain", "profile_model"]

log = logging.getLogger(__name__)

MIN_MEASURE_S = 1.0
"""Timed rounds continue until they add up to this many seconds (see adaptive repeats)."""
MAX_REPEATS = 50
"""...or until this many timed rounds."""

Progress = Callable[[str, int, int], None]
"""progress(phase, done, total): called as profiling advances."""


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """How to profile.

    Attributes:
        device: "local" to measure on this machine, or a catalogue key
            ("h100", "a100-80gb", ...) for analytic costs of a device not here.
        dtype: analytic only: cost activations and FLOPs as this dtype ("bf16",
            "fp16", "fp32"); None keeps the model's own dtypes.
        repeats: timed rounds per figure (the median is kept). 5 is enough on a
            quiet machine; raise it on a noisy one.
        warmup: untimed rounds first (allocator and caches warm up).
        threads: torch intra-op threads while measuring; None keeps the current
            setting. Times depend strongly on it: profile with the thread count
            each training process will have.
        target_blocks: granularity: descend into any module call holding more
            than 1/target_blocks of the work. Set it ≥ the deepest pipeline you
            want.
        cache: read and write the on-disk profile cache.
        split_points: use exactly these split points instead of the
            granularity rule (to profile the same chain at another batch size
            or on another device).
    """

    device: str = "local"
    dtype: str | None = None
    repeats: int = 5
    warmup: int = 2
    threads: int | None = None
    target_blocks: int = 64
    cache: bool = True
    split_points: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be ≥ 1, got {self.repeats}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be ≥ 0, got {self.warmup}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be ≥ 1, got {self.threads}")
        if self.target_blocks < 1:
            raise ValueError(f"target_blocks must be ≥ 1, got {self.target_blocks}")
        if self.dtype is not None and self.device == "local":
            raise ValueError(
                "dtype applies to analytic profiles only: pass a catalogue device "
                f"(e.g. device='h100') with dtype={self.dtype!r}, or leave dtype unset"
            )

    @property
    def analytic(self) -> bool:
        return self.device != "local"


def profile_model(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    targets: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    options: ProfileOptions | None = None,
    progress: Progress | None = None,
) -> ModelProfile:
    """Profile every block of ``model`` on one micro-batch.

    Example::

        prof = profile_model(model, (x,), targets=y, loss_fn=F.cross_entropy)
        for b in prof.blocks:
            print(b.name, b.fwd_ms, b.bwd_ms, b.activation_bytes)

    Args:
        model: the model (left unchanged).
        args, kwargs: one micro-batch of inputs; its batch dimension is the
            micro-batch size the figures are for.
        targets, loss_fn: the loss, timed on its own (it runs on the last stage).
            Without them no loss cost is recorded.
        options: see ``ProfileOptions``.
        progress: optional callback for a progress bar.

    Returns:
        The ``ModelProfile``; cached on disk by the model's fingerprint, the
        inputs' shapes, the device and the options.
    """
    options = options or ProfileOptions()
    kwargs = dict(kwargs or {})
    with _preserved(model):
        cap = capture(model, args, kwargs)
        fp = fingerprint(cap, model)
        key = _cache.key(
            fp,
            _signature((args, kwargs, targets)),
            options.device,
            options.dtype,
            options.repeats,
            options.warmup,
            _threads(options),
            options.target_blocks,
            options.split_points,
            loss_fn is not None,
        )
        if options.cache:
            cached = _cache.load(key)
            if cached is not None:
                log.info("profile cache hit %s", key)
                return ModelProfile.from_dict(cached)
        prof = profile_chain(
            model, cap, fp, targets=targets, loss_fn=loss_fn, options=options, progress=progress
        )
    if options.cache:
        _cache.store(key, prof.to_dict())
    return prof


def profile_chain(
    model: nn.Module,
    cap: Captured,
    fp: str,
    *,
    targets: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    options: ProfileOptions,
    progress: Progress | None = None,
) -> ModelProfile:
    """Profile an already captured model (no cache). See ``profile_model``."""
    device = get_device(options.device) if options.analytic else local_cpu()
    threads = _threads(options)
    with _threads_set(threads):
        values, node_time = _forward_pass(cap, device, options.dtype)
        chain = build_blocks(
            cap,
            model,
            target_blocks=options.target_blocks,
            node_weight=lambda n: node_time.get(n, 0.0),
            split_points=options.split_points,
        )
        needs_grad = _requires_grad(cap)
        runners = [_BlockRunner(cap, b, values, needs_grad) for b in chain.blocks]
        costs = [r.cost(device, options.dtype) for r in runners]
        fwd = [c[0] for c in costs]
        bwd = [c[1] for c in costs]
        loss_times = (0.0, 0.0)
        whole: tuple[float | None, float | None] = (None, None)
        repeats = 0
        if options.analytic:
            fwd_ms = [c.time_s * 1e3 for c in fwd]
            bwd_ms = [c.time_s * 1e3 for c in bwd]
            if loss_fn is not None:
                loss_times = _loss_cost(model, cap, targets, loss_fn, device, options.dtype)
        else:
            fwd_ms, bwd_ms, loss_times, whole, repeats = _measure(
                model, cap, runners, targets, loss_fn, options, progress
            )

    owners = _Owners(chain)
    scale = _dtype_scale(options.dtype, _model_dtype(model))
    blocks = []
    for k, (block, runner) in enumerate(zip(chain.blocks, runners, strict=True)):
        blocks.append(
            BlockCost(
                index=k,
                name=block.name,
                modules=tuple(block.modules),
                fwd_ms=fwd_ms[k],
                bwd_ms=bwd_ms[k],
                param_bytes=owners.param_bytes(k, cap.gm),
                buffer_bytes=owners.buffer_bytes(k, cap.gm),
                activation_bytes=int(runner.saved_bytes * scale),
                output_bytes=int(block.output_bytes * scale),
                boundary_bytes=int(block.boundary_bytes * scale),
                fwd_flops=fwd[k].flops,
                bwd_flops=bwd[k].flops,
                fwd_bytes_moved=fwd[k].bytes_moved,
            )
        )
    tied = tuple(
        TiedSet(names=names, blocks=blocks_, nbytes=_param_nbytes(names[0], model))
        for names, blocks_ in chain.tied
    )
    notes = [f"excluded split point {e.fqn}: {e.reason}" for e in chain.excluded]
    if cap.export_error:
        notes.append(f"captured with symbolic_trace; torch.export said: {cap.export_error}")
    batch = _batch_size(cap.flat_inputs)
    return ModelProfile(
        fingerprint=fp,
        source="analytic" if options.analytic else "measured",
        device=device.key,
        batch_size=batch,
        dtype=options.dtype or _model_dtype(model),
        threads=0 if options.analytic else threads,
        capture=cap.method,
        blocks=tuple(blocks),
        tied=tied,
        input_bytes=int(sum(t.nbytes for t in cap.flat_inputs if isinstance(t, torch.Tensor))),
        loss_fwd_ms=loss_times[0],
        loss_bwd_ms=loss_times[1],
        whole_fwd_ms=whole[0],
        whole_bwd_ms=whole[1],
        repeats=0 if options.analytic else repeats,
        notes=tuple(notes),
    )


# --------------------------------------------------------------------------- model state


@contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
    """Leave parameters, buffers, grads, modes and the RNG exactly as found."""
    training = [(m, m.training) for m in model.modules()]
    tensors = list(model.parameters()) + list(model.buffers())
    saved = [t.detach().clone() for t in tensors]
    grads = [p.grad for p in model.parameters()]
    requires = [p.requires_grad for p in model.parameters()]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for t, s in zip(tensors, saved, strict=True):
                t.copy_(s)
        for p, g, r in zip(model.parameters(), grads, requires, strict=True):
            p.grad = g
            p.requires_grad_(r)
        for m, mode in training:
            m.training = mode
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _threads(options: ProfileOptions) -> int:
    return options.threads or torch.get_num_threads()


@contextmanager
def _threads_set(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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


# --------------------------------------------------------------------------- ownership


class _Owners:
    """Which block owns each parameter/buffer (the first block that uses it)."""

    def __init__(self, chain: BlockChain) -> None:
        self.chain = chain
        self.first: dict[str, int] = {}
        self.target_of: dict[str, str] = {}
        for block in chain.blocks:
            for target in block.params:
                canon = chain.param_owner.get(target, target)
                self.first.setdefault(canon, block.index)
                self.target_of.setdefault(canon, target)

    def _bytes(self, k: int, gm: torch.fx.GraphModule, params: bool) -> int:
        total = 0
        for canon, first in self.first.items():
            if first != k:
                continue
            t = _attr(gm, self.target_of[canon])
            if isinstance(t, torch.Tensor) and isinstance(t, nn.Parameter) == params:
                total += t.numel() * t.element_size()
        return total

    def param_bytes(self, k: int, gm: torch.fx.GraphModule) -> int:
        return self._bytes(k, gm, params=True)

    def buffer_bytes(self, k: int, gm: torch.fx.GraphModule) -> int:
        return self._bytes(k, gm, params=False)


def _param_nbytes(name: str, model: nn.Module) -> int:
    named: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    t = named.get(name)
    return int(t.numel() * t.element_size()) if t is not None else 0


# --------------------------------------------------------------------------- small helpers


def _signature(obj: Any) -> str:
    """Shapes and dtypes of every tensor in ``obj`` (the cache cares, values don't)."""
    parts = []
    for leaf in torch.utils._pytree.tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            parts.append(f"{tuple(leaf.shape)}:{leaf.dtype}")
        else:
            parts.append(repr(leaf)[:64])
    return "|".join(parts)


def _batch_size(flat: Sequence[Any]) -> int:
    for t in flat:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return 1


def _model_dtype(model: nn.Module) -> str:
    for p in model.parameters():
        return str(p.dtype).removeprefix("torch.")
    return "float32"


_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


def _dtype_scale(dtype: str | None, model_dtype: str) -> float:
    """Bytes of the analytic ``dtype`` relative to the model's own float dtype."""
    if dtype is None or model_dtype not in _DTYPE_BYTES:
        return 1.0
    return _DTYPE_BYTES[dtype] / _DTYPE_BYTES[model_dtype]
