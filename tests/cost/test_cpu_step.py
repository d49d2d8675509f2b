"""[Note: the CPU optimizer step]: tensors that fit the process's share of the cache come
from memory once and step at the cache's bandwidth; larger ones stream every op from
memory; the process's threads do not divide either (the bandwidths are measured at them).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from models import block_cost, cpu_cluster, model_profile, usable_cores

from planner.cost import CostModel, Layout
from planner.devices import Cluster
from planner.devices.cpu_speed import largest_cache
from planner.options import Training
from planner.plan.records import ModelProfile

MB = 2**20
CACHE = 32 * MB
MEMORY_BW, CACHE_BW, OP_S = 20e9, 100e9, 1e-6


def _profile(tensors: list[tuple[int, ...]]) -> ModelProfile:
    """One block per entry, holding parameter tensors of these fp32 byte sizes."""
    blocks = [
        block_cost(k, param_bytes=sum(sizes), param_tensors=sizes)
        for k, sizes in enumerate(tensors)
    ]
    return model_profile(blocks, input_bytes=MB, loss_fwd_ms=0.5, loss_bwd_ms=0.25)


def _cluster(n: int, threads: int, cache: int = CACHE) -> Cluster:
    base = cpu_cluster(n, threads)
    cpu = dataclasses.replace(
        base.devices[0].device, cache_bytes=cache, cache_bandwidth=CACHE_BW if cache else 0.0
    )
    devices = tuple(dataclasses.replace(d, device=cpu) for d in base.devices)
    return dataclasses.replace(base, devices=devices)


def _model(prof: ModelProfile, pp: int = 1, threads: int = 1, cache: int = CACHE) -> CostModel:
    layout = Layout(
        pp=pp, dp=1, micro_batches=1, schedule="gpipe", ranks=tuple((s,) for s in range(pp))
    )
    with usable_cores(pp * threads):
        return CostModel(
            {"cpu": prof}, _cluster(pp, threads, cache), Training(global_batch=4), layout
        )


def _cached_s(params: float) -> float:
    return params * (28 / MEMORY_BW + 72 / CACHE_BW)


def _streamed_s(params: float) -> float:
    return params * 72 / MEMORY_BW


def test_small_tensors_come_from_memory_once_and_large_ones_stream_every_op() -> None:
    # Adam's working set is 20 B per fp32 parameter: a 32 MiB cache holds a tensor
    # of up to 1.6 Mi parameters (6.4 MiB of weights). Blocks: four 1 MiB tensors,
    # one 16 MiB tensor (4 Mi parameters).
    cm = _model(_profile([(MB,) * 4, (16 * MB,)]))
    small, big = 4 * MB / 4, 16 * MB / 4
    ops = 2 * 2 * 19 * OP_S  # [Note]: two tensors per module call, 19 ops each
    want = _cached_s(small) + _streamed_s(big) + ops
    assert cm.time.optimizer_ms(0, 0, 2) == pytest.approx(want * 1e3)
    assert cm.time.optimizer_ms(0, 0, 1) == pytest.approx((_cached_s(small) + ops / 2) * 1e3)


def test_threads_do_not_divide_the_traffic() -> None:
    prof = _profile([(16 * MB,)])
    one, two = _model(prof, threads=1), _model(prof, threads=2)
    assert one.time.optimizer_ms(0, 0, 1) == pytest.approx(two.time.optimizer_ms(0, 0, 1))


def test_processes_on_a_node_share_its_cache() -> None:
    # 4 MiB tensors (1 Mi parameters, 20 MiB of working set): within the cache of a
    # process alone, beyond its half when two processes share it.
    prof = _profile([(4 * MB,), (4 * MB,)])
    alone = _model(prof, pp=1)
    assert alone.time.optimizer_ms(0, 0, 1) == pytest.approx((_cached_s(MB) + 2 * 19 * OP_S) * 1e3)
    shared = _model(prof, pp=2)
    scale = shared.time.compute_scale
    want = (_streamed_s(MB) + 2 * 19 * OP_S) * scale
    assert shared.time.optimizer_ms(0, 0, 1) == pytest.approx(want * 1e3)


def test_an_unknown_cache_streams_everything() -> None:
    cm = _model(_profile([(MB,) * 4]), cache=0)
    want = _streamed_s(MB) + 2 * 19 * OP_S
    assert cm.time.optimizer_ms(0, 0, 1) == pytest.approx(want * 1e3)


def test_the_largest_cache_is_read_from_sysfs(tmp_path: Path) -> None:
    for k, (kind, size) in enumerate(
        [("Data", "48K"), ("Instruction", "64M"), ("Unified", "1024K"), ("Unified", "32768K")]
    ):
        d = tmp_path / f"index{k}"
        d.mkdir()
        (d / "type").write_text(kind + "\n")
        (d / "size").write_text(size + "\n")
    assert largest_cache(str(tmp_path)) == 32 * MB  # an instruction cache does not count
    assert largest_cache(str(tmp_path / "absent")) == 0
