"""Assembling a Cluster: the device a type names, numbering, default links and names."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

from planner.catalogue import Catalogue, Device, load_catalogue
from planner.cluster import (
    DEFAULT_INTER_NODE_BANDWIDTH,
    DEFAULT_INTER_NODE_LATENCY_S,
    DEFAULT_INTRA_NODE_LATENCY_S,
    LOOPBACK_BANDWIDTH,
    LOOPBACK_LATENCY_S,
    Cluster,
    ClusterDevice,
)
from planner.localdevice import local_cpu

_Node = list[tuple[Device, int]]  # (device, threads) per device of one node


def _assemble(name: str | None, nodes: list[_Node], links: Mapping[str, float]) -> Cluster:
    """Number the devices and fill in the default links not given in ``links``."""
    cpu = nodes[0][0][0].kind == "cpu"
    if cpu:
        # Processes on one machine. Between CPU nodes a cluster file must give
        # the network speed (the parser checks), so only latency defaults there.
        assert len(nodes) == 1 or "inter_node_bandwidth" in links
        defaults = {
            "intra_node_bandwidth": LOOPBACK_BANDWIDTH,
            "inter_node_bandwidth": LOOPBACK_BANDWIDTH,
            "intra_node_latency_s": LOOPBACK_LATENCY_S,
            "inter_node_latency_s": LOOPBACK_LATENCY_S,
        }
    else:
        defaults = {
            "intra_node_bandwidth": min(_intra_default([d for d, _ in node]) for node in nodes),
            "inter_node_bandwidth": DEFAULT_INTER_NODE_BANDWIDTH,
            "intra_node_latency_s": DEFAULT_INTRA_NODE_LATENCY_S,
            "inter_node_latency_s": DEFAULT_INTER_NODE_LATENCY_S,
        }
    values = {**defaults, **links}
    devices = [
        ClusterDevice(rank=rank, node=i, local_index=j, device=dev, threads=threads)
        for rank, (i, j, dev, threads) in enumerate(
            (i, j, dev, t) for i, node in enumerate(nodes) for j, (dev, t) in enumerate(node)
        )
    ]
    return Cluster(
        name=name or _default_name(nodes),
        devices=tuple(devices),
        backend="gloo" if cpu else "nccl",
        **values,
    )


def _intra_default(devices: list[Device]) -> float:
    """Per-direction bytes/s between two devices of one node (datasheets quote both ways)."""
    if len({d.key for d in devices}) == 1 and devices[0].nvlink_bandwidth > 0:
        return devices[0].nvlink_bandwidth / 2
    # No NVLink, or mixed types (NVLink joins only GPUs of one kind): PCIe, as
    # fast as the slowest device's host link.
    return min(d.pcie_bandwidth for d in devices) / 2


def _default_name(nodes: list[_Node]) -> str:
    keys = {dev.key for node in nodes for dev, _ in node}
    sizes = {len(node) for node in nodes}
    if len(keys) == 1 and len(sizes) == 1:
        key, size = keys.pop(), sizes.pop()
        return f"{size}x{key}" if len(nodes) == 1 else f"{len(nodes)}x{size}x{key}"
    return f"mixed-{sum(len(node) for node in nodes)}"


@functools.cache
def _catalogue() -> Catalogue:
    return load_catalogue()


def _gpu_or_none(cat: Catalogue, name: str) -> Device | None:
    """The GPU called ``name``; None for the CPU entry (measured separately)."""
    key = cat.aliases.get(name.strip().lower())
    if key is None:
        cat.get(name)  # raises the catalogue's "unknown device type ...; known: ..."
    if cat.cpu is not None and key == cat.cpu.key:
        return None
    assert key is not None
    return cat.gpus[key]


def _usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, else ``os.cpu_count()``)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _cpu_device(threads: int) -> Device:
    """The local CPU measured with ``threads`` torch threads (what each process gets)."""
    import torch  # only the local-CPU path needs torch

    before = torch.get_num_threads()
    if threads == before:
        return local_cpu()
    torch.set_num_threads(threads)
    try:
        return local_cpu()
    finally:
        torch.set_num_threads(before)
