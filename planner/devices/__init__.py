"""The devices a plan may use: the catalogue, this machine, clusters and cluster files.

``catalogue`` (datasheet figures, ``planner/data/devices.yaml``), ``local``
(this machine's CPU, measured, and its GPU), ``cluster`` (devices in nodes and
the links between them: what the cost model prices transfers with),
``build`` (``from_gpus``, and the assembly of any cluster), ``cluster_file``
(the YAML people write, and the exact form plan files keep).

Pure: no torch is loaded by importing it (measuring the local CPU loads it).
"""

from __future__ import annotations

from planner.devices.build import from_gpus
from planner.devices.catalogue import Device, device_names, dtype_key
from planner.devices.cluster import Cluster, ClusterDevice
from planner.devices.cluster_file import from_record, load_cluster, parse_cluster
from planner.devices.local import get_device, local_accelerator, local_cpu

__all__ = [
    "Cluster",
    "ClusterDevice",
    "Device",
    "device_names",
    "dtype_key",
    "from_gpus",
    "from_record",
    "get_device",
    "load_cluster",
    "local_accelerator",
    "local_cpu",
    "parse_cluster",
]
