"""Peak memory of a rank over the counted steps: CUDA's allocator statistics, or on the CPU
the peak of live tensor bytes, by tracked allocations ([Note: tracking live tensor bytes]
in ``runtime.measure.live``)."""

from __future__ import annotations

import collections
import contextlib
import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves

from runtime.measure.live import LiveTensors, live_tensors

if TYPE_CHECKING:
    from runtime.engine import ParallelModel

__all__ = [
    "CPU_METHOD",
    "CUDA_METHOD",
    "MemoryProbe",
    "ddp_bucket_bytes",
    "ddp_bucket_sizes",
    "resident_bytes",
    "stage_state_bytes",
]

CUDA_METHOD = "cuda max allocated"
CPU_METHOD = "cpu: peak live tensor bytes (tracked allocations)"


class MemoryProbe:
    """Peak memory of this rank over the counted steps.

    Example (what ``Recorder`` does)::

        probe = MemoryProbe(device)
        probe.start([st.wrapped for st in pmodel.stages])  # before the first step
        with probe.step(args):                 # every step (CPU: tracked)
            pmodel.step(*args)
        probe.count_from_here()                # before the first counted step
        ...
        peak, how = probe.peak()

    On CUDA, ``torch.cuda.max_memory_allocated`` since :meth:`start` (one reset:
    it counts everything the allocator holds for tensors). On the CPU, a
    :class:`~runtime.measure.live.LiveTensors` over every step: what the steps
    allocate, what existed before them (every tensor the garbage collector
    sees at :meth:`start` and :meth:`count_from_here`) and DDP's gradient buckets (C++ only:
    their bytes from DDP, :func:`ddp_bucket_bytes`).

    A bucket's views can be seen by the garbage collector too: a tensor C++ holds
    keeps the Python object it was once handed out as (examples: every parameter's
    view into the rebuilt bucket, on a ViT from timm at dp 2). Such views are not
    counted again: the bucket is in the held bytes already (counted twice, the
    ViT's 1 × 2 peak measured 32.8 MiB, 5.25 MiB over the 27.6 the profiler's
    allocation stream measured and the cost model predicts).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.live = None if device.type == "cuda" else LiveTensors(device)
        self._ddp: list[DistributedDataParallel] = []

    def start(self, wrapped: nn.Module | Sequence[nn.Module] | None = None) -> None:
        """Before the first recorded step: the peak starts here, from what is alive.

        ``wrapped``: the stage's module as it runs (or this rank's stages', when
        it runs several); a ``DistributedDataParallel``'s buckets count (CPU).
        """
        if self.live is None:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        mods = [wrapped] if isinstance(wrapped, nn.Module) else list(wrapped or ())
        self._ddp = [m for m in mods if isinstance(m, DistributedDataParallel)]
        if self._ddp:
            self.live.hold("DDP buckets", sum(ddp_bucket_bytes(d) for d in self._ddp))
        self.count_from_here()

    @contextlib.contextmanager
    def step(self, args: Any = ()) -> Iterator[None]:
        """Around one step: on the CPU its allocations are tracked (its ``args`` count too)."""
        if self.live is None:
            yield
            return
        self.live.add_all(tree_leaves(args))
        with self.live:
            yield

    def count_from_here(self) -> None:
        """The peak restarts now, from what is alive (CPU; CUDA's counts from :meth:`start`)."""
        if self.live is not None:
            seen = live_tensors(self.device)
            held = _bucket_storages(seen, self._ddp)
            if held:  # counted by hold() already
                seen = [t for t in seen if _address(t)[0] not in held]
            self.live.add_all(seen)
            self.live.reset_peak()

    def untracked_ddp(self, pre_forward: Callable[..., Any]) -> Callable[..., Any]:
        """DDP's ``_pre_forward``, run untracked: its one rebuild of the buckets swaps
        C++-only tensors for others, which :meth:`start` counted from DDP's sizes: read again."""
        live = self.live

        def run(*args: Any, **kwargs: Any) -> Any:
            if live is None:
                return pre_forward(*args, **kwargs)
            paused, live.paused = live.paused, True
            try:
                return pre_forward(*args, **kwargs)
            finally:
                live.paused = paused
                if self._ddp:
                    live.hold("DDP buckets", sum(ddp_bucket_bytes(d) for d in self._ddp))

        return run

    def peak(self) -> tuple[float, str]:
        """(peak bytes, how they were measured)."""
        if self.live is None:
            return float(torch.cuda.max_memory_allocated(self.device)), CUDA_METHOD
        return float(self.live.peak), CPU_METHOD


def ddp_bucket_sizes(ddp: DistributedDataParallel) -> list[int]:
    """Bytes of each of DDP's gradient buckets as they are now (the reducer's own layout:
    its logging data names the rebuilt buckets a step late); [] when torch hides them."""
    try:
        buckets = ddp.reducer._get_zeros_like_grad_buckets()  # zeros shaped like them
    except (AttributeError, RuntimeError):  # a private API: torch may move it
        return []
    return [b.buffer().numel() * b.buffer().element_size() for b in buckets]


def _bucket_storages(seen: Sequence[torch.Tensor], ddps: Sequence[Any]) -> set[int]:
    """The data addresses of DDP's buckets among the storages of ``seen`` (tensors the
    garbage collector sees), which the held bytes count already.

    A bucket is a flat tensor of a bucket's bytes (:func:`ddp_bucket_sizes`), seen
    through parameter-shaped views of it, or itself; never a parameter's or a
    gradient's storage. Storages seen through views are taken first, and no more of
    a size than DDP has buckets of it.
    """
    sizes = collections.Counter(n for d in ddps for n in ddp_bucket_sizes(d))
    if not sizes:
        return set()
    own = {
        t.untyped_storage().data_ptr()
        for d in ddps
        for p in d.parameters()
        for t in (p, p.grad)
        if t is not None
    }
    views, flats = [], []
    for t in seen:
        address, nbytes = _address(t)
        if nbytes not in sizes or address in own:
            continue
        base = t._base
        if base is not None and base.dim() == 1:
            views.append((address, nbytes))
        elif base is None and t.dim() == 1 and not isinstance(t, nn.Parameter):
            flats.append((address, nbytes))
    out: set[int] = set()
    for address, nbytes in dict.fromkeys(views + flats):  # each storage once, views first
        if address not in out and sizes[nbytes] > 0:
            sizes[nbytes] -= 1
            out.add(address)
    return out


def _address(t: torch.Tensor) -> tuple[int, int]:
    """(data address, bytes) of ``t``'s storage; (-1, 0) where it has none (a wrapper
    subclass; a fake tensor left by tracing)."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (NotImplementedError, RuntimeError):
        return -1, 0


def ddp_bucket_bytes(ddp: DistributedDataParallel) -> int:
    """Bytes of DDP's gradient buckets (the reducer's flat tensors, C++ only).

    DDP's own figures (its logging data: the buckets as rebuilt after the first
    iteration, else as first built); without them, every trainable
    parameter's bytes once, which is what its buckets hold. With
    ``gradient_as_bucket_view=True`` the gradients are views into these
    buckets and would count twice; the runtime's DDP does not set it.
    """
    try:
        data = ddp._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
    except (AttributeError, RuntimeError):  # a private API: torch may move it
        sizes = None
    if sizes:
        return sum(int(x) for x in re.findall(r"\d+", str(sizes)))
    return sum(p.numel() * p.element_size() for p in ddp.module.parameters() if p.requires_grad)


def stage_state_bytes(pmodel: ParallelModel) -> int:
    """Bytes of this rank's stages' parameters, buffers, gradients and optimizer state, each once.

    Example: ``stage_state_bytes(pmodel) / 2**20`` MiB, after a step (gradients and
    Adam's moments exist from the first one on).
    """
    tensors: list[torch.Tensor] = []
    for st in pmodel.stages:
        module = st.module
        tensors += [*module.parameters(), *module.buffers()]
        tensors += [p.grad for p in module.parameters() if p.grad is not None]
    if pmodel.optimizer is not None:
        for state in pmodel.optimizer.state.values():
            tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def resident_bytes() -> int:
    """This process's resident set size now (bytes), or -1 without ``/proc``."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return -1
