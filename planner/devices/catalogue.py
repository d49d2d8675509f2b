"""The device catalogue: peak speed, memory and links of each device type.

The numbers live in ``planner/data/devices.yaml`` (with their datasheet sources);
this module loads and validates them into :class:`Device` records. The ``cpu``
entry names the local CPU, which is measured instead of read from the file
(:mod:`planner.devices.local`, which also finds the local GPU and has
``get_device``, the lookup of either).

Example::

    >>> h100 = default_catalogue().gpu("H100-SXM")
    >>> h100.key, h100.memory_bytes // 2**30
    ('h100', 79)
    >>> round(h100.flops_per_s("bf16") / 1e12)  # 989 TFLOP/s peak x 0.65
    643
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.resources
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from planner.plan.units import GIB

__all__ = [
    "DTYPES",
    "Catalogue",
    "CpuEntry",
    "Device",
    "default_catalogue",
    "device_names",
    "dtype_key",
    "load_catalogue",
]

#: The dtype names a device has a peak for.
DTYPES: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16")

_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
}  # fmt: skip


def dtype_key(dtype: object) -> str:
    """The catalogue's name for a dtype: ``"fp32"``, ``"tf32"``, ``"bf16"`` or ``"fp16"``.

    Example::

        >>> dtype_key("bfloat16"), dtype_key("torch.float32"), dtype_key("FP16")
        ('bf16', 'fp32', 'fp16')

    Args:
        dtype: a name such as ``"bf16"``, ``"float16"``, ``"torch.float32"``, or a
            ``torch.dtype`` (its ``str()`` is used).

    Raises:
        ValueError: the dtype has no peak in the catalogue; lists the known names.
    """
    key = _DTYPE_ALIASES.get(str(dtype).strip().lower())
    if key is None:
        known = ", ".join(sorted(_DTYPE_ALIASES))
        raise ValueError(f"unknown dtype {dtype!r}; known: {known}")
    return key


@dataclass(frozen=True, kw_only=True)
class Device:
    """One device type: what the cost model needs to price work on it.

    Attributes:
        key: catalogue key, e.g. ``"h100"``.
        name: human name, e.g. ``"NVIDIA H100 SXM5 80GB"``.
        kind: ``"gpu"`` or ``"cpu"``.
        memory_bytes: usable device memory.
        peak_flops: dense peak FLOP/s per dtype name (``DTYPES``).
        memory_bandwidth: device memory bandwidth, bytes/s.
        nvlink_bandwidth: NVLink bytes/s per device, both directions together as
            datasheets quote it (one direction gets half); 0 without NVLink.
        pcie_bandwidth: host-link bytes/s, both directions together. For the
            local CPU: the measured memory bandwidth (a copy between processes
            on one host goes through memory).
        compute_efficiency: achievable fraction of ``peak_flops``.
        memory_efficiency: achievable fraction of ``memory_bandwidth``.
        op_overhead_s: fixed cost of each operator that does work, seconds.
        source: where the numbers come from.
        cache_bytes: the local CPU's largest cache (shared by its cores), bytes;
            0 where unknown and for GPUs ([Note: the CPU optimizer step]).
        cache_bandwidth: the local CPU's copy bandwidth on data that stays in that
            cache, bytes/s (read + written), measured like ``memory_bandwidth``; 0
            where unknown and for GPUs.
    """

    key: str
    name: str
    kind: str
    memory_bytes: int
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    nvlink_bandwidth: float
    pcie_bandwidth: float
    compute_efficiency: float
    memory_efficiency: float
    op_overhead_s: float
    source: str
    cache_bytes: int = 0
    cache_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "cpu"):
            raise ValueError(f"device {self.key!r}: kind must be 'gpu' or 'cpu', got {self.kind!r}")
        if self.memory_bytes <= 0:
            raise ValueError(
                f"device {self.key!r}: memory_bytes must be > 0, got {self.memory_bytes}"
            )
        missing = [d for d in DTYPES if d not in self.peak_flops]
        if missing:
            raise ValueError(f"device {self.key!r}: peak_flops lacks {', '.join(missing)}")
        # A read-only copy: the record is frozen, so its mapping must be too.
        object.__setattr__(self, "peak_flops", types.MappingProxyType(dict(self.peak_flops)))

    def __hash__(self) -> int:
        # Written out because the generated hash would fail on the mapping field.
        return hash((self.key, self.memory_bytes, tuple(sorted(self.peak_flops.items()))))

    def flops_per_s(self, dtype: object) -> float:
        """Achievable FLOP/s for ``dtype``: peak × ``compute_efficiency``.

        Example::

            >>> default_catalogue().gpu("a100").flops_per_s("torch.bfloat16") == 312e12 * 0.65
            True

        Raises:
            ValueError: unknown dtype; the message lists the known names.
        """
        return self.peak_flops[dtype_key(dtype)] * self.compute_efficiency

    def with_memory(self, memory_bytes: int) -> Device:
        """The same device with a different memory size (a cluster file's override).

        Example::

            >>> default_catalogue().gpu("h100").with_memory(70 * 2**30).memory_bytes // 2**30
            70
        """
        return dataclasses.replace(self, memory_bytes=int(memory_bytes))


# --- loading -----------------------------------------------------------------------

_GPU_KEYS = {
    "name", "memory_gib", "peak_tflops", "memory_bandwidth_gbs", "nvlink_gbs",
    "pcie_gbs", "compute_efficiency", "memory_efficiency", "op_overhead_us", "source",
}  # fmt: skip
_OPTIONAL_KEYS = {"aliases", "cuda_names", "kind"}
_CPU_KEYS = {"name", "source"}
_DEFAULT_PATH = "planner/data/devices.yaml"


@dataclass(frozen=True)
class CpuEntry:
    """The catalogue's entry for the local CPU: its key, name and source (no figures)."""

    key: str
    name: str
    source: str


@dataclass(frozen=True)
class Catalogue:
    """A loaded, validated catalogue. Most code wants ``planner.devices.get_device``.

    Attributes:
        gpus: GPU devices by key.
        cpu: the measured-CPU entry (name and source), if the file has one.
        aliases: lower-case name or alias → key (keys map to themselves).
        cuda_names: lower-case ``torch.cuda.get_device_name()`` → key.
        path: the file it came from (for error messages).
    """

    gpus: Mapping[str, Device]
    cpu: CpuEntry | None
    aliases: Mapping[str, str]
    cuda_names: Mapping[str, str]
    path: str

    def names(self) -> list[str]:
        """Catalogue keys, sorted (aliases not included)."""
        keys = list(self.gpus) + ([self.cpu.key] if self.cpu else [])
        return sorted(keys)

    def key(self, name: str) -> str:
        """The catalogue key ``name`` means (a key or an alias, any case).

        Raises:
            ValueError: an unknown name; the message lists the known ones.
        """
        key = self.aliases.get(name.strip().lower())
        if key is None:
            close = difflib.get_close_matches(name.lower(), list(self.aliases), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"unknown device type {name!r}{hint}; known: {', '.join(self.names())} "
                f"(add an entry to {self.path})"
            )
        return key

    def is_cpu(self, name: str) -> bool:
        """Whether ``name`` is the local CPU's entry (measured, not read)."""
        return self.cpu is not None and self.key(name) == self.cpu.key

    def gpu(self, name: str) -> Device:
        """The GPU called ``name``.

        Raises:
            ValueError: an unknown name, or the CPU's entry (measured, not in
                the file: ``planner.devices.local.local_cpu``).
        """
        key = self.key(name)
        if key not in self.gpus:
            raise ValueError(
                f"device type {name!r} is the local CPU, measured here: use local_cpu() "
                "(planner.devices.local), or name a GPU"
            )
        return self.gpus[key]


def load_catalogue(path: str | Path | None = None) -> Catalogue:
    """Load and validate a device catalogue file.

    Example::

        >>> cat = load_catalogue()  # the packaged planner/data/devices.yaml
        >>> cat.get("v100").key
        'v100-32gb'

    Args:
        path: a YAML file in the format of ``planner/data/devices.yaml``; None
            for the packaged one.

    Raises:
        ValueError: a missing or malformed entry; the message names the entry
            and the key.
    """
    if path is None:
        text = importlib.resources.files("planner").joinpath("data", "devices.yaml").read_text()
        where = _DEFAULT_PATH
    else:
        text = Path(path).read_text()
        where = str(path)
    data = yaml.safe_load(text)
    if not isinstance(data, dict) or not isinstance(data.get("devices"), dict):
        raise ValueError(f"{where}: expected a mapping with a 'devices:' mapping at the top")
    gpus: dict[str, Device] = {}
    cpu: CpuEntry | None = None
    aliases: dict[str, str] = {}
    cuda_names: dict[str, str] = {}
    for raw_key, entry in data["devices"].items():
        key = str(raw_key).lower()
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: entry {key!r} must be a mapping of keys to values")
        kind = entry.get("kind", "gpu")
        if kind == "cpu":
            _check_keys(where, key, entry, _CPU_KEYS)
            cpu = CpuEntry(key=key, name=str(entry["name"]), source=str(entry["source"]))
        elif kind == "gpu":
            _check_keys(where, key, entry, _GPU_KEYS)
            gpus[key] = _gpu_from_entry(where, key, entry)
        else:
            raise ValueError(f"{where}: entry {key!r}: key 'kind' must be gpu or cpu, got {kind!r}")
        for alias in [key, *_str_list(where, key, entry, "aliases")]:
            other = aliases.setdefault(alias.lower(), key)
            if other != key:
                raise ValueError(f"{where}: name {alias!r} is used by both {other!r} and {key!r}")
        for cuda_name in _str_list(where, key, entry, "cuda_names"):
            cuda_names[cuda_name.lower()] = key
    return Catalogue(gpus=gpus, cpu=cpu, aliases=aliases, cuda_names=cuda_names, path=where)


def _check_keys(where: str, key: str, entry: Mapping[str, Any], required: set[str]) -> None:
    missing = sorted(required - set(entry))
    if missing:
        raise ValueError(f"{where}: entry {key!r} is missing key {missing[0]!r}")
    unknown = sorted(set(entry) - required - _OPTIONAL_KEYS)
    if unknown:
        allowed = ", ".join(sorted(required | _OPTIONAL_KEYS))
        raise ValueError(
            f"{where}: entry {key!r} has unknown key {unknown[0]!r} (allowed: {allowed})"
        )


def _str_list(where: str, key: str, entry: Mapping[str, Any], field: str) -> list[str]:
    value = entry.get(field, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: entry {key!r}: key {field!r} must be a list of strings")
    return value


def _number(where: str, key: str, field: str, value: object, *, zero_ok: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not (value >= 0 if zero_ok else value > 0):  # type: ignore[operator]
        need = "a number >= 0" if zero_ok else "a positive number"
        raise ValueError(f"{where}: entry {key!r}: key {field!r} must be {need}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _gpu_from_entry(where: str, key: str, entry: Mapping[str, Any]) -> Device:
    def num(field: str, **kw: bool) -> float:
        return _number(where, key, field, entry[field], **kw)

    peaks = entry["peak_tflops"]
    if not isinstance(peaks, dict):
        raise ValueError(f"{where}: entry {key!r}: key 'peak_tflops' must map dtypes to TFLOP/s")
    for dtype in DTYPES:
        if dtype not in peaks:
            raise ValueError(f"{where}: entry {key!r} is missing key 'peak_tflops.{dtype}'")
    peak_flops = {d: _number(where, key, f"peak_tflops.{d}", peaks[d]) * 1e12 for d in DTYPES}
    for field in ("compute_efficiency", "memory_efficiency"):
        if num(field) > 1:
            raise ValueError(f"{where}: entry {key!r}: key {field!r} is a fraction, must be <= 1")
    return Device(
        key=key,
        name=str(entry["name"]),
        kind="gpu",
        memory_bytes=int(num("memory_gib") * GIB),
        peak_flops=peak_flops,
        memory_bandwidth=num("memory_bandwidth_gbs") * 1e9,
        nvlink_bandwidth=num("nvlink_gbs", zero_ok=True) * 1e9,
        pcie_bandwidth=num("pcie_gbs") * 1e9,
        compute_efficiency=num("compute_efficiency"),
        memory_efficiency=num("memory_efficiency"),
        op_overhead_s=num("op_overhead_us") / 1e6,
        source=str(entry["source"]),
    )


@functools.cache
def default_catalogue() -> Catalogue:
    """The packaged catalogue (``planner/data/devices.yaml``), loaded once."""
    return load_catalogue()


def device_names() -> list[str]:
    """The catalogue's device keys, sorted.

    Example::

        >>> "h100" in device_names()
        True
    """
    return default_catalogue().names()
