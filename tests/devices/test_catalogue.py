"""Tests for planner.devices.catalogue and .local: the device catalogue and the measured CPU."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import yaml

from planner.devices import catalogue
from planner.devices.catalogue import DTYPES, Device, device_names, dtype_key, load_catalogue
from planner.devices.local import forget_measurements, get_device, local_accelerator, local_cpu

GPUS = ["a100-40gb", "a100-80gb", "h100", "h200", "v100-16gb", "v100-32gb", "l4"]
GIB = 2**30


def test_names_cover_the_catalogue():
    assert device_names() == sorted([*GPUS, "cpu"])


@pytest.mark.parametrize("key", GPUS)
def test_every_gpu_entry_loads_with_positive_numbers(key):
    dev = get_device(key)
    assert dev.key == key and dev.kind == "gpu" and dev.name and dev.source
    assert dev.memory_bytes > 0
    assert set(dev.peak_flops) == set(DTYPES)
    assert all(v > 0 for v in dev.peak_flops.values())
    assert dev.memory_bandwidth > 0 and dev.pcie_bandwidth > 0 and dev.nvlink_bandwidth >= 0
    assert 0 < dev.compute_efficiency <= 1 and 0 < dev.memory_efficiency <= 1
    assert 0 < dev.op_overhead_s < 1e-3
    # Tensor cores never lose to plain fp32.
    assert dev.peak_flops["bf16"] >= dev.peak_flops["fp32"]
    assert dev.peak_flops["fp16"] >= dev.peak_flops["tf32"] >= dev.peak_flops["fp32"]


def test_known_datasheet_values():
    h100 = get_device("h100")
    assert h100.peak_flops["bf16"] == 989e12
    assert h100.peak_flops["fp32"] == 67e12
    assert h100.peak_flops["tf32"] == 494.5e12
    assert h100.memory_bandwidth == 3350e9
    assert h100.nvlink_bandwidth == 900e9
    assert get_device("a100-80gb").memory_bytes == 80 * GIB
    assert get_device("a100-40gb").memory_bytes == 40 * GIB
    assert get_device("a100-80gb").peak_flops["bf16"] == 312e12
    assert get_device("h200").memory_bandwidth == 4800e9
    assert get_device("h200").memory_bytes == pytest.approx(140.4 * GIB)
    assert get_device("h200").peak_flops == get_device("h100").peak_flops
    assert get_device("v100-32gb").peak_flops["fp16"] == 125e12
    assert get_device("l4").nvlink_bandwidth == 0
    assert get_device("l4").peak_flops["bf16"] == 121e12


def test_flops_per_s_is_peak_times_efficiency_and_accepts_dtype_aliases():
    h100 = get_device("h100")
    expected = 989e12 * h100.compute_efficiency
    for name in ("bf16", "bfloat16", "torch.bfloat16", "BF16"):
        assert h100.flops_per_s(name) == expected
    assert h100.flops_per_s("float32") == h100.flops_per_s("fp32") == 67e12 * 0.65
    with pytest.raises(ValueError, match=r"unknown dtype 'fp8'.*bf16.*fp32"):
        h100.flops_per_s("fp8")


def test_dtype_key_takes_torch_dtypes():
    import torch

    assert dtype_key(torch.float16) == "fp16"
    assert dtype_key(torch.float32) == "fp32"


@pytest.mark.parametrize(
    ("alias", "key"),
    [
        ("A100", "a100-80gb"),
        ("a100-sxm4-40gb", "a100-40gb"),
        ("V100", "v100-32gb"),
        ("h100-sxm", "h100"),
        ("H100-80GB", "h100"),
        (" H200 ", "h200"),
        ("local-cpu", "cpu"),
    ],
)
def test_aliases_are_case_insensitive(alias, key):
    assert get_device(alias).key == key


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError) as err:
        get_device("h1000")
    msg = str(err.value)
    assert "unknown device type 'h1000'" in msg
    assert "known: a100-40gb, a100-80gb, cpu, h100" in msg
    assert "planner/data/devices.yaml" in msg


def test_with_memory_overrides_only_memory():
    h100 = get_device("h100")
    small = h100.with_memory(70 * GIB)
    assert small.memory_bytes == 70 * GIB
    assert small.peak_flops == h100.peak_flops and small.key == "h100"
    assert h100.memory_bytes != small.memory_bytes  # the original is untouched
    with pytest.raises(ValueError, match="memory_bytes must be > 0"):
        h100.with_memory(0)


def test_devices_are_frozen_and_hashable():
    h100 = get_device("h100")
    with pytest.raises(AttributeError):
        h100.memory_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        h100.peak_flops["bf16"] = 1.0  # type: ignore[index]
    assert len({h100, get_device("h100-sxm"), get_device("h200")}) == 2


def _write(tmp_path: Path, devices: dict) -> Path:
    path = tmp_path / "devices.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "devices": devices}))
    return path


def _packaged_entry(key: str) -> dict:
    text = Path(catalogue.__file__).parents[1].joinpath("data", "devices.yaml").read_text()
    return dict(yaml.safe_load(text)["devices"][key])


def test_load_catalogue_from_a_path(tmp_path):
    entry = _packaged_entry("l4")
    cat = load_catalogue(_write(tmp_path, {"my-gpu": {**entry, "aliases": ["mine"]}}))
    assert cat.names() == ["my-gpu"]
    assert cat.gpu("MINE").peak_flops["bf16"] == 121e12


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"memory_gib": -1}, "entry 'bad-gpu': key 'memory_gib' must be a positive number"),
        ({"memory_gib": "lots"}, "entry 'bad-gpu': key 'memory_gib' must be a positive number"),
        (
            {"peak_tflops": {"fp32": 1, "tf32": 1, "bf16": 1}},
            "'bad-gpu' is missing key 'peak_tflops.fp16'",
        ),
        ({"peak_tflops": {"fp32": 1, "tf32": 1, "bf16": 0, "fp16": 1}}, "key 'peak_tflops.bf16'"),
        ({"compute_efficiency": 1.5}, "entry 'bad-gpu': key 'compute_efficiency' is a fraction"),
        ({"nvlink_gbs": -5}, "entry 'bad-gpu': key 'nvlink_gbs' must be a number >= 0"),
        ({"memroy_gib": 3}, "entry 'bad-gpu' has unknown key 'memroy_gib'"),
        ({"aliases": "x"}, "entry 'bad-gpu': key 'aliases' must be a list of strings"),
    ],
)
def test_malformed_entry_names_entry_and_key(tmp_path, change, message):
    entry = {**_packaged_entry("h100"), **change}
    with pytest.raises(ValueError, match=message):
        load_catalogue(_write(tmp_path, {"bad-gpu": entry}))


def test_missing_key_is_named(tmp_path):
    entry = _packaged_entry("h100")
    del entry["memory_bandwidth_gbs"]
    with pytest.raises(ValueError, match="entry 'h100' is missing key 'memory_bandwidth_gbs'"):
        load_catalogue(_write(tmp_path, {"h100": entry}))


def test_duplicate_alias_is_refused(tmp_path):
    a, b = _packaged_entry("h100"), _packaged_entry("h200")
    b["aliases"] = ["h100-sxm"]
    with pytest.raises(ValueError, match="'h100-sxm' is used by both 'h100' and 'h200'"):
        load_catalogue(_write(tmp_path, {"h100": a, "h200": b}))


def test_local_cpu_is_measured_positive_and_cached():
    cpu = local_cpu()
    assert cpu.kind == "cpu" and cpu.key == "cpu"
    assert cpu.memory_bytes > 2**28
    assert all(v > 1e8 for v in cpu.peak_flops.values())  # > 0.1 GFLOP/s
    assert cpu.peak_flops["tf32"] == cpu.peak_flops["fp32"]
    assert cpu.memory_bandwidth > 1e8 and cpu.pcie_bandwidth > 0
    assert cpu.compute_efficiency == cpu.memory_efficiency == 1.0
    assert 0 < cpu.op_overhead_s < 1e-3
    assert math.isclose(cpu.flops_per_s("fp32"), cpu.peak_flops["fp32"])
    assert local_cpu() is cpu
    assert get_device("cpu") is cpu


def test_local_cpu_measures_outside_meta_device_and_modes(tmp_path, monkeypatch):
    import torch

    from planner.profile.analytic import OpCostMode

    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path))  # measure, not read the cache
    forget_measurements()
    start = time.perf_counter()
    with torch.device("meta"), OpCostMode() as mode:
        cpu = local_cpu()
    # The budget is 1 s (0.2 s on a 2-core CI machine); slack for a loaded one.
    assert time.perf_counter() - start < 2.0
    assert cpu.peak_flops["fp32"] > 1e8
    assert mode.total.ops == 0


def test_local_cpu_speed_is_kept_in_the_cache_and_leaves_the_rng_alone(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path))
    forget_measurements()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = local_cpu()
    assert torch.equal(torch.get_rng_state(), before)
    assert len(list(tmp_path.glob("profile-*.json"))) == 1
    # Another process (the in-process caches cleared) reads the same numbers back.
    forget_measurements()
    again = local_cpu()
    assert again.peak_flops == first.peak_flops
    assert again.memory_bandwidth == first.memory_bandwidth
    assert again.op_overhead_s == first.op_overhead_s
    forget_measurements()


def test_local_accelerator_is_none_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert local_accelerator() is None


def test_local_accelerator_matches_the_cuda_name(monkeypatch):
    import torch

    class Props:
        total_memory = 85_000_000_000

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100 80GB HBM3")
    dev = local_accelerator()
    assert dev is not None and dev.key == "h100" and dev.memory_bytes == 85_000_000_000
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA A100-SXM4-40GB")
    assert local_accelerator().key == "a100-40gb"  # type: ignore[union-attr]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100 PCIe")
    with pytest.raises(ValueError, match=r"'NVIDIA H100 PCIe' is not in the device catalogue"):
        local_accelerator()


def test_device_rejects_bad_kind():
    with pytest.raises(ValueError, match="kind must be 'gpu' or 'cpu'"):
        Device(
            key="x", name="x", kind="tpu", memory_bytes=1,
            peak_flops=dict.fromkeys(DTYPES, 1.0), memory_bandwidth=1.0,
            nvlink_bandwidth=0.0, pcie_bandwidth=1.0, compute_efficiency=1.0,
            memory_efficiency=1.0, op_overhead_s=0.0, source="test",
        )  # fmt: skip


def test_a_machine_whose_speed_moved_since_its_figures_were_cached_says_so(
    tmp_path, monkeypatch, caplog
):
    """The cached figures still price the run (runs agree); the warning gives both figures,
    the ratio, and the cache file to delete."""
    from planner.devices import cpu_speed

    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path))
    forget_measurements()
    first = local_cpu()
    bw, op = first.memory_bandwidth, first.op_overhead_s
    for speed, warned in (((bw * 1.2, op * 0.8), False), ((bw / 2, op * 2.2), True)):
        monkeypatch.setattr(cpu_speed, "quick_speed", lambda speed=speed: speed)
        forget_measurements()
        caplog.clear()
        with caplog.at_level("WARNING", logger="planner.devices.cpu_speed"):
            again = local_cpu()
        assert (again.memory_bandwidth, again.op_overhead_s) == (bw, op)
        text = caplog.text
        assert ("no longer runs at the speed" in text) is warned
        if warned:
            assert f"({0.5:.2f}×)" in text and f"({2.2:.2f}×)" in text
            assert f"{bw / 2e9:.2f} GB/s now, {bw / 1e9:.2f} GB/s cached" in text
            assert str(next(tmp_path.glob("profile-*.json"))) in text
    forget_measurements()


def test_a_transient_slow_reading_is_read_again_before_a_drift_is_said(
    tmp_path, monkeypatch, caplog
):
    """[Note: a transient slow spell]: one slow reading, then two at the cached speed."""
    from planner.devices import cpu_speed

    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path))
    forget_measurements()
    first = local_cpu()
    bw, op = first.memory_bandwidth, first.op_overhead_s
    readings = iter([(bw, op * 2.1), (bw, op * 1.05), (bw * 0.9, op)])
    monkeypatch.setattr(cpu_speed, "quick_speed", lambda: next(readings))
    forget_measurements()
    with caplog.at_level("WARNING", logger="planner.devices.cpu_speed"):
        local_cpu()
    assert "no longer runs at the speed" not in caplog.text
    assert next(readings, None) is None  # all three were read
    forget_measurements()
