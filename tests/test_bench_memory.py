"""bench._allocations: live tensor bytes from the profiler's allocator events, and the frees
it does not record ([Note: frees on other threads])."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from world import run_world

from bench._allocations import Census, census, live_at, live_series, profiled, unheld_bytes

MB = 2**20


def test_the_series_counts_the_blocks_allocated_among_the_events_only() -> None:
    s = live_series([(1, 0xA, 100), (2, 0xB, 50), (3, 0xC, -70), (4, 0xA, -100)])
    assert s.points == [(1, 100), (2, 150), (4, 50)]  # 0xC was allocated before them
    assert (s.live, s.unrecorded) == ({0xB: 50}, 0)
    assert [live_at(s.points, t) for t in (0, 1, 3, 9)] == [0, 100, 150, 50]


def test_an_address_allocated_again_proves_the_block_there_freed() -> None:
    s = live_series([(1, 0xA, 100), (2, 0xA, 30), (3, 0xA, -30)])
    assert s.points == [(1, 100), (2, 30), (3, 0)]
    assert s.unrecorded == 100


def test_the_census_drops_what_nothing_holds_and_keeps_the_newest_buckets() -> None:
    events = [(1, 0xA, 22), (2, 0xB, 20), (3, 0xC, 2), (4, 0xD, 20), (9, 0xE, 5)]
    # At t = 5: 0xA (the old bucket, freed unseen) and 0xB are held by no tensor; DDP
    # holds buckets of 20 and 2 bytes: the newest 20 (0xD) and 0xC are taken for them.
    seen = Census(frozenset(), buckets=(20, 2))
    s = live_series(events, (5, seen))
    assert s.unrecorded == 22 + 20
    assert s.points[-2:] == [(5, 22), (9, 27)]
    assert set(s.live) == {0xC, 0xD, 0xE}
    held = Census(frozenset({0xA, 0xB}), buckets=(20, 2))
    assert live_series(events, (5, held)).unrecorded == 0
    # After the events: what the series ends with that nothing holds, reported.
    assert unheld_bytes(live_series(events), Census(frozenset({0xE}), buckets=(20, 2))) == 42


def test_the_profiler_misses_a_free_on_another_thread_and_the_census_drops_it() -> None:
    """The behaviour the note rests on, with torch's profiler: a 4 MiB tensor made on this
    thread and freed on another stays live in the events; a census after drops it."""
    holder: list[torch.Tensor] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        holder.append(torch.ones(MB))  # 4 MiB
        kept = torch.ones(MB // 2)  # 2 MiB, held here
        worker = threading.Thread(target=holder.clear)
        worker.start()
        worker.join()
        with record_function("test.census"):
            seen = census([])
        later = torch.ones(MB // 4)  # 1 MiB
    events, marks = profiled(prof, "test.")
    at = marks[0][1]
    assert live_series(events).points[-1][1] == 7 * MB  # the free was not recorded
    s = live_series(events, (at, seen))
    assert s.unrecorded == 4 * MB
    assert s.points[-1][1] == 3 * MB
    assert kept.untyped_storage().data_ptr() in s.live
    assert later.untyped_storage().data_ptr() in s.live


def _ddp_buckets() -> dict[str, list[int]]:
    dist.init_process_group("gloo")
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    ddp = nn.parallel.DistributedDataParallel(model)
    out = {"first": list(census([ddp]).buckets)}
    for _ in range(2):  # the second step's forward rebuilds the buckets
        ddp(torch.ones(4, 64)).sum().backward()
    out["rebuilt"] = list(census([ddp]).buckets)
    out["params"] = [sum(p.numel() * 4 for p in model.parameters())]
    dist.destroy_process_group()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_census_reads_ddp_buckets_from_the_reducer() -> None:
    for rank in run_world(_ddp_buckets, 2, timeout_s=90):
        assert sum(rank["first"]) == sum(rank["rebuilt"]) == rank["params"][0]
        assert all(n > 0 for n in rank["rebuilt"])
