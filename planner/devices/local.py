"""The local machine as catalogue devices: the CPU measured here, the CUDA GPU looked up.

:func:`get_device` finds a device by name: a catalogue GPU, or this machine's
CPU for the catalogue's ``cpu`` entry (measured, not read from the file).
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from planner.devices.catalogue import CpuEntry, Device, default_catalogue
from planner.plan.units import GIB

__all__ = [
    "forget_measurements",
    "get_device",
    "largest_cache",
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
    _measure_cpu.cache_clear()
    _local_cpu_device.cache_clear()


@functools.cache
def _local_cpu_device(entry: CpuEntry, threads: int) -> Device:
    measured = _measure_cpu(threads)
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


@dataclass(frozen=True)
class _CpuSpeed:
    peak_flops: dict[str, float]
    memory_bandwidth: float
    op_overhead_s: float
    cache_bandwidth: float


def largest_cache(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Bytes of this CPU's largest data cache (sysfs's ``index*/size`` of a Data or
    Unified cache, e.g. ``32768K``), 0 where sysfs does not say."""
    best = 0
    for index in sorted(Path(root).glob("index*")):
        try:
            if (index / "type").read_text().strip() not in ("Data", "Unified"):
                continue
            text = (index / "size").read_text().strip().upper()
            scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return best


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults, kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@functools.cache
def _measure_cpu(threads: int) -> _CpuSpeed:
    """Benchmarks for ``local_cpu``, once per CPU model and thread count.

    Kept in the planner's cache (``planner.cache``) so that separate runs price the
    same profile with the same device and write the same plan; delete the cache
    directory to measure again.
    """
    from planner import cache

    k = cache.key("local-cpu-speed", 2, _cpu_model(), os.cpu_count(), threads)
    hit = cache.load(k)
    if hit is not None:
        try:
            kept = _CpuSpeed(
                peak_flops={str(d): float(v) for d, v in hit["peak_flops"].items()},
                memory_bandwidth=float(hit["memory_bandwidth"]),
                op_overhead_s=float(hit["op_overhead_s"]),
                cache_bandwidth=float(hit["cache_bandwidth"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            log.warning("ignoring a malformed local-CPU entry in the profile cache")
        else:
            _say_drift(kept, *_quick_speed(), threads, cache.entry_path(k))
            return kept
    speed = _run_cpu_benchmarks()
    cache.store(
        k,
        {
            "peak_flops": speed.peak_flops,
            "memory_bandwidth": speed.memory_bandwidth,
            "op_overhead_s": speed.op_overhead_s,
            "cache_bandwidth": speed.cache_bandwidth,
        },
    )
    return speed


def _run_cpu_benchmarks() -> _CpuSpeed:
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    torch_dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    peak: dict[str, float] = {}
    # Explicit device and no active modes: this may first run inside a meta-device
    # context or under an OpCostMode, and must time real CPU work all the same.
    gen = torch.Generator().manual_seed(0)  # the caller's random state stays as it was
    with _disable_current_modes(), torch.no_grad():
        for name, dt in torch_dtypes.items():
            n = 256
            a = torch.randn(n, n, generator=gen, device="cpu").to(dt)
            t = _median_time(functools.partial(torch.mm, a, a), 1)
            # Grow the matrix so one matmul takes ~10 ms (small ones miss the
            # peak); some CPUs run fp16 matmuls ~100x slower than fp32.
            n = int(min(2048, max(256, n * (0.01 / max(t, 1e-9)) ** (1 / 3))) // 128 * 128)
            a = torch.randn(n, n, generator=gen, device="cpu").to(dt)
            peak[name] = 2 * n**3 / _median_time(functools.partial(torch.mm, a, a), 3)
        peak["tf32"] = peak["fp32"]  # no TF32 on a CPU

        bandwidth, overhead = _copy_and_add(5)
        in_cache = _cache_bandwidth(largest_cache())
    return _CpuSpeed(
        peak_flops=peak,
        memory_bandwidth=bandwidth,
        op_overhead_s=overhead,
        cache_bandwidth=in_cache,
    )


def _copy_and_add(repeats: int) -> tuple[float, float]:
    """Memory bandwidth (a 64 MiB copy, bytes read + written per second) and the
    per-op overhead (1-element adds, seconds each): medians of ``repeats``."""
    import torch

    bandwidth = _copy_bandwidth(16 * 2**20, 1, repeats)  # 64 MiB: from memory
    one = torch.ones(1, device="cpu")
    loops = 1000

    def adds() -> None:
        for _ in range(loops):
            torch.add(one, one)

    return bandwidth, _median_time(adds, 3) / loops


DRIFT = 1.5
"""How many times faster or slower than its cached figures this machine may measure
before a run says so (:func:`_say_drift`). Repeated measurements of one machine spread
about 25 % (memory bandwidth 23-29 GB/s at 1 thread); on another day the same shared
host measured 11.8-12.7 GB/s at 1 thread, and 2.0-2.3 µs per op at 2 threads against
1.13-1.18: about twice as slow."""


def _quick_speed() -> tuple[float, float]:
    """:func:`_copy_and_add` of 3 repeats, outside any mode (about 80 ms)."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        return _copy_and_add(3)


def _say_drift(
    kept: _CpuSpeed, bandwidth: float, overhead: float, threads: int, path: Path
) -> None:
    """Warn when the machine's speed now (``bandwidth``, ``overhead``) is ``DRIFT`` times
    off the cached figures: what is priced with them may be off too."""
    moved = []
    for what, now, then, scale, unit in (
        ("memory bandwidth", bandwidth, kept.memory_bandwidth, 1e-9, "GB/s"),
        ("time per op", overhead, kept.op_overhead_s, 1e6, "µs"),
    ):
        if not 1 / DRIFT <= now / then <= DRIFT:
            moved.append(
                f"{what} {now * scale:.2f} {unit} now, {then * scale:.2f} {unit} cached "
                f"({now / then:.2f}×)"
            )
    if not moved:
        return
    try:
        when = time.strftime(" on %Y-%m-%d", time.localtime(path.stat().st_mtime))
    except OSError:
        when = ""
    log.warning(
        "this machine's CPU (%d thread%s) no longer runs at the speed the planner measured%s: "
        "%s.\n"
        "  why: the planner keeps these figures (measured once per CPU model and thread "
        "count) in its cache so that runs agree, and prices with them what a profile does not "
        "time: the optimizer step, transfers between processes, per-op costs; profiles cached "
        "on the same day were timed at that speed too. Those predictions may be off by about "
        "as much (a noisy host can also mislead one measurement).\n"
        "  fix: delete %s to measure again (a shared or throttled host moves; measure when "
        "it is quiet), or correct the predictions with `planner calibrate`",
        threads,
        "" if threads == 1 else "s",
        when,
        "; ".join(moved),
        path,
    )


def _cache_bandwidth(cache_bytes: int) -> float:
    """Copy bandwidth (read + written) on a buffer that stays in a cache of
    ``cache_bytes``: 2 MiB, at most an eighth of it; 0 when the cache is unknown."""
    if cache_bytes <= 0:
        return 0.0
    return _copy_bandwidth(max(1024, min(2**21, cache_bytes // 8) // 4), 32, 5)


def _copy_bandwidth(elements: int, reps: int, repeats: int) -> float:
    """Bytes read + written per second copying ``elements`` fp32 values ``reps`` times in a
    row (the median of ``repeats`` such runs)."""
    import torch

    src = torch.ones(elements, device="cpu")
    dst = torch.empty_like(src)

    def copies() -> None:
        for _ in range(reps):
            dst.copy_(src)

    return float(2 * src.nbytes * reps / _median_time(copies, repeats))


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
