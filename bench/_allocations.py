"""Live tensor bytes over time, from the profiler's allocator events (CPU).

[Note: frees on other threads] torch's profiler records an allocation or a
free on the thread that makes it, and only on threads it profiles: a tensor
made on the main thread and freed on another (the last reference dropped by
gloo's worker thread, which held a bucket it all-reduced) leaves no free
event. Summing the events, that block would stay live to the end: a DDP
bucket's bytes (22 MiB for examples/mlp.py at dp 2) counted twice after DDP
rebuilt its buckets in some runs and not in others (−15 % and −0.2 % on the
same case). Two checks catch such blocks:

* an allocation at the address of a block still counted live proves that
  block freed before it: it is dropped then;
* a census at the start of the measured steps (:func:`census`): a block
  that neither a tensor the garbage collector sees nor one of DDP's gradient
  buckets (C++ only, matched by size) holds is dropped then.

What they drop is reported (``unrecorded_free_bytes``), not hidden. A block
freed unseen during the measured steps, its address not reused, stays
counted: its free's time is unknown. A census after the steps finds such
blocks, and their bytes are reported too (``unseen_free_in_steps_bytes``).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Census", "Series", "census", "live_at", "live_series", "profiled", "unheld_bytes"]

Event = tuple[int, int, int]
"""(time ns, address, bytes: > 0 allocated, < 0 freed)."""


@dataclass(frozen=True)
class Census:
    """What holds memory at one instant: the data addresses of the storages of every
    CPU tensor the garbage collector sees, and DDP's gradient buckets' bytes."""

    addresses: frozenset[int]
    buckets: tuple[int, ...] = ()


@dataclass(frozen=True)
class Series:
    """Live bytes after each event (``points``: (time ns, bytes)); the blocks still live at
    the end ({address: bytes}); the bytes dropped as freed unseen ([Note: frees on other
    threads])."""

    points: list[tuple[int, int]]
    live: dict[int, int]
    unrecorded: int


def census(ddps: Iterable[Any]) -> Census:
    """A :class:`Census` now; ``ddps``: this rank's ``DistributedDataParallel`` modules.

    Between two steps no tensor is saved for a backward, so what is neither seen by
    the garbage collector nor a bucket is held by nothing. The buckets' sizes:
    :func:`runtime.measure.memory.ddp_bucket_sizes` (the reducer's own).
    """
    from runtime.measure.live import live_tensors
    from runtime.measure.memory import ddp_bucket_sizes

    seen = set()
    for t in live_tensors(torch.device("cpu")):
        try:
            seen.add(t.untyped_storage().data_ptr())
        except (NotImplementedError, RuntimeError):  # wrapper subclasses
            continue
    sizes = [n for d in ddps for n in ddp_bucket_sizes(d)]
    return Census(frozenset(seen), tuple(sizes))


def live_series(events: Sequence[Event], taken: tuple[int, Census] | None = None) -> Series:
    """Live bytes after each of ``events`` (sorted by time), counting the blocks allocated
    among them only; ``taken``: a census and its time ([Note: frees on other threads]).

    Example::

        s = live_series([(1, 0xA, 100), (2, 0xB, 50), (3, 0xA, -100)])
        s.points, s.live                 # [(1, 100), (2, 150), (3, 50)], {0xB: 50}
    """
    live, unrecorded = 0, 0
    points: list[tuple[int, int]] = []
    mine: dict[int, int] = {}

    def drop(addresses: Iterable[int]) -> None:
        nonlocal live, unrecorded
        for a in addresses:
            n = mine.pop(a)
            live -= n
            unrecorded += n

    for t, address, n in events:
        if taken is not None and t > taken[0]:
            drop(_unheld(mine, taken[1]))
            points.append((taken[0], live))
            taken = None
        if n > 0:
            if address in mine:  # the block there was freed unseen before this one
                drop([address])
            mine[address] = n
        elif address in mine:
            n = -mine.pop(address)
        else:  # a block from before the events (another case's, or untracked)
            continue
        live += n
        points.append((t, live))
    if taken is not None:
        drop(_unheld(mine, taken[1]))
    return Series(points, mine, unrecorded)


def unheld_bytes(series: Series, seen: Census) -> int:
    """Bytes of the blocks ``series`` ends with that nothing holds in census ``seen``."""
    return sum(series.live[a] for a in _unheld(series.live, seen))


def _unheld(mine: dict[int, int], seen: Census) -> list[int]:
    """The blocks of ``mine`` nothing holds: no tensor the garbage collector sees, and not
    one of DDP's buckets (by size: the newest blocks of a bucket's size are taken)."""
    buckets = collections.Counter(seen.buckets)
    out = []
    for address in reversed(list(mine)):  # newest first
        if address in seen.addresses:
            continue
        n = mine[address]
        if buckets[n] > 0:
            buckets[n] -= 1
            continue
        out.append(address)
    return out


def live_at(points: Sequence[tuple[int, int]], t: int) -> int:
    """The live bytes at time ``t`` (after the last point at or before it)."""
    out = 0
    for ts, v in points:
        if ts > t:
            break
        out = v
    return out


def profiled(prof: Any, mark: str = "") -> tuple[list[Event], list[tuple[str, int, int]]]:
    """The CPU allocator events of a ``torch.profiler.profile(profile_memory=True)`` run,
    sorted, and its ``record_function`` spans whose names start with ``mark``."""
    from torch._C._profiler import _EventType

    results = prof.profiler.kineto_results
    stack = list(results.experimental_event_tree())
    events = []
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            f = e.extra_fields
            events.append((e.start_time_ns, f.ptr, f.alloc_size))
    events.sort()
    spans = [(e.name(), e.start_ns(), e.end_ns()) for e in results.events()]
    return events, [s for s in spans if s[0].startswith(mark)]
