"""Peak memory of a rank's stage: CUDA's allocator statistics, or on the CPU the stage's
tensors plus the growth of the process's peak resident set (see ``recorder``'s docstring)."""

from __future__ import annotations

import os
import resource
import sys
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runtime.engine import ParallelModel

__all__ = ["MemoryProbe", "resident_bytes", "stage_state_bytes"]


def stage_state_bytes(pmodel: ParallelModel) -> int:
    """Bytes of the stage's parameters, buffers, gradients and optimizer state, each once."""
    module = pmodel.stage.module
    tensors: list[torch.Tensor] = [*module.parameters(), *module.buffers()]
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


class MemoryProbe:
    """Peak memory of this rank's stage over the counted steps (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.state = 0
        self.base = 0
        self.reset = False

    def start(self, state_bytes: int, *, cuda: bool = True) -> None:
        """(Re)start: from here, the peak is ``state_bytes`` + the resident set's growth."""
        if self.device.type == "cuda":
            if cuda:  # max_memory_allocated counts everything: one reset, at the start
                torch.cuda.reset_peak_memory_stats(self.device)
            return
        self.state = state_bytes
        try:  # "5" resets the peak resident set size (VmHWM and ru_maxrss), Linux ≥ 4.0
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset = True
        except OSError:
            self.reset = False
        self.base = _rss_now() if self.reset else _rss_peak()

    def peak(self) -> tuple[float, str]:
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device)), "cuda max allocated"
        grown = max(0, _rss_peak() - self.base)
        how = "cpu: stage tensors + peak RSS growth"
        return float(self.state + grown), how + ("" if self.reset else " (lower bound)")


def _rss_peak() -> int:
    kib_or_b = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kib_or_b if sys.platform == "darwin" else kib_or_b * 1024)


def resident_bytes() -> int:
    """This process's resident set size now (bytes), or -1 without ``/proc``."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return -1


def _rss_now() -> int:
    now = resident_bytes()
    return now if now >= 0 else _rss_peak()
