"""The devices a plan may use, how they sit in nodes, and the links between them.

A :class:`Cluster` comes from :func:`from_gpus` (``planner plan --gpus N``) or
from a YAML file (:func:`load_cluster`, ``planner plan --cluster FILE``)::

    >>> c = from_gpus(16, "h100")
    >>> c.describe()
    '2 nodes × 8 h100 (79.6 GiB), NVLink 450 GB/s inside, 50 GB/s between'
    >>> round(c.p2p_time(0, 8, 1e9) * 1e3, 3)  # 1 GB from node 0 to node 1, in ms
    20.01

Cluster file format (read with ``yaml.safe_load``; examples in ``examples/clusters/``)::

    name: mixed-8                 # optional; the default is built from the layout
    nodes:                        # one entry per node; ranks follow file order
      - type: a100-80gb           # short form: `count` devices of one type
        count: 4                  # default 1
        memory_gib: 80            # optional: override the catalogue memory
      - devices:                  # long form: groups of devices inside one node
          - {type: v100-32gb, count: 4}
          - {type: l4, count: 2}
        repeat: 2                 # optional, either form: this many identical nodes
    links:                        # all optional; defaults below
      intra_node_gbs: 300         # GB/s (1e9 B/s) per direction, device to device
      inter_node_gbs: 50
      intra_node_latency_us: 5
      inter_node_latency_us: 10

``type`` is a catalogue key or alias (``planner.catalogue.device_names()``).
``type: cpu`` is a process on the local CPU: by default the devices of a node
split its RAM evenly and get ``cores // devices`` torch threads each (a group
may set ``threads``). One cluster is all CPUs (gloo) or all GPUs (nccl).

Default links: inside a node, the devices' NVLink at half the datasheet's
bidirectional total (H100: 900 → 450 GB/s per direction), or PCIe the same way
when a type has no NVLink or a node mixes types (NVLink joins only GPUs of one
kind), and the slowest node's figure when nodes differ; between nodes,
InfiniBand NDR. CPU processes talk over loopback. See the constants below.

:meth:`Cluster.to_dict` writes a different, exact form for plan files (bytes,
bytes/s, seconds, one group per run of equal devices); :meth:`Cluster.from_dict`
reads it back. People write the form above.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from planner.catalogue import Catalogue, Device, load_catalogue, local_accelerator, local_cpu

__all__ = [
    "DEFAULT_INTER_NODE_BANDWIDTH",
    "DEFAULT_INTER_NODE_LATENCY_S",
    "DEFAULT_INTRA_NODE_LATENCY_S",
    "GPUS_PER_NODE",
    "LOOPBACK_BANDWIDTH",
    "LOOPBACK_LATENCY_S",
    "Cluster",
    "ClusterDevice",
    "from_gpus",
    "load_cluster",
    "parse_cluster",
]

_GIB = 2**30

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
# loopback TCP. Defaults to be calibrated, not measurements: gloo moves a few
# GB/s through loopback and costs tens of µs per message.
#: Bandwidth between two local CPU processes, bytes/s per direction.
LOOPBACK_BANDWIDTH = 5e9
#: Latency of one message between two local CPU processes, seconds.
LOOPBACK_LATENCY_S = 50e-6


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

    Build one with :func:`from_gpus`, :func:`load_cluster` or
    :func:`parse_cluster`; the constructor checks the layout is consistent.

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
        for field in ("intra_node_bandwidth", "inter_node_bandwidth"):
            if not (math.isfinite(getattr(self, field)) and getattr(self, field) > 0):
                raise ValueError(f"cluster {self.name!r}: {field} must be > 0 bytes/s")
        for field in ("intra_node_latency_s", "inter_node_latency_s"):
            if not (math.isfinite(getattr(self, field)) and getattr(self, field) >= 0):
                raise ValueError(f"cluster {self.name!r}: {field} must be >= 0 seconds")

    @property
    def n_devices(self) -> int:
        return len(self.devices)

    @property
    def n_nodes(self) -> int:
        return self.devices[-1].node + 1

    @property
    def device_types(self) -> tuple[str, ...]:
        """The catalogue keys present, sorted, each once."""
        return tuple(sorted({d.device.key for d in self.devices}))

    @property
    def homogeneous(self) -> bool:
        """True when every device is the same (type, memory and threads)."""
        return len({(d.device, d.threads) for d in self.devices}) == 1

    def devices_per_node(self) -> list[int]:
        counts = [0] * self.n_nodes
        for d in self.devices:
            counts[d.node] += 1
        return counts

    def _rank(self, rank: int) -> ClusterDevice:
        if not 0 <= rank < self.n_devices:
            raise ValueError(
                f"rank {rank} is not in cluster {self.name!r}: it has {self.n_devices} "
                f"devices, ranks 0..{self.n_devices - 1}"
            )
        return self.devices[rank]

    def bandwidth(self, a: int, b: int) -> float:
        """Bytes/s per direction from rank ``a`` to rank ``b`` (inf when a == b)."""
        if self._rank(a).node != self._rank(b).node:
            return self.inter_node_bandwidth
        return math.inf if a == b else self.intra_node_bandwidth

    def latency(self, a: int, b: int) -> float:
        """Seconds per transfer from rank ``a`` to rank ``b`` (0 when a == b)."""
        if self._rank(a).node != self._rank(b).node:
            return self.inter_node_latency_s
        return 0.0 if a == b else self.intra_node_latency_s

    def p2p_time(self, a: int, b: int, nbytes: float) -> float:
        """Seconds to send ``nbytes`` from ``a`` to ``b``: latency + bytes / bandwidth."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if self._rank(a) is self._rank(b):
            return 0.0
        return self.latency(a, b) + nbytes / self.bandwidth(a, b)

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
        ring = sorted(ranks)
        if not ring or len(set(ring)) != len(ring):
            raise ValueError(f"all-reduce needs distinct ranks, at least one; got {list(ranks)}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        n = len(ring)
        if n == 1:
            self._rank(ring[0])
            return 0.0
        hops = zip(ring, ring[1:] + ring[:1], strict=True)
        links = [(self.bandwidth(a, b), self.latency(a, b)) for a, b in hops]
        bw, lat = min(links, key=lambda link: (link[0], -link[1]))  # slowest, then laggiest
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a plan file; :meth:`from_dict` reads it back exactly.

        Memory in bytes, bandwidth in bytes/s, latency in seconds; each node
        lists runs of equal devices as ``{type, count, memory_bytes, threads}``.
        """
        nodes: list[dict[str, Any]] = [{"devices": []} for _ in range(self.n_nodes)]
        for d in self.devices:
            groups = nodes[d.node]["devices"]
            entry = {
                "type": d.device.key,
                "count": 1,
                "memory_bytes": d.device.memory_bytes,
                "threads": d.threads,
            }
            last = groups[-1] if groups else None
            if last and {**last, "count": 1} == entry:
                last["count"] += 1
            else:
                groups.append(entry)
        return {
            "name": self.name,
            "backend": self.backend,
            "nodes": nodes,
            "links": {f: getattr(self, f) for f in _LINK_FIELDS},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cluster:
        """The cluster that :meth:`to_dict` wrote.

        Raises:
            ValueError: malformed data; the message names the key path.
        """
        return _parse(data, _RECORD_FORMAT, "<plan>")

    def describe(self) -> str:
        """One line for reports.

        Example::

            >>> from_gpus(8, "a100").describe()
            '1 node × 8 a100-80gb (80.0 GiB), NVLink 300 GB/s inside'
        """
        layouts = [self._node_summary(n) for n in range(self.n_nodes)]
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

    def _node_summary(self, node: int) -> str:
        groups = self.to_dict()["nodes"][node]["devices"]
        parts = [
            f"{g['count']} {g['type']} ({g['memory_bytes'] / _GIB:.1f} GiB"
            + (f", {g['threads']} threads each)" if g["threads"] else ")")
            for g in groups
        ]
        return parts[0] if len(parts) == 1 else "[" + " + ".join(parts) + "]"

    def _intra_label(self) -> str:
        devices = {d.device for d in self.devices}
        if any(dev.kind == "cpu" for dev in devices):
            return "loopback "
        if len(devices) == 1 and self.intra_node_bandwidth == devices.pop().nvlink_bandwidth / 2:
            return "NVLink "
        if self.intra_node_bandwidth == min(d.device.pcie_bandwidth for d in self.devices) / 2:
            return "PCIe "
        return ""


_LINK_FIELDS = (
    "intra_node_bandwidth",
    "inter_node_bandwidth",
    "intra_node_latency_s",
    "inter_node_latency_s",
)


# --- building ------------------------------------------------------------------------

_Node = list[tuple[Device, int]]  # (device, threads) per device of one node


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
    if memory_gib is not None and not memory_gib > 0:
        raise ValueError(f"memory_gib must be a positive number of GiB, got {memory_gib!r}")
    device = local_accelerator() if device_type is None else _gpu_or_none(_catalogue(), device_type)
    if device is None:
        cores = _usable_cores()
        threads = max(1, cores // n)
        cpu = _cpu_device(threads)
        memory = int(memory_gib * _GIB) if memory_gib is not None else cpu.memory_bytes // n
        cpu = cpu.with_memory(memory)
        return _assemble(f"{n}xcpu", [[(cpu, threads)] * n], {})
    if memory_gib is not None:
        device = device.with_memory(int(memory_gib * _GIB))
    per_node = GPUS_PER_NODE if n > GPUS_PER_NODE and n % GPUS_PER_NODE == 0 else n
    nodes = [[(device, 0)] * per_node for _ in range(n // per_node)]
    return _assemble(_default_name(nodes), nodes, {})


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


# --- parsing -------------------------------------------------------------------------


def load_cluster(path: str | os.PathLike[str]) -> Cluster:
    """Read a cluster file (format: this module's docstring).

    Example::

        >>> load_cluster("examples/clusters/2x8xh100.yaml").devices_per_node()
        [8, 8]

    Raises:
        ValueError: not plain YAML data (tags such as ``!!python/object`` are
            refused), or not a valid cluster; the message names the key path.
    """
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(
            f"{path}: cannot read this cluster file: {err}\n(only plain YAML data is "
            f"accepted: mappings, lists, strings and numbers; no tags such as !!python/...)"
        ) from err
    return parse_cluster(data, source=str(path))


def parse_cluster(data: Mapping[str, Any] | None, *, source: str = "<cluster>") -> Cluster:
    """Build a cluster from the parsed data of a cluster file.

    Example::

        >>> parse_cluster({"nodes": [{"type": "h100", "count": 8, "repeat": 2}]}).name
        '2x8xh100'

    Args:
        data: the file's top-level mapping.
        source: where it came from, to start error messages with.

    Raises:
        ValueError: what is wrong, why, and how to fix it, with the key path
            (e.g. ``cluster.nodes[1].devices[0].type``).
    """
    return _parse(data, _USER_FORMAT, source)


@dataclass(frozen=True)
class _Format:
    memory_key: str
    memory_unit: float  # bytes per unit of memory_key
    links: Mapping[str, tuple[str, int]]  # file key -> (Cluster field, SI = value·10^exp)
    top_keys: tuple[str, ...]
    short_form: bool  # nodes may be one group with `type:`, and may `repeat:`


_USER_FORMAT = _Format(
    memory_key="memory_gib",
    memory_unit=_GIB,
    links={
        "intra_node_gbs": ("intra_node_bandwidth", 9),
        "inter_node_gbs": ("inter_node_bandwidth", 9),
        "intra_node_latency_us": ("intra_node_latency_s", -6),
        "inter_node_latency_us": ("inter_node_latency_s", -6),
    },
    top_keys=("name", "nodes", "links"),
    short_form=True,
)
_RECORD_FORMAT = _Format(
    memory_key="memory_bytes",
    memory_unit=1,
    links={f: (f, 0) for f in _LINK_FIELDS},
    top_keys=("name", "backend", "nodes", "links"),
    short_form=False,
)


class _Group(NamedTuple):
    gpu: Device | None  # None: the local CPU, measured once its threads are known
    n: int  # devices in the group (`count:`)
    memory_bytes: int | None  # None: the catalogue's (GPU) or a share of the RAM (CPU)
    threads: int | None  # None: a share of the cores (CPU)
    path: str  # of its `type:` key, for errors


class _Parser:
    def __init__(self, fmt: _Format, source: str) -> None:
        self.fmt, self.source = fmt, source

    def error(self, path: str, message: str) -> ValueError:
        return ValueError(f"{self.source}: {path}: {message}")

    def mapping(self, path: str, value: object, allowed: Sequence[str]) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.error(
                path,
                f"expected a mapping (keys: {', '.join(allowed)}), got {type(value).__name__} "
                f"{value!r}",
            )
        for key in value:
            if key not in allowed:
                raise self.error(
                    f"{path}.{key}",
                    f"unknown key {key!r}; allowed here: {', '.join(allowed)} "
                    f"(check the spelling; the format is in planner/cluster.py)",
                )
        return value

    def number(self, path: str, value: Any, *, zero_ok: bool = False) -> float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or not (value >= 0 if zero_ok else value > 0):
            need = "a number >= 0" if zero_ok else "a positive number"
            raise self.error(
                path,
                f"must be {need}, got {value!r}: a size or a speed must be "
                f"{'non-negative' if zero_ok else 'above zero'}; give the datasheet or "
                f"measured figure",
            )
        return float(value)

    def whole(self, path: str, value: Any, *, minimum: int = 1) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(
                path, f"must be a whole number >= {minimum}, got {value!r}; fix or remove it"
            )
        return value

    def group(self, path: str, raw: object, extra: Sequence[str] = ()) -> _Group:
        fmt = self.fmt
        raw = self.mapping(path, raw, ["type", "count", fmt.memory_key, "threads", *extra])
        if "type" not in raw:
            known = ", ".join(_catalogue().names())
            raise self.error(path, f"no 'type:' key; name a catalogue device, one of {known}")
        try:
            gpu = _gpu_or_none(_catalogue(), str(raw["type"]))
        except ValueError as err:
            raise self.error(f"{path}.type", str(err)) from None
        memory = None
        if fmt.memory_key in raw:
            value = self.number(f"{path}.{fmt.memory_key}", raw[fmt.memory_key])
            memory = int(value * fmt.memory_unit)
        threads = raw.get("threads")
        if threads is not None:
            threads = self.whole(f"{path}.threads", threads, minimum=0 if gpu else 1)
            if gpu is not None and threads != 0:
                raise self.error(
                    f"{path}.threads",
                    "only CPU devices have threads (a GPU is one device); remove the key",
                )
        count = self.whole(f"{path}.count", raw.get("count", 1))
        return _Group(gpu, count, memory, threads, f"{path}.type")

    def node(self, path: str, raw: object) -> tuple[list[_Group], int]:
        """A node's groups, and how many identical nodes it stands for."""
        short = self.fmt.short_form
        if short and isinstance(raw, Mapping) and "devices" not in raw:
            return [self.group(path, raw, ["repeat"])], self.repeat(path, raw)
        if short and isinstance(raw, Mapping) and "type" in raw:
            raise self.error(
                path,
                "has both 'type:' and 'devices:'; use the short form (type, count) or the "
                "long form (devices: [...]), not both",
            )
        raw = self.mapping(path, raw, ["devices", "repeat"] if short else ["devices"])
        groups = raw.get("devices")
        if not isinstance(groups, list) or not groups:
            raise self.error(
                f"{path}.devices",
                f"must be a non-empty list of device groups such as "
                f"{{type: h100, count: 8}}, got {groups!r}",
            )
        parsed = [self.group(f"{path}.devices[{i}]", g) for i, g in enumerate(groups)]
        return parsed, self.repeat(path, raw)

    def repeat(self, path: str, raw: Mapping[str, Any]) -> int:
        return self.whole(f"{path}.repeat", raw.get("repeat", 1))


def _parse(data: object, fmt: _Format, source: str) -> Cluster:
    p = _Parser(fmt, source)
    top = p.mapping("cluster", {} if data is None else data, fmt.top_keys)
    if not top.get("nodes"):
        raise p.error(
            "cluster.nodes",
            "the cluster is empty: plans need at least one node with one device; "
            "add e.g. `nodes: [{type: h100, count: 8}]`",
        )
    name = top.get("name")
    if name is not None and (not isinstance(name, str) or not name):
        raise p.error("cluster.name", f"must be a non-empty string, got {name!r}")
    if not isinstance(top["nodes"], list):
        raise p.error("cluster.nodes", "must be a list, one `- ...` entry per node")
    nodes: list[_Node] = []
    first: _Group | None = None
    for i, raw in enumerate(top["nodes"]):
        groups, repeat = p.node(f"cluster.nodes[{i}]", raw)
        for g in groups:
            first = first or g
            if (g.gpu is None) != (first.gpu is None):
                kinds = ("CPU", "GPU") if g.gpu is None else ("GPU", "CPU")
                raise p.error(
                    g.path,
                    f"a {kinds[0]} device, but {first.path} is a {kinds[1]}: one cluster runs "
                    f"one backend (gloo for CPUs, nccl for GPUs); use only one kind",
                )
        node = _node_devices(groups)
        nodes.extend(list(node) for _ in range(repeat))
    raw_links = p.mapping("cluster.links", top.get("links") or {}, list(fmt.links))
    links: dict[str, float] = {}
    for key, value in raw_links.items():
        field, exp = fmt.links[key]
        number = p.number(f"cluster.links.{key}", value, zero_ok="latency" in key)
        # Divide for µs: 5 / 1e6 is 5e-06 exactly as printed, 5 * 1e-6 is not.
        links[field] = number * 10**exp if exp >= 0 else number / 10**-exp
    cpu = nodes[0][0][0].kind == "cpu"
    if cpu and len(nodes) > 1 and "inter_node_bandwidth" not in links:
        key = next(k for k, (field, _) in fmt.links.items() if field == "inter_node_bandwidth")
        raise p.error(
            f"cluster.links.{key}",
            "missing: CPU nodes have no default network speed between them; give it",
        )
    backend = top.get("backend")
    if backend is not None and backend != ("gloo" if cpu else "nccl"):
        want = "gloo" if cpu else "nccl"
        raise p.error("cluster.backend", f"{backend!r} does not fit these devices; use {want!r}")
    return _assemble(name, nodes, links)


def _node_devices(groups: list[_Group]) -> _Node:
    """The devices of one node; CPU groups split the node's RAM and cores by default."""
    n_cpu = sum(g.n for g in groups if g.gpu is None)
    node: _Node = []
    for g in groups:
        if g.gpu is None:
            threads = g.threads or max(1, _usable_cores() // n_cpu)
            dev = _cpu_device(threads)
            dev = dev.with_memory(g.memory_bytes or dev.memory_bytes // n_cpu)
        else:
            threads = 0
            dev = g.gpu if g.memory_bytes is None else g.gpu.with_memory(g.memory_bytes)
        node.extend([(dev, threads)] * g.n)
    return node
