"""Per-block forward/backward time and memory: measured here, or analytic for a catalogue device.

*Measured*: each block is cut out of the captured graph and timed alone on this
machine's CPU (or GPU) with its real inputs (:mod:`planner.profile.timing`).
The torch thread count is fixed for the run and recorded.

*Analytic*: each block runs once under ``OpCostMode``, which counts FLOPs
(``torch.utils.flop_counter``'s formulas) and bytes moved per operator and
prices them on a catalogue device with a roofline (:mod:`planner.profile.analytic`).

Both record the bytes autograd saves for backward (parameters excluded), the
parameter and buffer bytes each block owns, and the bytes crossing every split
point. The model is left as found: parameters, buffers (BatchNorm statistics),
``.grad``, ``.training`` and the RNG state are restored.

This module picks the blocks and assembles the records; running a block alone
is :mod:`planner.profile.runner`, ownership :mod:`planner.profile.ownership`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from planner import cache as _cache
from planner.capture.blocks import BlockChain, build_blocks
from planner.capture.trace import Captured, capture
from planner.devices.catalogue import Device
from planner.devices.local import get_device, local_cpu
from planner.options import ProfileOptions
from planner.plan.batch import batch_size_of
from planner.plan.fingerprint import fingerprint
from planner.plan.records import DTYPE_BYTES, BlockCost, ModelProfile, SplitCheck, TiedSet
from planner.plan.text import first_line
from planner.profile.analytic import OpCost
from planner.profile.loss_check import checked_loss
from planner.profile.meta import has_real, meta_twin, needs_values, shapes_only_error, to_meta
from planner.profile.ownership import Owners, param_nbytes, saved_bytes
from planner.profile.repeats import priced
from planner.profile.runner import (
    BlockRunner,
    analytic_loss_ms,
    forward_pass,
    model_output,
    requires_grad,
)
from planner.profile.state import preserved, threads_set
from planner.profile.timing import Progress, measure_blocks

__all__ = ["profile_chain", "profile_model"]

log = logging.getLogger(__name__)

_SEMANTICS = "fingerprint, saved-bytes-by-producer, generated-code forward, split check, grads"
"""Part of the cache key: bump it when a figure's meaning changes (old entries then miss)."""


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
        The ``ModelProfile``; cached on disk by the model's structural
        fingerprint, its traced graph (an edit of the forward's code changes
        it), the inputs' shapes, the device and the options.
    """
    options = options or ProfileOptions()
    kwargs = dict(kwargs or {})
    if not options.analytic:
        return _profile(model, args, kwargs, targets, loss_fn, options, progress)
    return _shapes_only(model, args, kwargs, targets, loss_fn, options, progress)


def _shapes_only(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    targets: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    options: ProfileOptions,
    progress: Progress | None,
) -> ModelProfile:
    """An analytic profile run on meta twins of the model and the batch.

    [Note: analytic profiles from shapes alone] A catalogue device's costs
    depend on shapes only, so nothing real is allocated: the model is profiled
    through :func:`~planner.profile.meta.meta_twin` (``model`` itself is not
    touched) and the batch through :func:`~planner.profile.meta.to_meta`. The
    figures are those of a run on real tensors (tests/profile/test_shapes_only.py
    checks it). A forward that needs tensor values (``.item()``, ``nonzero``)
    fails on meta: with real tensors at hand the profile is then taken on them,
    as before (logged); with meta tensors only, ``ShapesOnlyError`` says so.
    """
    real = has_real(model) and has_real(None, args, kwargs, targets)  # can fall back
    try:
        twin = meta_twin(model)
    except Exception as exc:  # deepcopy refused (a lock, an open file...): profile as given
        log.warning(
            "analytic profile on the model's own tensors: it cannot be copied to the meta "
            "device (%s: %s)",
            type(exc).__name__,
            first_line(exc),
        )
        return _profile(model, args, kwargs, targets, loss_fn, options, progress)
    meta_args, meta_kwargs, meta_targets = to_meta((args, kwargs, targets))
    fp = fingerprint(model)
    try:
        return _profile(
            twin, meta_args, meta_kwargs, meta_targets, loss_fn, options, progress, fp=fp
        )
    except Exception as exc:
        if not needs_values(exc):  # the model's own error: real tensors would raise it again
            raise
        if not real:
            raise shapes_only_error(exc, type(model).__name__) from exc
        log.warning(
            "analytic profile on shapes alone failed (%s: %s); profiling on the real "
            "tensors instead, which allocates them",
            type(exc).__name__,
            first_line(exc),
        )
        return _profile(model, args, kwargs, targets, loss_fn, options, progress)


def _profile(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    targets: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    options: ProfileOptions,
    progress: Progress | None,
    *,
    fp: str | None = None,
) -> ModelProfile:
    """``profile_model`` on the tensors given, whatever device they are on."""
    fp = fp or fingerprint(model)
    with preserved(model):
        cap = capture(model, args, kwargs)
        key = _cache.key(
            _SEMANTICS, fp, _graph_signature(cap), _signature((args, kwargs, targets)),
            options.device, options.dtype, options.repeats, options.warmup, _threads(options),
            options.target_blocks, options.split_points, loss_fn is not None,
        )  # fmt: skip
        if options.cache:
            cached = _cache.load(key)
            if cached is not None:
                log.info("profile cache hit %s", key)
                return ModelProfile.from_dict(cached, path=f"profile cache entry {key}")
        prof = profile_chain(
            model, cap, fp, targets=targets, loss_fn=loss_fn, options=options, progress=progress
        )
    if options.cache:
        _cache.store(key, prof.to_dict())
    return prof


@dataclass
class _Times:
    """A chain's times (ms) and how they were taken."""

    fwd: list[OpCost]
    bwd: list[OpCost]
    fwd_ms: list[float]
    bwd_ms: list[float]
    loss_ms: tuple[float, float] = (0.0, 0.0)
    whole_ms: tuple[float | None, float | None] = (None, None)
    repeats: int = 0
    load_note: str | None = None
    check: SplitCheck | None = None


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
    with threads_set(threads):
        values, node_time = forward_pass(cap, device, options.dtype)
        chain = build_blocks(
            cap,
            model,
            target_blocks=options.target_blocks,
            node_weight=lambda n: node_time.get(n, 0.0),
            split_points=options.split_points,
        )
        needs_grad = requires_grad(cap)
        runners = [BlockRunner(cap, b, values, needs_grad) for b in chain.blocks]
        loss = checked_loss(loss_fn, cap)  # a data-dependent batch size, explained
        times = _times(model, cap, chain, runners, values, device, targets, loss, options, progress)
    # Every byte figure is in the profile's dtype: an analytic bf16 profile of an
    # fp32 model halves parameters as well as activations, so that the cost
    # model's bytes / dtype size gives the parameter count.
    scale = _dtype_scale(options.dtype, _model_dtype(model))
    blocks = _block_costs(chain, runners, values, cap, times, scale)
    tied = tuple(
        TiedSet(names=names, blocks=blocks_, nbytes=int(param_nbytes(names[0], model) * scale))
        for names, blocks_ in chain.tied
    )
    return ModelProfile(
        fingerprint=fp,
        source="analytic" if options.analytic else "measured",
        device=device.key,
        batch_size=_batch(cap),
        dtype=options.dtype or _model_dtype(model),
        threads=0 if options.analytic else threads,
        capture=cap.method,
        blocks=blocks,
        tied=tied,
        input_bytes=_nbytes(cap.flat_inputs),
        target_bytes=_nbytes(targets),
        loss_fwd_ms=times.loss_ms[0],
        loss_bwd_ms=times.loss_ms[1],
        whole_fwd_ms=times.whole_ms[0],
        whole_bwd_ms=times.whole_ms[1],
        split_check=times.check,
        repeats=times.repeats,
        notes=_notes(chain, cap, times),
    )


def _times(
    model: nn.Module,
    cap: Captured,
    chain: BlockChain,
    runners: list[BlockRunner],
    values: dict[Any, Any],
    device: Device,
    targets: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    options: ProfileOptions,
    progress: Progress | None,
) -> _Times:
    """Every block's forward and backward: priced (analytic) or timed (measured)."""
    costs = priced(runners, device, options.dtype)  # [Note: repeated blocks]
    fwd, bwd = [c[0] for c in costs], [c[1] for c in costs]
    if options.analytic:
        loss = (0.0, 0.0)
        if loss_fn is not None:
            out = model_output(cap, values)
            loss = analytic_loss_ms(out, targets, loss_fn, device, options.dtype)
        fwd_ms, bwd_ms = [c.time_s * 1e3 for c in fwd], [c.time_s * 1e3 for c in bwd]
        return _Times(fwd, bwd, fwd_ms, bwd_ms, loss_ms=loss)
    got = measure_blocks(model, cap, runners, targets, loss_fn, options, progress)
    return _Times(
        fwd,
        bwd,
        got.fwd_ms,
        got.bwd_ms,
        loss_ms=got.loss_ms,
        whole_ms=got.whole_ms,
        repeats=got.repeats,
        load_note=got.load_note,
        check=got.check,
    )


def _block_costs(
    chain: BlockChain,
    runners: list[BlockRunner],
    values: dict[Any, Any],
    cap: Captured,
    times: _Times,
    scale: float,
) -> tuple[BlockCost, ...]:
    owners = Owners(chain)
    saved = saved_bytes(chain, runners, values)
    return tuple(
        BlockCost(
            index=k,
            name=block.name,
            modules=tuple(block.modules),
            fwd_ms=times.fwd_ms[k],
            bwd_ms=times.bwd_ms[k],
            **owners.param_fields(k, cap.gm, scale),
            buffer_bytes=owners.buffer_bytes(k, cap.gm),
            activation_bytes=int(saved[k] * scale),
            output_bytes=int(block.output_bytes * scale),
            boundary_bytes=int(block.boundary_bytes * scale),
            crossing=tuple(block.crossing),
            boundary_copy_bytes=int(block.copy_bytes * scale),
            boundary_grad_bytes=int(block.grad_bytes * scale),
            fwd_flops=times.fwd[k].flops,
            bwd_flops=times.bwd[k].flops,
            fwd_bytes_moved=times.fwd[k].bytes_moved,
        )
        for k, block in enumerate(chain.blocks)
    )


def _notes(chain: BlockChain, cap: Captured, times: _Times) -> tuple[str, ...]:
    notes = [f"excluded split point {e.fqn}: {e.reason}" for e in chain.excluded]
    if times.load_note:
        notes.append(times.load_note)
    if cap.export_error:
        notes.append(f"captured with symbolic_trace; torch.export said: {cap.export_error}")
    return tuple(notes)


# --------------------------------------------------------------------------- small helpers


def _threads(options: ProfileOptions) -> int:
    return options.threads or torch.get_num_threads()


def _nbytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (meta ones too: their size, not their storage)."""
    leaves = torch.utils._pytree.tree_leaves(obj)
    return int(sum(t.nbytes for t in leaves if isinstance(t, torch.Tensor)))


def _signature(obj: Any) -> str:
    """Shapes and dtypes of every tensor in ``obj`` (the cache cares, values don't)."""
    parts = []
    for leaf in torch.utils._pytree.tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            parts.append(f"{tuple(leaf.shape)}:{leaf.dtype}")
        else:
            parts.append(repr(leaf)[:64])
    return "|".join(parts)


def _graph_signature(cap: Captured) -> str:
    """A hash of the traced graph: each operation and the module calls it sits in."""
    h = hashlib.sha256()
    for node in cap.gm.graph.nodes:
        target = node.target if isinstance(node.target, str) else _target_name(node.target)
        calls = ",".join(c.fqn for c in cap.stacks.get(node, ()))
        h.update(f"{node.op}|{target}|{calls};".encode())
    return h.hexdigest()[:16]


def _target_name(target: Any) -> str:
    name = getattr(target, "__name__", None) or repr(target)
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{name}" if module else name


def _batch(cap: Captured) -> int:
    """The micro-batch size the figures are for (1 when the inputs have no batch dimension)."""
    try:
        return batch_size_of(cap.sample_args, cap.sample_kwargs)
    except ValueError:
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
