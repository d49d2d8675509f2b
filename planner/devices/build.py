"""Building a Cluster: ``from_gpus``, and the assembly cluster files use too.

The device a type names, the numbering of ranks node by node, the default
links and the default name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from planner.devices.catalogue import Catalogue, Device, default_catalogue
from planner.devices.cluster import (
    DEFAULT_INTER_NODE_BANDWIDTH,
    DEFAULT_INTER_NODE_LATENCY_S,
    DEFAULT_INTRA_NODE_LATENCY_S,
    GPUS_PER_NODE,
    LOOPBACK_BANDWIDTH,
    LOOPBACK_LATENCY_S,
    MAX_DEVICES,
    MEMORY_RANGE_BYTES,
    Cluster,
    ClusterDevice,
)
from planner.devices.local import local_accelerator, local_cpu, usable_cores
from planner.plan.units import GIB

__all__ = [
    "NodeDevices",
    "assemble",
    "cpu_device",
    "default_name",
    "from_gpus",
    "gpu_or_none",
    "with_threads",
]

NodeDevices = list[tuple[Device, int]]
"""(device, threads) per device of one node."""


def from_gpus(
    n: int, device_type: str | None = None, *, memory_gib: float | None = None
) -> Cluster:
    """The cluster behind ``planner plan --gpus N [--device-type T]``.

    Example::

        >>> from_gpus(16, "h100").devices_per_node()
        [8, 8]

    - ``device_type`` given: N of that catalogue device. N > 8 and a multiple of
      8 is laid out as N/8 nodes of 8 (:data:`GPUS_PER_NODE`), joined by
      :data:`DEFAULT_INTER_NODE_BANDWIDTH`; any other N is one node. Write a
      cluster file for another layout.
    - else N of the local CUDA GPU (same layout rule), when there is one;
    - else N processes on the local CPU (``device_type="cpu"`` asks for this too),
      one node, backend gloo: each gets total RAM / N of memory and
      ``max(1, cores // N)`` torch threads, and is measured with that many.
      The processes share the machine's cores and memory bandwidth, so running
      all N at once is slower than N such machines; the loopback links are the
      calibration defaults :data:`LOOPBACK_BANDWIDTH` and
      :data:`LOOPBACK_LATENCY_S`.

    Args:
        n: number of devices, >= 1.
        device_type: a catalogue key or alias, or None for the local device.
        memory_gib: override every device's memory, GiB.

    Raises:
        ValueError: n or memory_gib is not positive, or an unknown device type.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"--gpus must be a positive whole number of devices, got {n!r}")
    if n > MAX_DEVICES:  # refused before a list of n devices is built
        raise ValueError(
            f"--gpus {n:,} is more than the {MAX_DEVICES:,} devices a cluster may hold; "
            f"plan a part of the cluster (identical parts train alike)"
        )
    lo, hi = (b / GIB for b in MEMORY_RANGE_BYTES)
    if memory_gib is not None and not lo <= memory_gib <= hi:
        raise ValueError(
            f"memory_gib must be a positive number of GiB in {lo:.10g} .. {hi:.10g} "
            f"(1 MiB .. 1 PiB), got {memory_gib!r}"
        )
    device = (
        local_accelerator()
        if device_type is None
        else gpu_or_none(default_catalogue(), device_type)
    )
    if device is None:
        cores = usable_cores()
        threads = max(1, cores // n)
        cpu = cpu_device(threads)
        memory = int(memory_gib * GIB) if memory_gib is not None else cpu.memory_bytes // n
        cpu = cpu.with_memory(memory)
        return assemble(f"{n}xcpu", [[(cpu, threads)] * n], {})
    if memory_gib is not None:
        device = device.with_memory(int(memory_gib * GIB))
    per_node = GPUS_PER_NODE if n > GPUS_PER_NODE and n % GPUS_PER_NODE == 0 else n
    nodes = [[(device, 0)] * per_node for _ in range(n // per_node)]
    return assemble(default_name(nodes), nodes, {})


def assemble(name: str | None, nodes: list[NodeDevices], links: Mapping[str, float]) -> Cluster:
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
        name=name or default_name(nodes),
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


def default_name(nodes: list[NodeDevices]) -> str:
    """ "8xh100", "2x8xh100", or "mixed-N" for anything else."""
    keys = {dev.key for node in nodes for dev, _ in node}
    sizes = {len(node) for node in nodes}
    if len(keys) == 1 and len(sizes) == 1:
        key, size = keys.pop(), sizes.pop()
        return f"{size}x{key}" if len(nodes) == 1 else f"{len(nodes)}x{size}x{key}"
    return f"mixed-{sum(len(node) for node in nodes)}"


def gpu_or_none(cat: Catalogue, name: str) -> Device | None:
    """The GPU called ``name``; None for the CPU entry (measured separately).

    Raises:
        ValueError: an unknown name (the catalogue's message lists the known ones).
    """
    return None if cat.is_cpu(name) else cat.gpu(name)


def cpu_device(threads: int) -> Device:
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


def with_threads(cluster: Cluster, threads: int) -> Cluster:
    """The local CPU cluster with every process given ``threads`` torch threads, its device
    measured so (:func:`cpu_device`); memories, links and name kept.

    Example::

        with_threads(from_gpus(8), 2).devices[0].threads   # 2
    """
    assert cluster.backend == "gloo", "threads are for local CPU processes"
    cpu = cpu_device(threads)
    devices = tuple(
        dataclasses.replace(d, device=cpu.with_memory(d.device.memory_bytes), threads=threads)
        for d in cluster.devices
    )
    return dataclasses.replace(cluster, devices=devices)
