"""Analytic operator costing: FLOPs, bytes moved and roofline time of aten ops.

Run any PyTorch code under :class:`OpCostMode` and it adds up, for every aten
operator executed, the FLOPs (from ``torch.utils.flop_counter``'s formulas), the
bytes the operator reads and writes, and its roofline time on a catalogue
:class:`~planner.devices.catalogue.Device`. It works on meta tensors too, backward
included, so a model far too big for this machine can be priced for a GPU that
is not here.

Example::

    >>> import torch
    >>> from planner.devices import get_device
    >>> with torch.device("meta"):
    ...     layer = torch.nn.Linear(4096, 4096)
    ...     x = torch.randn(8, 4096)
    >>> with OpCostMode(get_device("h100"), dtype_override="bf16") as mode:
    ...     with mode.phase("fwd"):
    ...         loss = layer(x).sum()
    ...     with mode.phase("bwd"):
    ...         loss.backward()
    >>> mode.phases["fwd"].flops == 2 * 8 * 4096 * 4096
    True

What is counted, per operator (see [Note: roofline per op]):

- FLOPs: the registered formula of ``torch.utils.flop_counter.flop_registry``
  for the op, 0 for ops without one (elementwise ops, reductions, norms...).
  The registry counts matmuls, convolutions and attention only: ``addmm`` counts
  ``2·m·k·n`` and not its bias add; a Linear's backward is one ``mm`` per
  gradient (input, weight), its bias gradient a ``sum`` (0 FLOPs).
- bytes: every tensor argument and output of the op, each counted once per
  appearance (an in-place ``a.add_(b)`` reads ``a`` and ``b`` and writes ``a``).
  A broadcast dimension (stride 0) counts once, not once per repeat.
  Views and metadata ops (``_ZERO_COST``) cost nothing: no bytes, no op, no
  overhead.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from planner.devices.catalogue import Device, dtype_key

__all__ = ["OpCost", "OpCostMode", "measure_cost"]

aten = torch.ops.aten


def _packets(*names: str) -> frozenset[Any]:
    # getattr with a default: some of these ops come and go between torch versions.
    found = (getattr(aten, n, None) for n in names)
    return frozenset(p for p in found if p is not None)


# Ops that move no data: views (their output aliases the input), metadata
# queries and bare allocations. Any other op whose schema says it returns a view
# of its input (``OpOverload.is_view``) is treated the same way.
_ZERO_COST = _packets(
    # views and aliases
    "view", "_unsafe_view", "_reshape_alias", "reshape", "t", "transpose", "expand",
    "permute", "detach", "alias", "split", "split_with_sizes", "unbind", "squeeze",
    "unsqueeze", "select", "slice", "as_strided", "view_as_real", "view_as_complex",
    "lift_fresh", "unflatten", "diagonal", "narrow",
    # metadata queries
    "size", "sym_size", "stride", "sym_stride", "storage_offset", "sym_storage_offset",
    "numel", "sym_numel", "dim", "is_contiguous", "sym_is_contiguous",
    "is_strides_like_format", "is_non_overlapping_and_dense",
    # allocations that write nothing
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
) | {torch.ops.prim.device, torch.ops.prim.layout}  # fmt: skip

# Formulas for the CPU's fused attention kernels, which the registry lacks. Their
# first arguments (query, key, value; grad_out first for backward) line up with
# the CUDA flash kernels', so those formulas apply as they are.
_EXTRA_FLOPS: dict[Any, Any] = {}
if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _EXTRA_FLOPS[aten._scaled_dot_product_flash_attention_for_cpu] = flop_registry[
        aten._scaled_dot_product_flash_attention
    ]
    _EXTRA_FLOPS[aten._scaled_dot_product_flash_attention_for_cpu_backward] = flop_registry[
        aten._scaled_dot_product_flash_attention_backward
    ]
_FLOPS = {**flop_registry, **_EXTRA_FLOPS}

_DTYPE_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_KEY_ITEMSIZE = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}


@dataclass
class OpCost:
    """Totals over a run of operators.

    Attributes:
        flops: floating-point operations (multiply and add counted apart).
        bytes_moved: bytes read and written by the operators.
        ops: operators that did work (views excluded).
        time_s: summed roofline time on the mode's device (0 without one).
    """

    flops: float = 0.0
    bytes_moved: float = 0.0
    ops: int = 0
    time_s: float = 0.0

    def __add__(self, other: OpCost) -> OpCost:
        if not isinstance(other, OpCost):
            return NotImplemented
        return OpCost(
            flops=self.flops + other.flops,
            bytes_moved=self.bytes_moved + other.bytes_moved,
            ops=self.ops + other.ops,
            time_s=self.time_s + other.time_s,
        )

    def _add(self, flops: float, nbytes: float, time_s: float) -> None:
        self.flops += flops
        self.bytes_moved += nbytes
        self.ops += 1
        self.time_s += time_s


class OpCostMode(TorchDispatchMode):
    """Adds up FLOPs, bytes and roofline time of the aten ops run under it.

    Example::

        >>> import torch
        >>> from planner.devices import get_device
        >>> a = torch.randn(64, 32)
        >>> with OpCostMode(get_device("a100")) as mode:
        ...     _ = a @ a.T
        >>> mode.total.flops == 2 * 64 * 32 * 64, mode.total.ops
        (True, 1)

    [Note: roofline per op]
    Each operator that does work costs, on ``device``::

        time = max(flops / device.flops_per_s(dtype),
                   bytes / (device.memory_bandwidth · device.memory_efficiency))
               + device.op_overhead_s

    with ``dtype`` the op's output dtype (float32 → fp32, bfloat16 → bf16,
    float16 → fp16; any other dtype is priced as fp32). Views cost nothing.

    On meta tensors, ``F.scaled_dot_product_attention`` (or the aten op that a
    captured graph calls) is routed to the fused (flash) CPU kernel, as a real
    CPU or GPU run would be, instead of the unfused math path the meta device
    otherwise takes (which writes the whole ``L×S`` score matrix). It stays on
    the math path when it has a mask, dropout or grouped-query heads.

    Args:
        device: the device to price time on; None counts FLOPs and bytes only
            (``time_s`` stays 0).
        dtype_override: price the run as if its floating-point tensors were this
            dtype (``"bf16"``, ``"fp16"``, ``"fp32"``, ``"tf32"``): FLOPs use its
            peak, and floating-point bytes scale by its size over the actual
            one. For costing an fp32-traced model that will train in bf16.

    Attributes:
        total: everything run under the mode, across all its uses.
        phases: per phase name (see :meth:`phase`).
    """

    def __init__(self, device: Device | None = None, *, dtype_override: str | None = None):
        super().__init__()
        self.device = device
        self.dtype_override = dtype_key(dtype_override) if dtype_override is not None else None
        self.total = OpCost()
        self.phases: dict[str, OpCost] = {}
        self._active: list[str] = []
        self._stack: list[ExitStack] = []

    def __enter__(self) -> OpCostMode:
        stack = ExitStack()
        stack.enter_context(_FusedAttentionOnMeta())
        self._stack.append(stack)
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._stack.pop().close()

    def phase(self, name: str) -> AbstractContextManager[OpCost]:
        """Also add the ops run inside to ``self.phases[name]`` (and yield it).

        Phases nest; an op counts once in each phase that is open. Entering the
        same name again adds to what it holds.

        Example::

            >>> x = torch.ones(3)
            >>> with OpCostMode() as mode, mode.phase("fwd"):
            ...     _ = x + 1
            >>> mode.phases["fwd"].ops
            1
        """
        return self._phase(name)

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[OpCost]:
        cost = self.phases.setdefault(name, OpCost())
        self._active.append(name)
        try:
            yield cost
        finally:
            self._active.remove(name)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if packet in _ZERO_COST or func.is_view:
            return func(*args, **kwargs)
        if packet not in _FLOPS:
            # As FlopCounterMode does: an op that reaches us undecomposed (e.g.
            # aten.linear under inference_mode) may hide a matmul; cost its parts.
            # Re-enter as a dispatch mode only, with torch-function handling off:
            # a torch-function mode would turn the decomposition's inner call back
            # into the whole op, and this method would recurse forever.
            with _reentered(self), torch._C.DisableTorchFunction():
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        self._count(packet, args, kwargs, out)
        return out

    def _count(self, packet: Any, args: Any, kwargs: Any, out: Any) -> None:
        flops = float(_FLOPS[packet](*args, **kwargs, out_val=out)) if packet in _FLOPS else 0.0
        inputs, _ = tree_flatten((args, kwargs))
        outputs, _ = tree_flatten(out)
        tensors = [t for t in inputs + outputs if isinstance(t, torch.Tensor)]
        nbytes = float(sum(self._bytes(t) for t in tensors))
        out_tensors = [t for t in outputs if isinstance(t, torch.Tensor)] or tensors
        time_s = self._time(flops, nbytes, out_tensors[0].dtype if out_tensors else None)
        self.total._add(flops, nbytes, time_s)
        for name in set(self._active):
            self.phases[name]._add(flops, nbytes, time_s)

    def _bytes(self, t: torch.Tensor) -> float:
        try:
            elements = math.prod(s for s, st in zip(t.shape, t.stride(), strict=True) if st != 0)
        except (RuntimeError, NotImplementedError):  # no strides (sparse, nested)
            elements = t.numel()
        nbytes = float(elements * t.element_size()) if t.numel() else 0.0
        if self.dtype_override is not None and t.is_floating_point():
            nbytes *= _KEY_ITEMSIZE[self.dtype_override] / t.element_size()
        return nbytes

    def _time(self, flops: float, nbytes: float, dtype: torch.dtype | None) -> float:
        device = self.device
        if device is None:
            return 0.0
        floating = dtype is not None and dtype.is_floating_point
        key = (self.dtype_override if floating else None) or _DTYPE_KEYS.get(dtype, "fp32")  # type: ignore[arg-type]
        compute = flops / device.flops_per_s(key) if flops else 0.0
        memory = nbytes / (device.memory_bandwidth * device.memory_efficiency)
        return max(compute, memory) + device.op_overhead_s


@contextlib.contextmanager
def _reentered(mode: TorchDispatchMode) -> Iterator[None]:
    TorchDispatchMode.__enter__(mode)
    try:
        yield
    finally:
        TorchDispatchMode.__exit__(mode, None, None, None)


_SDPA_OPS = frozenset({aten.scaled_dot_product_attention.default})


class _FusedAttentionOnMeta(TorchFunctionMode):
    """Send meta-tensor ``F.scaled_dot_product_attention`` to the fused CPU kernel."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # F.scaled_dot_product_attention in eager code; the aten op in a captured graph.
        if func is F.scaled_dot_product_attention or func in _SDPA_OPS:
            fused = _fused_attention(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


def _fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor | None:
    qkv = (query, key, value)
    eligible = (
        hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu")
        and all(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in qkv)
        and all(t.dim() == 4 and t.dtype in _DTYPE_KEYS for t in qkv)
        and attn_mask is None
        and dropout_p == 0.0
        and not enable_gqa
        and query.shape[1] == key.shape[1] == value.shape[1]
    )
    if not eligible:
        return None
    out = aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=None, scale=scale
    )
    return out[0]


def measure_cost(fn: Callable[[], Any], device: Device | None = None) -> OpCost:
    """The total cost of the aten ops ``fn()`` runs.

    Example::

        >>> a = torch.randn(128, 128, device="meta")
        >>> measure_cost(lambda: a @ a).flops == 2 * 128**3
        True

    Args:
        fn: the work to cost; its result is discarded.
        device: the device to price time on; None for FLOPs and bytes only.
    """
    with OpCostMode(device) as mode:
        fn()
    return mode.total
