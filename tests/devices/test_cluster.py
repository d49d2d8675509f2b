"""Tests for planner.devices.cluster and build: devices, nodes, links, from_gpus."""

from __future__ import annotations

import os
import sys

import pytest
from repo import CLUSTERS

from planner.devices import build
from planner.devices.build import from_gpus
from planner.devices.cluster import (
    DEFAULT_INTER_NODE_BANDWIDTH,
    DEFAULT_INTER_NODE_LATENCY_S,
    DEFAULT_INTRA_NODE_LATENCY_S,
    LOOPBACK_BANDWIDTH,
    LOOPBACK_LATENCY_S,
    Cluster,
    ClusterDevice,
)
from planner.devices.cluster_file import load_cluster, parse_cluster
from planner.devices.local import get_device, local_cpu

GIB = 2**30
EXAMPLES = CLUSTERS  # the cluster files among the examples


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# --- from_gpus -----------------------------------------------------------------------


def test_from_gpus_with_a_device_type_is_one_node_with_nvlink():
    c = from_gpus(4, "H100-SXM")
    assert c.n_devices == 4 and c.n_nodes == 1 and c.devices_per_node() == [4]
    assert c.device_types == ("h100",) and c.homogeneous and c.backend == "nccl"
    assert all(d.device == get_device("h100") and d.threads == 0 for d in c.devices)
    assert [(d.rank, d.node, d.local_index) for d in c.devices] == [(i, 0, i) for i in range(4)]
    assert c.intra_node_bandwidth == 450e9  # 900 GB/s bidirectional total / 2
    assert c.intra_node_latency_s == DEFAULT_INTRA_NODE_LATENCY_S
    assert c.name == "4xh100"


def test_from_gpus_lays_out_more_than_8_as_nodes_of_8():
    c = from_gpus(16, "h100")
    assert c.devices_per_node() == [8, 8] and c.n_nodes == 2
    assert [d.node for d in c.devices] == [0] * 8 + [1] * 8
    assert [d.local_index for d in c.devices] == list(range(8)) * 2
    assert c.inter_node_bandwidth == DEFAULT_INTER_NODE_BANDWIDTH == 50e9
    assert c.inter_node_latency_s == DEFAULT_INTER_NODE_LATENCY_S
    assert c.name == "2x8xh100"
    assert c.describe() == "2 nodes × 8 h100 (79.6 GiB), NVLink 450 GB/s inside, 50 GB/s between"
    # Not a multiple of 8: one node, as the docstring says.
    assert from_gpus(12, "h100").devices_per_node() == [12]
    assert from_gpus(8, "h100").devices_per_node() == [8]


def test_from_gpus_memory_override_and_pcie_only_device():
    c = from_gpus(2, "a100", memory_gib=70)
    assert all(d.device.memory_bytes == 70 * GIB for d in c.devices)
    assert c.intra_node_bandwidth == 300e9
    l4 = from_gpus(2, "l4")
    assert l4.intra_node_bandwidth == 32e9  # no NVLink: PCIe 4.0 x16, 64 GB/s total / 2
    assert "PCIe 32 GB/s inside" in l4.describe()


def test_from_gpus_without_a_device_uses_the_local_gpu(monkeypatch):
    monkeypatch.setattr(build, "local_accelerator", lambda: get_device("h200"))
    c = from_gpus(16)
    assert c.device_types == ("h200",) and c.devices_per_node() == [8, 8]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_from_gpus_without_a_gpu_splits_the_local_cpu(monkeypatch, n):
    import torch

    monkeypatch.setattr(build, "local_accelerator", lambda: None)
    threads_before = torch.get_num_threads()
    c = from_gpus(n)
    assert torch.get_num_threads() == threads_before  # measured, then restored
    threads = max(1, _cores() // n)
    ram = local_cpu().memory_bytes
    assert c.n_devices == n and c.n_nodes == 1 and c.backend == "gloo"
    assert c.device_types == ("cpu",) and c.homogeneous
    for d in c.devices:
        assert d.device.kind == "cpu" and d.threads == threads
        assert d.device.memory_bytes == ram // n
        assert f"({threads} threads)" in d.device.name
    assert c.intra_node_bandwidth == LOOPBACK_BANDWIDTH
    assert c.intra_node_latency_s == LOOPBACK_LATENCY_S
    assert c.name == f"{n}xcpu"
    assert "loopback" in c.describe() or n == 1


def test_from_gpus_cpu_by_name_and_memory_override():
    c = from_gpus(2, "cpu", memory_gib=1)
    assert c.backend == "gloo" and all(d.device.memory_bytes == GIB for d in c.devices)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0, "h100"), {}, "positive whole number"),
        ((2.5, "h100"), {}, "positive whole number"),
        ((2, "h1000"), {}, "unknown device type 'h1000'.*did you mean 'h100'"),
        ((2, "h100"), {"memory_gib": 0}, "memory_gib must be a positive"),
        ((2, "h100"), {"memory_gib": 1e300}, r"in 0\.0009765625 \.\. 1048576 \(1 MiB"),
        ((10**9, "h100"), {}, "--gpus 1,000,000,000 is more than the 131,072 devices"),
    ],
)
def test_from_gpus_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        from_gpus(*args, **kwargs)


# --- example files -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("file", "per_node", "types", "intra", "inter"),
    [
        ("8xa100.yaml", [8], ("a100-80gb",), 300e9, DEFAULT_INTER_NODE_BANDWIDTH),
        ("2x8xh100.yaml", [8, 8], ("h100",), 450e9, 50e9),
        ("mixed-a100-v100.yaml", [8], ("a100-80gb", "v100-32gb"), 16e9, 50e9),
        ("64xh100.yaml", [8] * 8, ("h100",), 450e9, 50e9),
    ],
)
def test_example_files_load(file, per_node, types, intra, inter):
    c = load_cluster(EXAMPLES / file)
    assert c.name == file.removesuffix(".yaml")
    assert c.devices_per_node() == per_node and c.device_types == types
    assert c.intra_node_bandwidth == intra and c.inter_node_bandwidth == inter
    assert c.intra_node_latency_s == 5e-6 and c.inter_node_latency_s == 10e-6
    assert c.homogeneous == (len(types) == 1)


def test_mixed_example_keeps_each_types_memory_and_order():
    c = load_cluster(EXAMPLES / "mixed-a100-v100.yaml")
    assert [d.device.key for d in c.devices] == ["a100-80gb"] * 4 + ["v100-32gb"] * 4
    assert c.devices[0].device.memory_bytes == 80 * GIB
    assert c.devices[7].device.memory_bytes == get_device("v100-32gb").memory_bytes
    assert c.describe() == (
        "1 node × [4 a100-80gb (80.0 GiB) + 4 v100-32gb (31.7 GiB)], PCIe 16 GB/s inside"
    )


def test_mixed_node_defaults_to_the_slower_pcie_and_nodes_to_the_slowest():
    mixed = parse_cluster({"nodes": [{"devices": [{"type": "a100"}, {"type": "v100"}]}]})
    assert mixed.intra_node_bandwidth == 16e9  # the V100's 32 GB/s total / 2
    assert mixed.name == "mixed-2"
    two = parse_cluster({"nodes": [{"type": "h100", "count": 2}, {"type": "v100", "count": 2}]})
    assert two.intra_node_bandwidth == 150e9  # V100 NVLink 300 / 2 < H100's 450
    assert two.describe().startswith("2 nodes: 2 h100 (79.6 GiB) | 2 v100-32gb (31.7 GiB)")


# --- links ---------------------------------------------------------------------------


@pytest.fixture
def two_nodes() -> Cluster:
    return parse_cluster(
        {
            "nodes": [{"type": "h100", "count": 4, "repeat": 2}],
            "links": {
                "intra_node_gbs": 400,
                "inter_node_gbs": 25,
                "intra_node_latency_us": 2,
                "inter_node_latency_us": 20,
            },
        }
    )


def test_bandwidth_and_latency_inside_and_between_nodes(two_nodes):
    c = two_nodes
    assert c.bandwidth(0, 3) == c.bandwidth(3, 0) == 400e9
    assert c.bandwidth(3, 4) == c.bandwidth(0, 7) == 25e9
    assert c.latency(1, 2) == pytest.approx(2e-6) and c.latency(2, 5) == pytest.approx(20e-6)
    assert c.bandwidth(5, 5) == float("inf") and c.latency(5, 5) == 0.0
    with pytest.raises(ValueError, match=r"rank 8 is not in cluster.*ranks 0\.\.7"):
        c.bandwidth(0, 8)


def test_p2p_time(two_nodes):
    c = two_nodes
    assert c.p2p_time(0, 1, 4e9) == pytest.approx(2e-6 + 4e9 / 400e9)
    assert c.p2p_time(0, 4, 4e9) == pytest.approx(20e-6 + 4e9 / 25e9)
    assert c.p2p_time(2, 2, 4e9) == 0.0
    assert c.p2p_time(0, 1, 0) == pytest.approx(2e-6)
    with pytest.raises(ValueError, match="nbytes"):
        c.p2p_time(0, 1, -1)


def test_allreduce_time_is_the_ring_formula(two_nodes):
    c, size = two_nodes, 1e9

    def ring(n, bw, lat):
        return 2 * (n - 1) / n * size / bw + 2 * (n - 1) * lat

    assert c.allreduce_time([0, 1, 2, 3], size) == pytest.approx(ring(4, 400e9, 2e-6))
    # Across nodes the ring's slowest link is the inter-node one.
    assert c.allreduce_time(range(8), size) == pytest.approx(ring(8, 25e9, 20e-6))
    assert c.allreduce_time([4, 0], size) == pytest.approx(ring(2, 25e9, 20e-6))
    assert c.allreduce_time([6], size) == 0.0
    with pytest.raises(ValueError, match="distinct"):
        c.allreduce_time([1, 1], size)
    with pytest.raises(ValueError, match="distinct"):
        c.allreduce_time([], size)
    with pytest.raises(ValueError, match="rank 9"):
        c.allreduce_time([0, 9], size)


# --- the Cluster constructor -------------------------------------------------------


def test_constructor_checks_layout_and_backend():
    h100 = get_device("h100")
    links = dict(
        intra_node_bandwidth=1e9,
        inter_node_bandwidth=1e9,
        intra_node_latency_s=0.0,
        inter_node_latency_s=0.0,
    )
    ok = [
        ClusterDevice(rank=0, node=0, local_index=0, device=h100),
        ClusterDevice(rank=1, node=1, local_index=0, device=h100),
    ]
    assert Cluster(name="x", devices=tuple(ok), backend="nccl", **links).n_nodes == 2
    with pytest.raises(ValueError, match="no devices"):
        Cluster(name="x", devices=(), backend="nccl", **links)
    bad = [ok[0], ClusterDevice(rank=1, node=0, local_index=0, device=h100)]
    with pytest.raises(ValueError, match="rank order"):
        Cluster(name="x", devices=tuple(bad), backend="nccl", **links)
    with pytest.raises(ValueError, match="use 'nccl'"):
        Cluster(name="x", devices=tuple(ok), backend="gloo", **links)
    for field, value, match in [
        (
            "intra_node_bandwidth",
            0,
            r"intra_node_bandwidth is 0 bytes/s, outside 1e\+06 \.\. 1e\+14",
        ),
        ("inter_node_bandwidth", 1e300, r"inter_node_bandwidth is 1e\+300 bytes/s, outside"),
        ("inter_node_bandwidth", float("nan"), r"inter_node_bandwidth is nan bytes/s"),
        (
            "intra_node_latency_s",
            -1e-6,
            r"intra_node_latency_s is -1e-06 seconds, outside 0 \.\. 10",
        ),
        ("inter_node_latency_s", 1e300, r"inter_node_latency_s is 1e\+300 seconds"),
    ]:
        with pytest.raises(ValueError, match=match):
            Cluster(name="x", devices=tuple(ok), backend="nccl", **{**links, field: value})
    with pytest.raises(ValueError, match="0 for a GPU"):
        ClusterDevice(rank=0, node=0, local_index=0, device=h100, threads=2)


# --- scale: linear in the devices ----------------------------------------------------


class _Budget:
    """Counts the function calls (Python and builtin) made inside it; fails past ``limit``.

    A count, not a time, so that a loaded machine does not make it flaky: a path
    quadratic in the devices makes ~n² calls, 4·10⁸ at n = 20,000, and trips any
    linear budget at once.
    """

    def __init__(self, limit: int) -> None:
        self.limit, self.calls = limit, 0

    def _count(self, frame, event, arg):  # sys.setprofile's signature
        if event in ("call", "c_call"):
            self.calls += 1
            if self.calls > self.limit:
                sys.setprofile(None)
                raise AssertionError(f"over {self.limit:,} calls: not linear in the devices")

    def __enter__(self) -> _Budget:
        sys.setprofile(self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


@pytest.mark.parametrize(("nodes", "per_node"), [(20_000, 1), (2_500, 8)])
def test_a_cluster_of_20000_devices_is_handled_in_linear_work(nodes, per_node):
    n = nodes * per_node
    data = {"nodes": [{"type": "h100", "count": per_node, "repeat": nodes}]}
    with _Budget(40 * n) as parsing:  # ~13 calls a device
        c = parse_cluster(data)
    # Everything a plan and its report ask of the cluster, asked many times over.
    with _Budget(40 * n):  # ~25 calls a device, the first time only
        for _ in range(100):
            summary = c.describe()
            record = c.to_record()
            assert c.homogeneous and c.devices_per_node() == [per_node] * nodes
            assert c.device_types == ("h100",) and c.n_nodes == nodes
        assert c.allreduce_time(range(n), 1e9) > 0 and c.p2p_time(0, n - 1, 1e6) > 0
        assert [record.device(r).type for r in range(0, n, 97)] == ["h100"] * len(range(0, n, 97))
    assert summary.startswith(f"{nodes} nodes × {per_node} h100 (79.6 GiB)")
    assert [n.repeat for n in record.nodes] == [nodes]  # equal nodes: one record
    assert parsing.calls > n  # the budget counted the work


def test_allreduce_across_many_nodes_is_the_ring_formula():
    c = parse_cluster({"nodes": [{"type": "h100", "count": 4, "repeat": 2500}]})
    n, size = 10_000, 1e9
    ring = 2 * (n - 1) / n * size / 50e9 + 2 * (n - 1) * DEFAULT_INTER_NODE_LATENCY_S
    c.bandwidth(0, 1)  # the node of each rank: a table made once, on first use
    with _Budget(1_000):  # a few calls each, whatever the ranks: no work per hop in Python
        assert c.allreduce_time(range(n), size) == pytest.approx(ring)
        # One replica per node: every hop crosses nodes; four on one node: none does.
        assert c.allreduce_time(range(0, n, 4), 0) == 2 * (n // 4 - 1) * 10e-6
        assert c.allreduce_time([8, 9, 10, 11], 0) == 2 * 3 * DEFAULT_INTRA_NODE_LATENCY_S
