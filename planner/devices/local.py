"""The local machine as catalogue devices: the CPU measured here, the CUDA GPU looked up.

:func:`get_device` finds a device by name: a catalogue GPU, or this machine's
CPU for the catalogue's ``cpu`` entry (measured, not read from the file).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from planner.devices import cpu_speed
from planner.devices.catalogue import CpuEntry, Device, default_catalogue
from planner.devices.cpu_speed import largest_cache
from planner.plan.units import GIB

__all__ = [
    "forget_measurements",
    "get_device",
    "local_accelerator",
    "local_cpu",
    "usable_cores",
]

log = logging.getLogger(__name__)


def get_device(name: str) -> Device:
    """The device called ``name``: a catalogue key or alias (any case), or the local CPU.

    Example::

        >>> get_device("A100").key   # `a100` means the 80 GB part
        'a100-80gb'
        >>> get_device("cpu").kind   # measured on first use
        'cpu'

    Raises:
        ValueError: unknown name; the message lists the known ones.
    """
    cat = default_catalogue()
    return local_cpu() if cat.is_cpu(name) else cat.gpu(name)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, else ``os.cpu_count()``)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def local_cpu() -> Device:
    """The local CPU, its speed measured here (in well under a second, once).

    Peak FLOP/s per dtype come from a square matmul sized to take ~10 ms,
    memory bandwidth from a 64 MiB copy (bytes read + written per second), the
    cache's from copies of 2 MiB (at most an eighth of the largest cache, which
    sysfs names), the per-op overhead from a loop of 1-element adds, memory from
    the RAM (or the cgroup limit, when lower). Efficiencies are 1.0: the
    measurements already are achieved speeds. Cached per
    ``torch.get_num_threads()``, in the process and in the profile cache (one
    measurement per CPU model and thread count).

    Example::

        >>> cpu = local_cpu()
        >>> cpu.kind, cpu.compute_efficiency, cpu.flops_per_s("fp32") > 0
        ('cpu', 1.0, True)
    """
    entry = default_catalogue().cpu
    if entry is None:
        entry = CpuEntry(key="cpu", name="the local CPU", source="measured")
    return _local_cpu_device(entry, _torch_threads())


def forget_measurements() -> None:
    """Drop this process's measurements of the CPU: the next :func:`local_cpu` reads the
    planner's cache, or measures again when that has none (as a new process would)."""
    cpu_speed.forget()
    _local_cpu_device.cache_clear()


@functools.cache
def _local_cpu_device(entry: CpuEntry, threads: int) -> Device:
    measured = cpu_speed.measured(threads)
    log.info(
        "measured the local CPU (%d threads): %s, %.1f GB/s, in cache %.1f GB/s, %.1f us/op",
        threads,
        ", ".join(f"{d} {v / 1e9:.1f} GFLOP/s" for d, v in measured.peak_flops.items()),
        measured.memory_bandwidth / 1e9,
        measured.cache_bandwidth / 1e9,
        measured.op_overhead_s * 1e6,
    )
    return Device(
        key=entry.key,
        name=f"{entry.name} ({threads} threads)",
        kind="cpu",
        memory_bytes=_total_ram(),
        peak_flops=measured.peak_flops,
        memory_bandwidth=measured.memory_bandwidth,
        nvlink_bandwidth=0.0,
        pcie_bandwidth=measured.memory_bandwidth,
        compute_efficiency=1.0,
        memory_efficiency=1.0,
        op_overhead_s=measured.op_overhead_s,
        source=entry.source,
        cache_bytes=largest_cache() if measured.cache_bandwidth else 0,
        cache_bandwidth=measured.cache_bandwidth,
    )


def _total_ram() -> int:
    """RAM of this machine, or its cgroup's memory limit when that is lower."""
    total = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    if total <= 0:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (OSError, ValueError, AttributeError):
            total = 0
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = int(Path(limit_file).read_text().strip())  # "max" -> ValueError
        except (OSError, ValueError):
            continue
        if 0 < limit < (total or limit + 1):
            total = limit
    if total <= 0:
        total = 8 * GIB
        log.warning("could not read this machine's RAM size; assuming 8 GiB")
    return total


def local_accelerator() -> Device | None:
    """The local CUDA GPU as a catalogue device, with the driver's memory size.

    Matched by ``torch.cuda.get_device_name(0)`` against the entries'
    ``cuda_names`` (e.g. ``"NVIDIA H100 80GB HBM3"`` is ``h100``).

    Example::

        >>> dev = local_accelerator()
        >>> dev is None or dev.kind == "gpu"
        True

    Returns:
        The device, or None when CUDA is not available.

    Raises:
        ValueError: the GPU is not in the catalogue; the message names it and
            says how to add it.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    cuda_name = torch.cuda.get_device_name(0)
    cat = default_catalogue()
    key = cat.cuda_names.get(cuda_name.strip().lower())
    if key is None:
        raise ValueError(
            f"the local GPU {cuda_name!r} is not in the device catalogue "
            f"(known: {', '.join(cat.names())}); add an entry with "
            f"cuda_names: [{cuda_name}] to {cat.path}, or name a catalogue device "
            f"explicitly"
        )
    memory = torch.cuda.get_device_properties(0).total_memory
    return cat.gpus[key].with_memory(memory)
