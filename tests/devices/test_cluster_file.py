"""Tests for planner.devices.cluster_file: the cluster file format, and the plan's exact record."""

from __future__ import annotations

import os

import pytest
import yaml
from repo import CLUSTERS

from planner.devices.build import from_gpus
from planner.devices.cluster_file import from_record, load_cluster, parse_cluster
from planner.devices.local import get_device, local_cpu
from planner.plan.codec import encode

GIB = 2**30
EXAMPLES = CLUSTERS  # the cluster files among the examples


# --- plan-file round trip ----------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: load_cluster(EXAMPLES / "2x8xh100.yaml"),
        lambda: load_cluster(EXAMPLES / "mixed-a100-v100.yaml"),
        lambda: from_gpus(3, "a100", memory_gib=33.3),
        lambda: from_gpus(2, "cpu"),
        lambda: parse_cluster({"nodes": [{"type": "l4", "count": 3}, {"type": "l4"}]}),
    ],
)
def test_record_round_trip(make):
    c = make()
    data = encode(c.to_record())
    assert list(data) == ["name", "backend", "nodes", "links"]
    text = yaml.safe_dump(data, sort_keys=False)
    assert yaml.safe_dump(encode(make().to_record()), sort_keys=False) == text  # deterministic
    back = from_record(yaml.safe_load(text))
    assert back == c and hash(back) == hash(c)
    assert yaml.safe_dump(encode(back.to_record()), sort_keys=False) == text


def test_record_groups_equal_devices():
    data = encode(load_cluster(EXAMPLES / "mixed-a100-v100.yaml").to_record())
    assert data["nodes"] == [
        {
            "devices": [
                {"type": "a100-80gb", "count": 4, "memory_bytes": 80 * GIB, "threads": 0},
                {
                    "type": "v100-32gb",
                    "count": 4,
                    "memory_bytes": get_device("v100-32gb").memory_bytes,
                    "threads": 0,
                },
            ],
            "repeat": 1,
        }
    ]
    assert data["links"]["intra_node_bandwidth"] == 16e9


def test_record_writes_equal_nodes_in_a_row_once():
    mixed = {
        "nodes": [
            {"type": "h100", "count": 8, "repeat": 3},
            {"type": "a100", "count": 4},
            {"type": "h100", "count": 8},
            {"type": "h100", "count": 8},
        ]
    }
    c = parse_cluster(mixed)
    data = encode(c.to_record())
    assert [(n["devices"][0]["type"], n["repeat"]) for n in data["nodes"]] == [
        ("h100", 3),
        ("a100-80gb", 1),
        ("h100", 2),
    ]
    back = from_record(yaml.safe_load(yaml.safe_dump(data)))
    assert back == c and back.n_nodes == 6 and back.n_devices == 44
    assert back.describe() == c.describe()
    record = c.to_record()
    assert [record.device(r).type for r in (0, 23, 24, 27, 28, 43)] == [
        "h100", "h100", "a100-80gb", "a100-80gb", "h100", "h100",
    ]  # fmt: skip
    assert record.device(44) is None
    # 10,000 nodes: one record, a few lines of YAML, not 10,000 of them.
    big = parse_cluster({"nodes": [{"type": "h100", "count": 1, "repeat": 10_000}]})
    text = yaml.safe_dump(encode(big.to_record()))
    assert len(text.splitlines()) < 20 and from_record(yaml.safe_load(text)) == big


@pytest.mark.parametrize(
    ("repeat", "match"),
    [
        (0, r"cluster\.nodes\[0\]\.repeat: must be a whole number >= 1, got 0"),
        ("2", r"cluster\.nodes\[0\]\.repeat"),
        (20_000, r"cluster\.nodes\[0\]: brings the cluster to 160,000 devices"),
    ],
)
def test_record_repeat_is_checked(repeat, match):
    data = encode(from_gpus(16, "h100").to_record())
    data["nodes"][0]["repeat"] = repeat
    with pytest.raises(ValueError, match=match):
        from_record(data)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d.update(backend="gloo"), r"cluster\.backend: 'gloo' does not fit"),
        (lambda d: d["nodes"][0].update(type="h100"), r"cluster\.nodes\[0\]\.type: unknown key"),
        (lambda d: d["links"].update(intra_node_gbs=1), r"cluster\.links\.intra_node_gbs"),
        (
            lambda d: d["nodes"][0]["devices"][0].update(threads=2),
            r"cluster\.nodes\[0\]\.devices\[0\]\.threads: only CPU",
        ),
    ],
)
def test_record_errors_name_the_key_path(change, match):
    data = encode(from_gpus(16, "h100").to_record())
    change(data)
    with pytest.raises(ValueError, match=match):
        from_record(data)


# --- cluster-file validation -------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", r"cluster\.nodes: the cluster is empty.*add e\.g\."),
        ("nodes: []", r"cluster\.nodes: the cluster is empty"),
        ("- type: h100", r"cluster: expected a mapping"),
        ("nodes: {type: h100}", r"cluster\.nodes: must be a list"),
        (
            "nodez: []",
            r"cluster\.nodez: unknown key 'nodez'; allowed here: name, nodes, links",
        ),
        (
            "nodes: [{type: h100, cuont: 8}]",
            r"cluster\.nodes\[0\]\.cuont: unknown key 'cuont'; allowed here: type, count, "
            r"memory_gib, threads, repeat",
        ),
        (
            "nodes: [{type: h100}, {devices: [{type: h100, repeat: 2}]}]",
            r"cluster\.nodes\[1\]\.devices\[0\]\.repeat: unknown key 'repeat'",
        ),
        (
            "nodes: [{type: h100}, {devices: [{type: h1000}]}]",
            r"cluster\.nodes\[1\]\.devices\[0\]\.type: unknown device type 'h1000'.*known: "
            r"a100-40gb, .*h100",
        ),
        ("nodes: [{count: 8}]", r"cluster\.nodes\[0\]: no 'type:' key.*one of a100-40gb"),
        ("nodes: [{type: h100, count: 0}]", r"cluster\.nodes\[0\]\.count: must be a whole"),
        ("nodes: [{type: h100, count: 2.5}]", r"cluster\.nodes\[0\]\.count: must be a whole"),
        ("nodes: [{type: h100, repeat: -1}]", r"cluster\.nodes\[0\]\.repeat: must be a whole"),
        ("nodes: [{devices: []}]", r"cluster\.nodes\[0\]\.devices: must be a non-empty list"),
        (
            "nodes: [{type: h100, devices: [{type: h100}]}]",
            r"cluster\.nodes\[0\]: has both 'type:' and 'devices:'",
        ),
        (
            "nodes: [{type: h100, memory_gib: 0}]",
            r"cluster\.nodes\[0\]\.memory_gib: 0 GiB is out of range: memory per device must "
            r"lie in 0\.0009765625 \.\. 1048576 GiB \(1 MiB \.\. 1 PiB\); give the datasheet",
        ),
        (
            "nodes: [{type: h100}]\nlinks: {intra_node_gbs: -5}",
            r"cluster\.links\.intra_node_gbs: -5 GB/s is out of range: a link's bandwidth must "
            r"lie in 0\.001 \.\. 100000 GB/s \(1 MB/s \.\. 100 TB/s\)",
        ),
        (
            "nodes: [{type: h100}]\nlinks: {inter_node_gbs: 0}",
            r"cluster\.links\.inter_node_gbs: 0 GB/s is out of range",
        ),
        (
            "nodes: [{type: h100}]\nlinks: {inter_node_latency_us: -1}",
            r"cluster\.links\.inter_node_latency_us: -1 µs is out of range: a link's latency "
            r"must lie in 0 \.\. 10000000 µs \(0 \.\. 10 s\)",
        ),
        (
            "nodes: [{type: h100}]\nlinks: {inter_node_gbs: fast}",
            r"cluster\.links\.inter_node_gbs: str 'fast' is out of range",
        ),
        (
            "nodes: [{type: h100}]\nlinks: {intra_node_gbps: 5}",
            r"cluster\.links\.intra_node_gbps: unknown key.*allowed here: intra_node_gbs",
        ),
        (
            "nodes: [{type: h100, threads: 4}]",
            r"cluster\.nodes\[0\]\.threads: only CPU devices have threads",
        ),
        (
            "nodes: [{type: h100}, {devices: [{type: h100}, {type: cpu}]}]",
            r"cluster\.nodes\[1\]\.devices\[1\]\.type: a CPU device, but "
            r"cluster\.nodes\[0\]\.type is a GPU.*one backend",
        ),
        ("name: ''\nnodes: [{type: h100}]", r"cluster\.name: must be a non-empty string"),
        (
            "nodes: [{type: cpu, repeat: 2}]",
            r"cluster\.links\.inter_node_gbs: missing: CPU nodes have no default",
        ),
    ],
)
def test_validation_errors_name_the_key_path(tmp_path, text, match):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        load_cluster(path)
    assert str(info.value).startswith(f"{path}: cluster")


def test_python_tags_are_refused(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("nodes: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(ValueError, match=r"(?s)python/object.*only plain YAML"):
        load_cluster(path)
    path.write_text(
        "name: !!python/object:planner.devices.cluster.Cluster {}\nnodes: [{type: h100}]\n"
    )
    with pytest.raises(ValueError, match="only plain YAML"):
        load_cluster(path)


def test_cpu_nodes_split_ram_and_cores_by_default():
    c = parse_cluster({"nodes": [{"type": "cpu", "count": 2}]})
    assert all(d.threads == max(1, len(os.sched_getaffinity(0)) // 2) for d in c.devices)
    assert all(d.device.memory_bytes == local_cpu().memory_bytes // 2 for d in c.devices)
    c = parse_cluster(
        {
            "nodes": [{"type": "cpu", "threads": 1, "memory_gib": 2, "repeat": 2}],
            "links": {"inter_node_gbs": 1.25},
        }
    )
    assert c.backend == "gloo" and c.devices_per_node() == [1, 1]
    assert c.inter_node_bandwidth == 1.25e9
    assert all(d.threads == 1 and d.device.memory_bytes == 2 * GIB for d in c.devices)


# --- ranges: sizes, counts and threads bounded, with the key path --------------------


@pytest.mark.parametrize(
    ("text", "match"),
    [
        # issue 15: 1e+300 overflowed into an OverflowError; 1e-300 and 1e+300 on links
        # reached the solver as coefficients near 1e290.
        (
            "nodes: [{devices: [{type: h100, memory_gib: 1.0e+300}]}]",
            r"cluster\.nodes\[0\]\.devices\[0\]\.memory_gib: 1e\+300 GiB is out of range: "
            r"memory per device must lie in 0\.0009765625 \.\. 1048576 GiB",
        ),
        (
            "nodes: [{type: h100, memory_gib: 1.0e-300}]",
            r"memory_gib: 1e-300 GiB is out of range",
        ),
        (
            "nodes: [{type: h100, memory_gib: " + "9" * 400 + "}]",  # an int no float holds
            r"memory_gib: 9{400} GiB is out of range",
        ),
        ("nodes: [{type: h100, memory_gib: .nan}]", r"memory_gib: nan GiB is out of range"),
        (
            "nodes: [{type: h100}]\nlinks: {intra_node_gbs: 1.0e+300}",
            r"cluster\.links\.intra_node_gbs: 1e\+300 GB/s is out of range: a link's bandwidth "
            r"must lie in 0\.001 \.\. 100000 GB/s",
        ),
        (
            "nodes: [{type: h100}]\nlinks: {inter_node_gbs: 1.0e-300}",
            r"cluster\.links\.inter_node_gbs: 1e-300 GB/s is out of range",
        ),
        (
            "nodes: [{type: h100}]\nlinks: {intra_node_latency_us: 1.0e+300}",
            r"cluster\.links\.intra_node_latency_us: 1e\+300 µs is out of range",
        ),
        (
            "nodes: [{type: h100}]\nlinks: {intra_node_latency_us: .inf}",
            r"intra_node_latency_us: inf µs is out of range",
        ),
        # YAML 1.1 reads 1.0e300 (no sign in the exponent) and 1e3 (no dot) as text.
        (
            "nodes: [{type: h100, memory_gib: 1.0e300}]",
            r"memory_gib: '1\.0e300' is text, not a number: YAML 1\.1 reads a number with an "
            r"exponent only with a dot and a signed exponent; write 1\.0e\+300 \(memory per",
        ),
        ("nodes: [{type: h100}]\nlinks: {inter_node_gbs: 5e1}", r"'5e1' is text.*write 5\.0e\+1"),
        ("nodes: [{type: h100}]\nlinks: {inter_node_gbs: -.5E-3}", r"write -0\.5e-3"),
        # Counts: at least 1, and at most 131,072 devices in all, refused before any list.
        (
            "nodes: [{type: h100, count: 1000000000}]",
            r"cluster\.nodes\[0\]\.count: 1,000,000,000 is more than the 131,072 devices a "
            r"cluster may hold; plan a part of the cluster",
        ),
        (
            "nodes: [{type: h100, count: 8, repeat: 100000}]",
            r"cluster\.nodes\[0\]: brings the cluster to 800,000 devices \(100,000 node\(s\) of "
            r"8 here\), more than the 131,072 a cluster may hold",
        ),
        (
            "nodes: [{type: h100, count: 65536}, {devices: [{type: h100, count: 65536}, "
            "{type: l4}]}]",
            r"cluster\.nodes\[1\]: brings the cluster to 131,073 devices \(1 node\(s\) of 65,537",
        ),
        ("nodes: [{type: h100, repeat: 0}]", r"cluster\.nodes\[0\]\.repeat: must be a whole"),
        # Threads for a local CPU device: at most this machine's cores.
        (
            "nodes: [{type: cpu, threads: 1000000000}]",
            rf"cluster\.nodes\[0\]\.threads: 1,000,000,000 threads is more than the "
            rf"{len(os.sched_getaffinity(0))} core\(s\) this process may use "
            rf"\(os\.sched_getaffinity\).*give at most {len(os.sched_getaffinity(0))}",
        ),
        ("nodes: [{type: cpu, threads: 0}]", r"threads: must be a whole number >= 1, got 0"),
    ],
)
def test_out_of_range_values_are_refused_with_the_range(tmp_path, text, match):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_cluster(path)


def test_the_range_ends_are_accepted():
    c = parse_cluster(
        {
            "nodes": [
                {"type": "h100", "memory_gib": 2**-10},
                {"type": "h100", "memory_gib": 2**20},
            ],
            "links": {
                "intra_node_gbs": 1e5,
                "inter_node_gbs": 1e-3,
                "intra_node_latency_us": 0,
                "inter_node_latency_us": 1e7,
            },
        }
    )
    assert [d.device.memory_bytes for d in c.devices] == [2**20, 2**50]
    assert (c.intra_node_bandwidth, c.inter_node_bandwidth) == (1e14, 1e6)
    assert (c.intra_node_latency_s, c.inter_node_latency_s) == (0.0, 10.0)
    assert (
        parse_cluster({"nodes": [{"type": "l4", "count": 2**16, "repeat": 2}]}).n_devices == 2**17
    )
    cores = len(os.sched_getaffinity(0))
    assert parse_cluster({"nodes": [{"type": "cpu", "threads": cores}]}).devices[0].threads == cores


def test_plan_records_are_held_to_the_same_ranges():
    data = encode(from_gpus(2, "h100").to_record())
    data["links"]["inter_node_bandwidth"] = 1e-300
    with pytest.raises(
        ValueError,
        match=r"cluster\.links\.inter_node_bandwidth: 1e-300 bytes/s is out of range: a link's "
        r"bandwidth must lie in 1000000 \.\. 1e\+14 bytes/s",
    ):
        from_record(data)
    data = encode(from_gpus(2, "cpu").to_record())
    data["nodes"][0]["devices"][0]["threads"] = 10**9
    with pytest.raises(
        ValueError,
        match=r"devices\[0\]\.threads: 1,000,000,000 threads is more "
        r"than the cap of 1024",
    ):
        from_record(data)


def test_equal_nodes_share_one_device_record():
    c = parse_cluster(
        {"nodes": [{"type": "h100", "memory_gib": 70, "repeat": 3}, {"type": "h100"}]}
    )
    assert c.devices[0].device is c.devices[2].device
    assert c.devices[3].device.memory_bytes != 70 * GIB


def test_record_finds_the_group_of_every_rank():
    c = parse_cluster(
        {
            "nodes": [
                {"devices": [{"type": "h100", "count": 2}, {"type": "l4"}]},
                {"type": "v100", "count": 3, "repeat": 2},
            ]
        }
    )
    record = c.to_record()
    assert [record.device(d.rank).type for d in c.devices] == [d.device.key for d in c.devices]
    assert record.device(c.n_devices) is None and record.device(-1) is None
