"""Cluster files: the YAML people write, read and checked key by key into a Cluster.

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
    links:                        # all optional; defaults: see planner.devices.cluster
      intra_node_gbs: 300         # GB/s (1e9 B/s) per direction, device to device
      inter_node_gbs: 50
      intra_node_latency_us: 5
      inter_node_latency_us: 10

``type`` is a catalogue key or alias (``planner.devices.device_names()``).
``type: cpu`` is a process on the local CPU: by default the devices of a node
split its RAM evenly and get ``cores // devices`` torch threads each (a group
may set ``threads``). One cluster is all CPUs (gloo) or all GPUs (nccl).

The same parser reads the exact form of plan files (:func:`from_record`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from planner.devices.build import NodeDevices, assemble, cpu_device, gpu_or_none
from planner.devices.catalogue import Device, default_catalogue
from planner.devices.cluster import LINK_FIELDS, Cluster
from planner.devices.local import usable_cores
from planner.plan.codec import encode
from planner.plan.sections import ClusterRecord
from planner.plan.units import GIB

__all__ = ["from_record", "load_cluster", "parse_cluster"]


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


def from_record(record: ClusterRecord | Mapping[str, Any], *, source: str = "<plan>") -> Cluster:
    """The cluster of a plan file's record (``Cluster.to_record``, or its plain data), exactly.

    Raises:
        ValueError: the record does not make a valid cluster (e.g. an unknown
            device type, a key of another form); the message names the key path.
    """
    data = encode(record) if isinstance(record, ClusterRecord) else record
    return _parse(data, _RECORD_FORMAT, source)


@dataclass(frozen=True)
class _Format:
    memory_key: str
    memory_unit: float  # bytes per unit of memory_key
    links: Mapping[str, tuple[str, int]]  # file key -> (Cluster field, SI = value·10^exp)
    top_keys: tuple[str, ...]
    short_form: bool  # nodes may be one group with `type:`, and may `repeat:`


_USER_FORMAT = _Format(
    memory_key="memory_gib",
    memory_unit=GIB,
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
    links={f: (f, 0) for f in LINK_FIELDS},
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
                    f"(check the spelling; the format is in planner/devices/cluster_file.py)",
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
            known = ", ".join(default_catalogue().names())
            raise self.error(path, f"no 'type:' key; name a catalogue device, one of {known}")
        try:
            gpu = gpu_or_none(default_catalogue(), str(raw["type"]))
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
    nodes: list[NodeDevices] = []
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
    return assemble(name, nodes, links)


def _node_devices(groups: list[_Group]) -> NodeDevices:
    """The devices of one node; CPU groups split the node's RAM and cores by default."""
    n_cpu = sum(g.n for g in groups if g.gpu is None)
    node: NodeDevices = []
    for g in groups:
        if g.gpu is None:
            threads = g.threads or max(1, usable_cores() // n_cpu)
            dev = cpu_device(threads)
            dev = dev.with_memory(g.memory_bytes or dev.memory_bytes // n_cpu)
        else:
            threads = 0
            dev = g.gpu if g.memory_bytes is None else g.gpu.with_memory(g.memory_bytes)
        node.extend([(dev, threads)] * g.n)
    return node
