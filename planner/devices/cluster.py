"""The devices a plan may use, how they sit in nodes, and the links between them.

A :class:`Cluster` comes from ``from_gpus`` (``planner plan --gpus N``,
:mod:`planner.devices.build`) or from a YAML file (``load_cluster``,
``planner plan --cluster FILE``, :mod:`planner.devices.cluster_file`)::

    >>> c = from_gpus(16, "h100")
    >>> c.describe()
    '2 nodes × 8 h100 (79.6 GiB), NVLink 450 GB/s inside, 50 GB/s between'
    >>> round(c.p2p_time(0, 8, 1e9) * 1e3, 3)  # 1 GB from node 0 to node 1, in ms
    20.01

Cluster files are read by :mod:`planner.devices.cluster_file`, whose docstring
gives their format. :mod:`planner.devices.build` numbers the devices and fills
in the default links, for cluster files and ``from_gpus``.

Default links: inside a node, the devices' NVLink at half the datasheet's
bidirectional total (H100: 900 → 450 GB/s per direction), or PCIe the same way
when a type has no NVLink or a node mixes types (NVLink joins only GPUs of one
kind), and the slowest node's figure when nodes differ; between nodes,
InfiniBand NDR. CPU processes talk over loopback. See the constants below.

:meth:`Cluster.to_record` gives a different, exact form for plan files
(bytes, bytes/s, seconds, one group per run of equal devices);
``cluster_file.from_record`` reads it back. People write the form of
:mod:`planner.devices.cluster_file`.

Limits (:data:`MAX_DEVICES` and the ``*_RANGE*`` below) are physically sensible;
the constructor checks them, the cluster-file parser too with the key path, so no
1e300 reaches the cost model or the solver. A cluster is immutable: what the search
and reports ask repeatedly (record, summary, rings) is computed once.

Pure: no torch.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.devices.catalogue import Device
from planner.devices.local import usable_cores
from planner.plan.sections import ClusterRecord, DeviceGroup, LinkRecord, NodeRecord
from planner.plan.units import GIB

__all__ = [
    "BANDWIDTH_RANGE",
    "DEFAULT_INTER_NODE_BANDWIDTH",
    "DEFAULT_INTER_NODE_LATENCY_S",
    "DEFAULT_INTRA_NODE_LATENCY_S",
    "GLOO_ALLREDUCE_EFFICIENCY",
    "GPUS_PER_NODE",
    "LATENCY_RANGE_S",
    "LINK_FIELDS",
    "LOOPBACK_BANDWIDTH",
    "LOOPBACK_LATENCY_S",
    "MAX_DEVICES",
    "MEMORY_RANGE_BYTES",
    "Cluster",
    "ClusterDevice",
]

#: ``--gpus N`` with N > 8 and a multiple of 8 means N/8 nodes of 8: the usual
#: server (DGX/HGX A100 and H100 hold 8 GPUs). Other N stay on one node.
GPUS_PER_NODE = 8
#: Between nodes: InfiniBand NDR, 400 Gb/s per port ≈ 50 GB/s per direction
#: (shared/reference/hardware.md). Bytes/s.
DEFAULT_INTER_NODE_BANDWIDTH = 50e9
# hardware.md gives p2p time = latency + S/B but no latency figure: these two are
# order-of-magnitude assumptions for a small NCCL send (a few µs over NVLink or
# PCIe, about twice that through a NIC and switch). Calibrate when they matter.
#: Latency of one transfer between two GPUs of a node, seconds.
DEFAULT_INTRA_NODE_LATENCY_S = 5e-6
#: Latency of one transfer between nodes, seconds.
DEFAULT_INTER_NODE_LATENCY_S = 10e-6
# Local CPU "devices" are processes on one machine talking through gloo over
# loopback TCP. Measured here (bench/bench_runtime.py, 2-core machine, torch
# 2.13): send/recv 112–163 µs for ≤ 16 KB, 3.6–4.3 GB/s for large tensors.
#: Bandwidth between two local CPU processes, bytes/s per direction.
LOOPBACK_BANDWIDTH = 4e9
#: Latency of one message between two local CPU processes, seconds.
LOOPBACK_LATENCY_S = 150e-6
#: gloo's all-reduce reaches ~0.4 of its p2p bandwidth (measured 1.5–1.8 GB/s
#: effective vs ~4 GB/s p2p on loopback); NCCL's ring runs at link speed.
GLOO_ALLREDUCE_EFFICIENCY = 0.4

#: The most devices of a cluster: 2^17, above the largest ever built (~100,000 GPUs).
MAX_DEVICES = 131_072
#: Memory per device, bytes: 1 MiB (a toy test device) to 1 PiB (≈ 7,000 H100s' worth).
MEMORY_RANGE_BYTES = (2**20, 2**50)
#: Bandwidth of a link, bytes/s per direction: 1 MB/s (a slow network) to 100 TB/s
#: (≈ 100 × NVLink 5's 1.8 TB/s per GPU).
BANDWIDTH_RANGE = (1e6, 1e14)
#: Latency of one transfer, seconds: 0 (ideal) to 10 s (a satellite hop is 0.6 s).
LATENCY_RANGE_S = (0.0, 10.0)


@dataclass(frozen=True, kw_only=True)
class ClusterDevice:
    """One device of a cluster and where it sits.

    Attributes:
        rank: global index, 0..N-1, node by node.
        node: index of its node.
        local_index: index inside its node.
        device: the catalogue device, with any memory override applied.
        threads: for a local CPU device, the torch threads its process gets
            (``device`` was measured with that many); 0 for a GPU.
    """

    rank: int
    node: int
    local_index: int
    device: Device
    threads: int = 0

    def __post_init__(self) -> None:
        if self.threads < 0 or (self.device.kind == "gpu" and self.threads != 0):
            raise ValueError(
                f"rank {self.rank}: threads must be >= 0, and 0 for a GPU "
                f"(it counts CPU threads), got {self.threads} for {self.device.key!r}"
            )


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Devices in nodes, and one bandwidth and latency per kind of link.

    Build one with ``from_gpus``, ``load_cluster`` or ``parse_cluster``; the
    constructor checks the layout is consistent.

    Attributes:
        name: a label for reports.
        devices: every device, in rank order, node by node.
        intra_node_bandwidth: bytes/s per direction between two devices of a node.
        inter_node_bandwidth: bytes/s per direction between two nodes.
        intra_node_latency_s: seconds per transfer inside a node.
        inter_node_latency_s: seconds per transfer between nodes.
        backend: ``"nccl"`` for GPUs, ``"gloo"`` for CPU devices.
    """

    name: str
    devices: tuple[ClusterDevice, ...]
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency_s: float
    inter_node_latency_s: float
    backend: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        if not self.devices:
            raise ValueError(f"cluster {self.name!r} has no devices; give it at least one")
        if len(self.devices) > MAX_DEVICES:
            raise ValueError(
                f"cluster {self.name!r} has {len(self.devices):,} devices, more than the "
                f"{MAX_DEVICES:,} a cluster may hold; plan a part of it (identical parts "
                f"train alike)"
            )
        for prev, d in zip((None, *self.devices), self.devices, strict=False):
            if prev is None:
                want = (0, 0, 0)
            elif d.node == prev.node:
                want = (prev.rank + 1, prev.node, prev.local_index + 1)
            else:
                want = (prev.rank + 1, prev.node + 1, 0)
            if (d.rank, d.node, d.local_index) != want:
                raise ValueError(
                    f"cluster {self.name!r}: a {d.device.key!r} has (rank, node, local_index) "
                    f"= {(d.rank, d.node, d.local_index)} where {want} was due: list devices "
                    f"in rank order, node by node, each numbered from 0"
                )
        kinds = {d.device.kind for d in self.devices}
        if len(kinds) > 1:
            raise ValueError(
                f"cluster {self.name!r} mixes CPU and GPU devices; one cluster runs one "
                f"backend (gloo for CPUs, nccl for GPUs): use only one kind"
            )
        backend = "gloo" if kinds == {"cpu"} else "nccl"
        if self.backend != backend:
            raise ValueError(
                f"cluster {self.name!r}: backend {self.backend!r} does not fit its "
                f"{kinds.pop()} devices; use {backend!r}"
            )
        for field in LINK_FIELDS:
            lo, hi = LATENCY_RANGE_S if field.endswith("_s") else BANDWIDTH_RANGE
            unit = "seconds" if field.endswith("_s") else "bytes/s"
            value = getattr(self, field)
            if not lo <= value <= hi:  # also refuses nan
                raise ValueError(
                    f"cluster {self.name!r}: {field} is {value!r} {unit}, outside "
                    f"{lo:g} .. {hi:g} {unit}; give the link's measured or datasheet figure"
                )

    @property
    def n_devices(self) -> int:
        return len(self.devices)

    @property
    def n_nodes(self) -> int:
        return self.devices[-1].node + 1

    # functools.cached_property writes the instance's __dict__, as a frozen dataclass
    # allows; dataclasses.replace builds a new instance, with no cache.

    @functools.cached_property
    def device_types(self) -> tuple[str, ...]:
        """The catalogue keys present, sorted, each once."""
        return tuple(sorted({d.device.key for d in self.devices}))

    @functools.cached_property
    def homogeneous(self) -> bool:
        """True when every device is the same (type, memory and threads)."""
        first = self.devices[0]
        return all(d.device == first.device and d.threads == first.threads for d in self.devices)

    @property
    def cores_per_node(self) -> int:
        """CPU cores the processes of a node share: for a CPU cluster this machine's
        usable cores (its processes run here), 0 for GPUs."""
        return usable_cores() if self.backend == "gloo" else 0

    def devices_per_node(self) -> list[int]:
        """Devices in each node, in node order (a new list each call)."""
        return list(self._per_node)

    @functools.cached_property
    def _per_node(self) -> tuple[int, ...]:
        return tuple(len(list(g)) for _, g in itertools.groupby(self._node_of))

    @functools.cached_property
    def _node_of(self) -> tuple[int, ...]:
        """The node of each rank."""
        return tuple(d.node for d in self.devices)

    def _node(self, rank: int) -> int:
        if not 0 <= rank < len(self.devices):
            raise ValueError(
                f"rank {rank} is not in cluster {self.name!r}: it has {self.n_devices} "
                f"devices, ranks 0..{self.n_devices - 1}"
            )
        return self._node_of[rank]

    def bandwidth(self, a: int, b: int) -> float:
        """Bytes/s per direction from rank ``a`` to rank ``b`` (inf when a == b)."""
        if self._node(a) != self._node(b):
            return self.inter_node_bandwidth
        return math.inf if a == b else self.intra_node_bandwidth

    def latency(self, a: int, b: int) -> float:
        """Seconds per transfer from rank ``a`` to rank ``b`` (0 when a == b)."""
        if self._node(a) != self._node(b):
            return self.inter_node_latency_s
        return 0.0 if a == b else self.intra_node_latency_s

    def p2p_time(self, a: int, b: int, nbytes: float) -> float:
        """Seconds to send ``nbytes`` from ``a`` to ``b``: latency + bytes / bandwidth."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        nodes = self._node_of  # inlined _node: the cost model asks this per replica pair
        if not (0 <= a < len(nodes) and 0 <= b < len(nodes)):
            self._node(b if 0 <= a < len(nodes) else a)  # raises, naming the rank
        if nodes[a] != nodes[b]:
            return self.inter_node_latency_s + nbytes / self.inter_node_bandwidth
        return 0.0 if a == b else self.intra_node_latency_s + nbytes / self.intra_node_bandwidth

    def allreduce_time(self, ranks: Sequence[int], nbytes: float) -> float:
        """Seconds for a ring all-reduce of ``nbytes`` over ``ranks``.

        ``t = 2(n−1)/n · S/B + 2(n−1)·L``, B and L those of the ring's slowest
        link (nccl-tests PERFORMANCE.md; hardware.md). The ring visits ranks in
        order, node by node as NCCL does, so a group that spans nodes runs at
        the inter-node bandwidth. 0 for one rank.

        Example::

            >>> c = from_gpus(16, "h100")
            >>> c.allreduce_time(range(8), 0) == 2 * 7 * DEFAULT_INTRA_NODE_LATENCY_S
            True
        """
        key = ranks if isinstance(ranks, tuple) else tuple(ranks)
        ring = self._rings.get(key)
        if ring is None:
            ring = self._ring(key)
            if len(self._rings) < 4096:  # a search asks of a few rank sets, many times
                self._rings[key] = ring
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        n, bw, lat = ring  # one rank: 0 s (bandwidth inf, latency 0)
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat

    @functools.cached_property
    def _rings(self) -> dict[tuple[int, ...], tuple[int, float, float]]:
        return {}

    def _ring(self, ranks: tuple[int, ...]) -> tuple[int, float, float]:
        """(ranks, bandwidth, latency) of the ring over ``ranks``: its slowest link."""
        ring = sorted(ranks)
        if not ring or len(set(ring)) != len(ring):
            raise ValueError(f"all-reduce needs distinct ranks, at least one; got {list(ranks)}")
        n = len(ring)
        self._node(ring[0])
        self._node(ring[-1])  # sorted: every rank is in range when both ends are
        if n == 1:
            return 1, math.inf, 0.0
        # Ranks are numbered node by node, so in the sorted ring the ranks of one node
        # sit together: a hop crosses nodes iff the ring spans more than one node, and
        # a hop stays inside one iff some node holds two of the ranks.
        nodes = len(set(map(self._node_of.__getitem__, ring)))
        links = []
        if nodes > 1:
            links.append((self.inter_node_bandwidth, self.inter_node_latency_s))
        if nodes < n:
            links.append((self.intra_node_bandwidth, self.intra_node_latency_s))
        bw, lat = min(links, key=lambda link: (link[0], -link[1]))  # slowest, then laggiest
        if self.backend == "gloo":
            bw *= GLOO_ALLREDUCE_EFFICIENCY
        return n, bw, lat

    def to_record(self) -> ClusterRecord:
        """The plan file's exact form (bytes, bytes/s, seconds; runs of equal devices, equal
        nodes in a row once); ``cluster_file.from_record`` reads it back. Made once."""
        return self._record

    @functools.cached_property
    def _record(self) -> ClusterRecord:
        def run(d: ClusterDevice) -> tuple[str, int, int]:
            return d.device.key, d.device.memory_bytes, d.threads

        nodes: list[NodeRecord] = []
        for _, node in itertools.groupby(self.devices, key=lambda d: d.node):
            runs = itertools.groupby(node, key=run)
            groups = tuple(DeviceGroup(type=k, count=len(list(same)), memory_bytes=m, threads=t)
                           for (k, m, t), same in runs)  # fmt: skip
            if nodes and nodes[-1].devices == groups:  # equal nodes in a row: one record
                nodes[-1] = NodeRecord(devices=groups, repeat=nodes[-1].repeat + 1)
            else:
                nodes.append(NodeRecord(devices=groups))
        return ClusterRecord(
            name=self.name,
            backend=self.backend,
            nodes=tuple(nodes),
            links=LinkRecord(**{f: getattr(self, f) for f in LINK_FIELDS}),
        )

    def describe(self) -> str:
        """One line for reports (made once per cluster, linear in its devices).

        Example::

            >>> from_gpus(8, "a100").describe()
            '1 node × 8 a100-80gb (80.0 GiB), NVLink 300 GB/s inside'
        """
        return self._summary

    @functools.cached_property
    def _summary(self) -> str:
        summary = functools.cache(_node_summary)  # equal nodes are summed up once
        layouts = [summary(node) for node in self._record.nodes for _ in range(node.repeat)]
        plural = "s" if self.n_nodes > 1 else ""
        if len(set(layouts)) == 1:
            text = f"{self.n_nodes} node{plural} × {layouts[0]}"
        else:
            text = f"{self.n_nodes} nodes: " + " | ".join(layouts)
        if self.n_devices > 1:
            text += f", {self._intra_label()}{self.intra_node_bandwidth / 1e9:g} GB/s inside"
        if self.n_nodes > 1:
            text += f", {self.inter_node_bandwidth / 1e9:g} GB/s between"
        return text

    def _intra_label(self) -> str:
        first = self.devices[0].device
        if self.backend == "gloo":
            return "loopback "
        alike = all(d.device == first for d in self.devices)
        if alike and self.intra_node_bandwidth == first.nvlink_bandwidth / 2:
            return "NVLink "
        if self.intra_node_bandwidth == min(d.device.pcie_bandwidth for d in self.devices) / 2:
            return "PCIe "
        return ""


LINK_FIELDS = (
    "intra_node_bandwidth",
    "inter_node_bandwidth",
    "intra_node_latency_s",
    "inter_node_latency_s",
)


def _node_summary(node: NodeRecord) -> str:
    parts = [
        f"{g.count} {g.type} ({g.memory_bytes / GIB:.1f} GiB"
        + (f", {g.threads} threads each)" if g.threads else ")")
        for g in node.devices
    ]
    return parts[0] if len(parts) == 1 else "[" + " + ".join(parts) + "]"
