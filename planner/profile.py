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

The graph's forward pass, running a block alone, the timed rounds and the loss's
figures are in :mod:`planner.measure`; this module picks the blocks and assembles
the records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from planner import cache as _cache
from planner.blocks import BlockChain, build_blocks
from planner.capture import Captured, capture, fingerprint
from planner.catalogue import get_device
from planner.localdevice import local_cpu
from planner.measure import MAX_REPEATS as MAX_REPEATS
from planner.measure import MIN_MEASURE_S as MIN_MEASURE_S
from planner.measure import (
    _attr,
    _BlockRunner,
    _forward_pass,
    _interpreter_ms,
    _loss_cost,
    _measure,
    _requires_grad,
)
from planner.records import DTYPE_BYTES, BlockCost, ModelProfile, TiedSet

__all__ = ["ProfileOptions", "profile_chain", "profile_model"]

log = logging.getLogger(__name__)

_SEMANTICS = "saved-bytes-by-producer, interpreted forward"
"""Part of the cache key: bump it when a figure's meaning changes (old entries then miss)."""

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
            _SEMANTICS,
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
        load_note: str | None = None
        interpreted = 0.0
        if options.analytic:
            fwd_ms = [c.time_s * 1e3 for c in fwd]
            bwd_ms = [c.time_s * 1e3 for c in bwd]
            if loss_fn is not None:
                loss_times = _loss_cost(model, cap, targets, loss_fn, device, options.dtype)
        else:
            fwd_ms, bwd_ms, loss_times, whole, repeats, load_note = _measure(
                model, cap, runners, targets, loss_fn, options, progress
            )
            if device.kind == "cpu":
                extra = _interpreter_ms(cap, values, chain)
                fwd_ms = [f + x for f, x in zip(fwd_ms, extra, strict=True)]
                interpreted = sum(extra)

    owners = _Owners(chain)
    saved = _saved_bytes(chain, runners, values)
    # Every byte figure is in the profile's dtype: an analytic bf16 profile of an
    # fp32 model halves parameters as well as activations, so that the cost
    # model's bytes / dtype size gives the parameter count.
    scale = _dtype_scale(options.dtype, _model_dtype(model))
    blocks = []
    for k, block in enumerate(chain.blocks):
        blocks.append(
            BlockCost(
                index=k,
                name=block.name,
                modules=tuple(block.modules),
                fwd_ms=fwd_ms[k],
                bwd_ms=bwd_ms[k],
                param_bytes=int(owners.param_bytes(k, cap.gm) * scale),
                buffer_bytes=owners.buffer_bytes(k, cap.gm),
                activation_bytes=int(saved[k] * scale),
                output_bytes=int(block.output_bytes * scale),
                boundary_bytes=int(block.boundary_bytes * scale),
                fwd_flops=fwd[k].flops,
                bwd_flops=bwd[k].flops,
                fwd_bytes_moved=fwd[k].bytes_moved,
            )
        )
    tied = tuple(
        TiedSet(names=names, blocks=blocks_, nbytes=int(_param_nbytes(names[0], model) * scale))
        for names, blocks_ in chain.tied
    )
    notes = [f"excluded split point {e.fqn}: {e.reason}" for e in chain.excluded]
    if load_note:
        notes.append(load_note)
    if not options.analytic and device.kind == "cpu":
        notes.append(
            f"forward times include {interpreted:.2f} ms of torch.fx.Interpreter overhead "
            "(the runtime's stage modules run interpreted; see planner.measure)"
        )
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


def _saved_bytes(
    chain: BlockChain, runners: Sequence[_BlockRunner], values: dict[torch.fx.Node, Any]
) -> list[int]:
    """Per block, the bytes the backward keeps that the block created.

    A block's own saved storages, plus its outputs that later blocks save (and
    it did not): see [Note: saved bytes, each tensor once] in planner.measure.
    Model inputs saved by a block are charged to no block: they are the batch,
    which the caller holds anyway.
    """
    producer: dict[torch.fx.Node, int] = {}
    for block in chain.blocks:
        for node in block.nodes:
            producer[node] = block.index
    out = [r.saved_bytes for r in runners]
    charged: set[int] = set()
    for block, runner in zip(chain.blocks, runners, strict=True):
        for k in sorted(runner.saved_inputs):
            node = block.inputs[k]
            value = values.get(node)
            p = producer.get(node)
            if p is None or not isinstance(value, torch.Tensor):
                continue
            src = chain.blocks[p]
            if node in src.outputs and src.outputs.index(node) in runners[p].saved_outputs:
                continue  # the producer saved it itself: already in its figure
            storage = value.untyped_storage()
            if storage.data_ptr() not in charged:
                charged.add(storage.data_ptr())
                out[p] += storage.nbytes()
    return out


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


def _dtype_scale(dtype: str | None, model_dtype: str) -> float:
    """Bytes of the analytic ``dtype`` relative to the model's own float dtype."""
    if dtype is None or model_dtype not in DTYPE_BYTES:
        return 1.0
    return DTYPE_BYTES[dtype] / DTYPE_BYTES[model_dtype]
