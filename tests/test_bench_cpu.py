"""bench._common.cpu_figures: what a results file records of the CPU it ran on."""

from __future__ import annotations

import json
import os


def test_cpu_figures_measure_every_thread_count_afresh_and_restore_the_threads(
    monkeypatch, tmp_path
):
    """The figures a results file records come from a measurement now, not the planner's
    cache (which may hold another day's), at 1 thread and at every core."""
    import torch

    from bench._common import cpu_figures
    from planner import cache
    from planner.devices.local import local_cpu

    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path))
    local_cpu()  # the planner's cache now holds this process's figures
    for entry in tmp_path.glob("profile-*.json"):  # ... made 1000 times too fast
        data = json.loads(entry.read_text())
        data["memory_bandwidth"] *= 1000
        entry.write_text(json.dumps(data))
    before = torch.get_num_threads()
    figures = cpu_figures()
    assert torch.get_num_threads() == before
    assert set(figures) == {"1", str(os.cpu_count())}
    for f in figures.values():
        assert 0.1 < f["memory_gb_s"] < 5000 and f["op_us"] > 0 and f["fp32_gflop_s"] > 0
    assert cache.cache_dir() == tmp_path
