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
may set ``threads``, at most this machine's cores). One cluster is all CPUs
(gloo) or all GPUs (nccl).

Ranges (:mod:`planner.devices.cluster`'s): 131,072 devices in all; ``memory_gib``
1 MiB .. 1 PiB; links 1 MB/s .. 100 TB/s, 0 .. 10 s. Write exponents as YAML 1.1
reads them: ``1.0e+3``, not ``1e3`` (text to PyYAML).

The same parser reads the exact form of plan files (:func:`from_record`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from planner.devices.build import NodeDevices, assemble, cpu_device, gpu_or_none
from planner.devices.catalogue import Device, default_catalogue
from planner.devices.cluster import (
    BANDWIDTH_RANGE,
    LATENCY_RANGE_S,
    LINK_FIELDS,
    MAX_DEVICES,
    MEMORY_RANGE_BYTES,
    Cluster,
)
from planner.devices.local import usable_cores
from planner.plan.codec import encode
from planner.plan.sections import ClusterRecord
from planner.plan.units import GIB

__all__ = ["MAX_RECORD_THREADS", "from_record", "load_cluster", "parse_cluster"]

#: The most torch threads a plan file's CPU device may have: a plan made on a larger
#: machine still reads here (its devices run oversubscribed), an absurd one does not.
MAX_RECORD_THREADS = 1024


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
    short_form: bool  # a node may be one group written with `type:` (both forms may `repeat:`)
    units: Mapping[str, str]  # "memory", "bandwidth", "latency" -> the file's unit


_USER_FORMAT = _Format(
    units={"memory": "GiB", "bandwidth": "GB/s", "latency": "µs"},
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
    units={"memory": "bytes", "bandwidth": "bytes/s", "latency": "s"},
    memory_key="memory_bytes",
    memory_unit=1,
    links={f: (f, 0) for f in LINK_FIELDS},
    top_keys=("name", "backend", "nodes", "links"),
    short_form=False,
)


# What each quantity is, its range in SI units, and its range in words.
_RANGES = {
    "memory": ("memory per device", MEMORY_RANGE_BYTES, "1 MiB .. 1 PiB"),
    "bandwidth": ("a link's bandwidth", BANDWIDTH_RANGE, "1 MB/s .. 100 TB/s"),
    "latency": ("a link's latency", LATENCY_RANGE_S, "0 .. 10 s"),
}
# A number PyYAML (YAML 1.1) reads as text: no dot, or an exponent with no sign.
_TEXT_NUMBER = re.compile(r"([-+]?)(\d*)\.?(\d*)(?:[eE]([-+]?)(\d+))?")


def _as_yaml_number(text: str) -> str | None:
    """``text`` spelled so that YAML 1.1 reads a number (``1e300`` -> ``1.0e+300``), or
    None when it is no number."""
    m = _TEXT_NUMBER.fullmatch(text.strip())
    if m is None or not (m[2] or m[3]):
        return None
    sign, whole, frac, exp_sign, exp = m.groups()
    return f"{sign}{whole or 0}.{frac or 0}" + (f"e{exp_sign or '+'}{exp}" if exp else "")


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

    def number(self, path: str, value: Any, quantity: str, scale: float = 1.0) -> float:
        """``value``, checked against the range of ``quantity`` (SI = value · scale)."""
        what, (lo_si, hi_si), words = _RANGES[quantity]
        lo, hi, unit = lo_si / scale, hi_si / scale, self.fmt.units[quantity]
        allowed = f"{what} must lie in {lo:.10g} .. {hi:.10g} {unit} ({words})"
        spelled = _as_yaml_number(value) if isinstance(value, str) else None
        if spelled is not None:
            raise self.error(
                path,
                f"{value!r} is text, not a number: YAML 1.1 reads a number with an exponent "
                f"only with a dot and a signed exponent; write {spelled} ({allowed})",
            )
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not lo <= value <= hi:  # exact for ints of any size; refuses nan
            got = f"{value!r} {unit}" if ok else f"{type(value).__name__} {value!r}"
            raise self.error(
                path, f"{got} is out of range: {allowed}; give the datasheet or measured figure"
            )
        return float(value)

    def whole(self, path: str, value: Any, *, minimum: int = 1, most: int = MAX_DEVICES) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(
                path, f"must be a whole number >= {minimum}, got {value!r}; fix or remove it"
            )
        if value > most:
            raise self.error(
                path,
                f"{value:,} is more than the {most:,} devices a cluster may hold; plan a "
                f"part of the cluster (identical parts train alike)",
            )
        return value

    def threads(self, path: str, value: Any) -> int:
        """A CPU device's torch threads: this machine's cores at most (a plan file: a cap)."""
        threads, cores = self.whole(path, value, most=2**63), usable_cores()
        local = self.fmt is _USER_FORMAT  # people's files are for this machine
        most = cores if local else MAX_RECORD_THREADS
        if threads > most:
            why = f"the {cores} core(s) this process may use (os.sched_getaffinity)"
            raise self.error(
                path,
                f"{threads:,} threads is more than {why if local else f'the cap of {most}'}: "
                f"a local CPU device's threads run on this machine's cores; give at most "
                f"{most}, or leave it out to split the cores evenly",
            )
        return threads

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
            key = f"{path}.{fmt.memory_key}"
            value = self.number(key, raw[fmt.memory_key], "memory", fmt.memory_unit)
            memory = int(value * fmt.memory_unit)
        threads = raw.get("threads")
        if threads is not None and gpu is not None:
            if self.whole(f"{path}.threads", threads, minimum=0) != 0:
                raise self.error(
                    f"{path}.threads",
                    "only CPU devices have threads (a GPU is one device); remove the key",
                )
        elif threads is not None:
            threads = self.threads(f"{path}.threads", threads)
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
        raw = self.mapping(path, raw, ["devices", "repeat"])
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
    nodes = _nodes(p, top["nodes"])
    links = _links(p, top.get("links") or {})
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


def _nodes(p: _Parser, entries: list[Any]) -> list[NodeDevices]:
    """The devices of every node, counted before any list is built (count: 10^9 is refused,
    not allocated)."""
    nodes: list[NodeDevices] = []
    first: _Group | None = None
    made: dict[tuple[object, ...], Device] = {}  # one Device per kind of device
    total = 0
    for i, raw in enumerate(entries):
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
        per_node = sum(g.n for g in groups)
        total += per_node * repeat
        if total > MAX_DEVICES:
            raise p.error(
                f"cluster.nodes[{i}]",
                f"brings the cluster to {total:,} devices ({repeat:,} node(s) of {per_node:,} "
                f"here), more than the {MAX_DEVICES:,} a cluster may hold; plan a part of it "
                f"(fewer nodes or `repeat:`; identical parts train alike)",
            )
        node = _node_devices(groups, made)
        nodes.extend(list(node) for _ in range(repeat))
    return nodes


def _links(p: _Parser, raw: object) -> dict[str, float]:
    """The links a file gives, in SI units, each in its range."""
    links: dict[str, float] = {}
    for key, value in p.mapping("cluster.links", raw, list(p.fmt.links)).items():
        field, exp = p.fmt.links[key]
        quantity = "latency" if field.endswith("_s") else "bandwidth"
        number = p.number(f"cluster.links.{key}", value, quantity, 10.0**exp)
        # Divide for µs: 5 / 1e6 is 5e-06 exactly as printed, 5 * 1e-6 is not.
        links[field] = number * 10**exp if exp >= 0 else number / 10**-exp
    return links


def _node_devices(groups: list[_Group], made: dict[tuple[object, ...], Device]) -> NodeDevices:
    """The devices of one node; CPU groups split the node's RAM and cores by default.

    ``made`` keeps the Device of each (type, memory, threads) already built, so that
    a cluster of 10,000 equal nodes holds one Device, not 10,000 equal copies.
    """
    n_cpu = sum(g.n for g in groups if g.gpu is None)
    node: NodeDevices = []
    for g in groups:
        if g.gpu is None:
            threads = g.threads or max(1, usable_cores() // n_cpu)
            key: tuple[object, ...] = ("cpu", g.memory_bytes, threads, n_cpu)
            if key not in made:
                dev = cpu_device(threads)
                made[key] = dev.with_memory(g.memory_bytes or dev.memory_bytes // n_cpu)
        else:
            threads = 0
            key = (g.gpu.key, g.memory_bytes, 0)
            if key not in made:
                made[key] = g.gpu if g.memory_bytes is None else g.gpu.with_memory(g.memory_bytes)
        node.extend([(made[key], threads)] * g.n)
    return node
