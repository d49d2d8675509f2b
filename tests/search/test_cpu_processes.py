"""Local CPU clusters: fewer processes than given, more torch threads each, never slower
than one process ([Note: fewer CPU processes] in planner.search.configurations)."""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from pathlib import Path

import pytest

from planner.cost.step_time import shared_cores_bound
from planner.devices import from_gpus
from planner.devices.build import assemble
from planner.devices.cluster import Cluster
from planner.options import SearchOptions, Training
from planner.plan.records import ModelProfile
from planner.search import search
from planner.search.configurations import configurations, thread_counts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from models import block_cost, model_profile
from runs import RUN_TIMEOUT_S, planner_command, planner_run


@pytest.fixture
def cores(monkeypatch: pytest.MonkeyPatch):
    """Pretend this machine has ``n`` cores (what a CPU cluster's processes share)."""

    def set_cores(n: int) -> None:
        monkeypatch.setattr("planner.devices.cluster.usable_cores", lambda: n)

    return set_cores


def _cpu(n: int, threads: int = 1) -> Cluster:
    """n local CPU processes of ``threads`` threads (the CPU as measured here)."""
    cpu = from_gpus(1, "cpu").devices[0].device
    return assemble(f"{n}xcpu", [[(cpu, threads)] * n], {})


def _with(cluster: Cluster, threads: int) -> Cluster:
    """The cluster's processes given ``threads`` threads (the device left as it is)."""
    devices = tuple(dataclasses.replace(d, threads=threads) for d in cluster.devices)
    return dataclasses.replace(cluster, devices=devices)


def _profile_for(speedup: dict[int, float], threads: int, n_blocks: int = 8):
    """Blocks of 2 ms + 1 ms per sample (forward and backward), sped up ``speedup[threads]``×
    by the threads, 1 MiB of activations per sample crossing each split."""

    def profile_for(device: str, b: int) -> ModelProfile:
        f = 1.0 / speedup[threads]
        blocks = [
            block_cost(
                k,
                fwd_ms=(1.0 + 0.3 * b) * f,
                bwd_ms=(1.0 + 0.7 * b) * f,
                activation_bytes=2**20 * b,
                output_bytes=2**20 * b,
                boundary_bytes=0 if k == 0 else 2**20 * b,
            )
            for k in range(n_blocks)
        ]
        return model_profile(
            blocks, device, source="measured", batch_size=b, threads=threads, fingerprint="x"
        )

    return profile_for


def _search(cluster: Cluster, speedup: dict[int, float], batch: int = 16, **pins):
    def threads_for(t: int):
        return _with(cluster, t), _profile_for(speedup, t)

    own = cluster.devices[0].threads
    return search(
        _profile_for(speedup, own),
        cluster,
        Training(global_batch=batch),
        SearchOptions(time_limit_s=10, **pins),
        n_blocks=8,
        threads_for=threads_for,
    )


def test_thread_counts_are_divisors_of_the_cores_that_fit(cores) -> None:
    cores(12)
    eight = _cpu(8)
    assert thread_counts(eight, 1) == [1, 2, 3, 4, 6, 12]
    assert thread_counts(eight, 5) == [1, 2]  # 5 · 3 > 12
    assert thread_counts(eight, 8) == [1]  # the cluster's own, even where 8 · 1 ≤ 12 only
    cores(2)
    assert thread_counts(_cpu(8), 8) == [1]  # oversubscribed: only the given threads
    assert thread_counts(_cpu(1, threads=2), 1) == [1, 2]
    assert thread_counts(from_gpus(8, "h100"), 1) == [0]  # GPUs: no threads


def test_cpu_clusters_may_use_fewer_processes_gpu_clusters_all(cores) -> None:
    cores(2)
    cpu = {
        (pp, dp)
        for pp, dp, _, _, _ in configurations(_cpu(8), Training(global_batch=8), SearchOptions())
    }
    assert cpu == {(pp, 1) for pp in range(1, 9)} | {(pp, 2) for pp in range(1, 5)} | {
        (1, 4),
        (2, 4),
        (1, 8),
    }
    gpu = configurations(from_gpus(16, "h100"), Training(global_batch=32), SearchOptions())
    assert {(pp, dp) for pp, dp, _, _, _ in gpu} == {(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)}
    # pp · dp = 16, m | 32 / dp, GPipe at every m, 1F1B at m ≥ pp > 1: not one more.
    assert len(gpu) == (2 + 0) + (3 + 2) + (4 + 2) + (5 + 2) + (6 + 2)


@pytest.mark.parametrize("speedup", [{1: 1.0, 2: 1.9}, {1: 1.0, 2: 1.0}, {1: 1.0, 2: 0.8}])
def test_never_slower_than_one_process(cores, speedup: dict[int, float]) -> None:
    cores(2)
    cluster = _cpu(8)
    res = _search(cluster, speedup)
    one = min(
        _search(cluster, speedup, pp=1, dp=1, micro_batches=m).prediction.step_ms
        for m in (1, 2, 4, 8, 16)
    )
    assert res.prediction.step_ms <= one
    used = res.cost.cluster
    threads = used.devices[0].threads
    assert used.n_devices == res.layout.pp * res.layout.dp < 8  # fewer: 8 on 2 cores lose
    assert threads in (1, 2) and used.n_devices * threads <= 2
    chosen = next(c for c in res.candidates if c.status == "chosen")
    assert f"{threads} thread" in chosen.reason
    assert any(c.pp == c.dp == 1 for c in res.candidates)  # the one-process row is kept
    if (res.layout.pp, res.layout.dp) != (1, 1):
        assert "one process" in chosen.reason  # and the chosen one says why it beat it
    assert any("of the 8 CPU processes given" in w for w in res.warnings)


def test_threads_win_when_they_pay(cores) -> None:
    cores(2)
    res = _search(_cpu(8), {1: 1.0, 2: 1.95})
    assert (res.layout.pp, res.layout.dp, res.cost.cluster.devices[0].threads) == (1, 1, 2)


def test_shared_cores_bound_holds_on_the_simulated_step(cores) -> None:
    cores(2)
    res = _search(_cpu(8), {1: 1.0, 2: 1.0}, pp=4, dp=2, micro_batches=2)
    prof = res.cost.profile
    total = sum(b.fwd_ms + b.bwd_ms for b in prof.blocks) + prof.loss_fwd_ms + prof.loss_bwd_ms
    bound = shared_cores_bound(total, 4, 2, 2, threads=1, cores=2)
    assert total < bound <= res.prediction.step_ms


PLAN = [sys.executable, "-m", "planner", "plan"]
MODEL = """
import os
from pathlib import Path

import torch
from torch import nn

BATCH_SIZE = 8


def build_model():
    out = os.environ.get("THREADS_OUT")
    if out:  # what each worker of `planner run` runs with
        rank = os.environ["RANK"]
        Path(out, rank).write_text(f"{torch.get_num_threads()} {os.environ['OMP_NUM_THREADS']}")
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def sample_batch(n):
    g = torch.Generator().manual_seed(torch.initial_seed())
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)
"""


@pytest.mark.timeout(RUN_TIMEOUT_S + 240)
def test_plan_and_run_on_fewer_cpu_processes(tmp_path: Path) -> None:
    """`planner plan --gpus 4` of a tiny model on this machine picks fewer processes;
    `planner run` starts that many, each with the plan's torch threads."""
    import subprocess

    from planner.devices.local import usable_cores
    from planner.plan import load_plan

    (tmp_path / "tiny.py").write_text(textwrap.dedent(MODEL))
    env = {"PLANNER_CACHE_DIR": str(tmp_path / "cache")}
    _, full_env = planner_command([], env)
    proc = subprocess.run(
        [*PLAN, "tiny.py", "--gpus", "4", "--repeats", "2", "--warmup", "1", "--out", "plan.yaml"],
        env=full_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    plan = load_plan(tmp_path / "plan.yaml")
    n = plan.pp * plan.dp
    groups = [g for node in plan.cluster.nodes for g in node.devices]
    assert sum(g.count for g in groups) == n  # the plan's cluster: the processes it runs
    threads = groups[0].threads
    cores = usable_cores()
    if cores < 4:  # 4 processes share fewer cores: fewer of them win on a tiny model
        assert n < 4, proc.stdout
    assert cores % threads == 0 and n * threads <= max(cores, n)
    assert {p.threads for p in plan.profiles} == {threads}  # measured at the threads it runs
    (tmp_path / "threads").mkdir()
    rc, out, _ = planner_run(
        ["tiny.py", "--plan", "plan.yaml", "--steps", "2"],
        {**env, "THREADS_OUT": str(tmp_path / "threads")},
        tmp_path,
    )
    assert rc == 0, out
    seen = {p.name: p.read_text() for p in (tmp_path / "threads").iterdir()}
    assert seen == {str(r): f"{threads} {threads}" for r in range(n)}
