"""How fast the local CPU is: measured once per CPU model and thread count, kept in the
planner's cache so that runs agree, and a drift since then said.

[Note: a transient slow spell] A shared host has spells, seconds long, in which the same
loop of 1-element adds takes twice as long (2.37-2.41 µs per op against 1.13-1.17 a
minute before and after, 2026-12-07, at one thread; a core just woken from idle reads
1.3-1.9 for its first milliseconds). One reading taken in such a spell used to be
cached for good, and priced every later run of that thread count (ResNet's in the
calibration benchmark of 2026-12-07), or made the drift check warn of a machine that
had not moved. So the time per op is the fastest of its runs (the copies' bandwidth
their median), a fresh measurement keeps the best of two readings apart, and a drift
is said only when two more readings agree.
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

__all__ = [
    "DRIFT",
    "CpuSpeed",
    "forget",
    "known",
    "largest_cache",
    "measured",
    "op_time_s",
    "quick_speed",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuSpeed:
    """The local CPU's measured figures at one thread count (see :func:`measured`)."""

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


def _time(
    fn: Callable[[], object], repeats: int, pick: Callable[[list[float]], float] = statistics.median
) -> float:
    """Seconds ``fn`` takes: the median (or ``pick``) of ``repeats`` runs after a warm-up."""
    fn()  # warm-up: first-touch page faults, kernel selection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return pick(times)


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


def forget() -> None:
    """Drop this process's figures: the next :func:`measured` reads the cache (or measures)."""
    measured.cache_clear()
    _SEEN.clear()


_SEEN: dict[int, CpuSpeed] = {}


def known(threads: int) -> CpuSpeed | None:
    """The figures :func:`measured` gave this process at ``threads``, if it was asked (nothing
    is measured or read here)."""
    return _SEEN.get(threads)


@functools.cache
def measured(threads: int) -> CpuSpeed:
    """The local CPU's figures at ``threads`` torch threads (the caller has set them),
    measured once per CPU model and thread count.

    Kept in the planner's cache (``planner.cache``) so that separate runs price the
    same profile with the same device and write the same plan; delete the cache
    directory to measure again.
    """
    from planner import cache

    # 3: the time per op is the fastest of its runs (2: their median; read again, not kept)
    k = cache.key("local-cpu-speed", 3, _cpu_model(), os.cpu_count(), threads)
    hit = cache.load(k)
    if hit is not None:
        try:
            kept = CpuSpeed(
                peak_flops={str(d): float(v) for d, v in hit["peak_flops"].items()},
                memory_bandwidth=float(hit["memory_bandwidth"]),
                op_overhead_s=float(hit["op_overhead_s"]),
                cache_bandwidth=float(hit["cache_bandwidth"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            log.warning("ignoring a malformed local-CPU entry in the profile cache")
        else:
            _say_drift(kept, threads, cache.entry_path(k))
            _SEEN[threads] = kept
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
    _SEEN[threads] = speed
    return speed


def _run_cpu_benchmarks() -> CpuSpeed:
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    torch_dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    peak: dict[str, float] = {}
    # Explicit device and no active modes: this may first run inside a meta-device
    # context or under an OpCostMode, and must time real CPU work all the same.
    gen = torch.Generator().manual_seed(0)  # the caller's random state stays as it was
    with _disable_current_modes(), torch.no_grad():
        first = _copy_and_add(5)  # and again after the matmuls: [Note: a transient slow spell]
        for name, dt in torch_dtypes.items():
            n = 256
            a = torch.randn(n, n, generator=gen, device="cpu").to(dt)
            t = _time(functools.partial(torch.mm, a, a), 1)
            # Grow the matrix so one matmul takes ~10 ms (small ones miss the
            # peak); some CPUs run fp16 matmuls ~100x slower than fp32.
            n = int(min(2048, max(256, n * (0.01 / max(t, 1e-9)) ** (1 / 3))) // 128 * 128)
            a = torch.randn(n, n, generator=gen, device="cpu").to(dt)
            peak[name] = 2 * n**3 / _time(functools.partial(torch.mm, a, a), 3)
        peak["tf32"] = peak["fp32"]  # no TF32 on a CPU

        bandwidth, overhead = _best([first, _copy_and_add(5)])
        in_cache = _cache_bandwidth(largest_cache())
    return CpuSpeed(
        peak_flops=peak,
        memory_bandwidth=bandwidth,
        op_overhead_s=overhead,
        cache_bandwidth=in_cache,
    )


def _copy_and_add(repeats: int) -> tuple[float, float]:
    """Memory bandwidth (a 64 MiB copy, bytes read + written per second: the median of
    ``repeats``) and the per-op overhead (1-element adds, seconds each: the fastest of
    ``repeats`` + 2 runs of 1000, [Note: a transient slow spell])."""
    bandwidth = _copy_bandwidth(16 * 2**20, 1, repeats)  # 64 MiB: from memory
    return bandwidth, op_time_s(1000, repeats + 2)


def op_time_s(loops: int, runs: int) -> float:
    """Seconds per 1-element add on the CPU: the fastest of ``runs`` runs of ``loops`` adds
    (after one more, a warm-up)."""
    import torch

    one = torch.ones(1, device="cpu")

    def adds() -> None:
        for _ in range(loops):
            torch.add(one, one)

    return _time(adds, runs, min) / loops


def _best(readings: list[tuple[float, float]]) -> tuple[float, float]:
    """The fastest of (bandwidth, time per op) readings: the highest bandwidth, the least time."""
    return max(r[0] for r in readings), min(r[1] for r in readings)


DRIFT = 1.5
"""How many times faster or slower than its cached figures this machine may measure
before a run says so (:func:`_say_drift`, after two more readings). Repeated
measurements of one machine spread about 25 % (memory bandwidth 23-29 GB/s at 1
thread); on another day the same shared host measured 11.8-12.7 GB/s at 1 thread, and
2.0-2.3 µs per op at 2 threads against 1.13-1.18: about twice as slow."""


def quick_speed() -> tuple[float, float]:
    """:func:`_copy_and_add` of 3 repeats, outside any mode (about 80 ms)."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        return _copy_and_add(3)


def _say_drift(kept: CpuSpeed, threads: int, path: Path) -> None:
    """Warn when the machine's speed now (:func:`quick_speed`) is ``DRIFT`` times off the
    cached figures, in three readings: what is priced with them may be off too."""
    now = quick_speed()
    if _moved(kept, *now):  # two more readings, the fastest: [Note: a transient slow spell]
        now = _best([now, quick_speed(), quick_speed()])
    moved = _moved(kept, *now)
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


def _moved(kept: CpuSpeed, bandwidth: float, overhead: float) -> list[str]:
    """The figures ``DRIFT`` times off the cached ones, each with both values and the ratio."""
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
    return moved


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

    return float(2 * src.nbytes * reps / _time(copies, repeats))
