"""``--init-from`` in runs of two processes (gloo on CPU); one process: ``test_meta_build.py``.

* ``planner run --init-from`` (its file from ``planner init-weights``) trains
  the same losses as the full build, each rank filling its own stage;
* memory: a model whose full build exceeds the per-rank limit set here fits
  under it with ``init_from`` (the build's peak RSS, per rank);
* a one-stage plan (pp 1 × dp 2) fills the whole model on every replica.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from runs import RUN_TIMEOUT_S, planner_command
from torch import nn
from world import run_world

from planner.devices import from_gpus
from planner.options import PlanOptions, SearchOptions, Training
from planner.plan import load_plan, save_plan
from planner.plan.modelfile import load_model_file
from planner.planning import plan_model
from runtime.materialize import meta_parameters, write_weights

pytestmark = pytest.mark.multiprocess

TIED = """
import torch
import torch.nn.functional as F
from torch import nn

BATCH_SIZE = 8


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(0, 32, 2) / 32), False)
        self.fc0 = nn.Linear(32, 32)
        self.fc1 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(idx) * torch.cos(self.inv_freq).repeat(2)
        h = torch.relu(self.fc0(h))
        return self.head(torch.relu(self.fc1(h)))


def build_model():
    return Tied()


def sample_batch(batch_size):
    gen = torch.Generator().manual_seed(torch.initial_seed())
    idx = torch.randint(0, 64, (batch_size, 6), generator=gen)
    return idx, torch.roll(idx, 1, dims=1)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1))
"""


def test_planner_run_with_init_from_trains_the_same_losses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "tied.py").write_text(TIED)
    mf = load_model_file(tmp_path / "tied.py")
    sample = mf.sample(mf.batch_size)
    plan = plan_model(
        mf.build(),
        (sample.args[0], sample.targets),
        cluster=from_gpus(2, "cpu"),
        loss_fn=mf.loss,
        options=PlanOptions(
            training=Training(global_batch=mf.batch_size, optimizer="adam"),
            search=SearchOptions(pp=2, micro_batches=2, schedule="gpipe"),
        ),
        model_file="tied.py",
    )
    assert plan.split_points and plan.split_points[0] != "emb"
    save_plan(plan, tmp_path / "plan.yaml")
    _, env = planner_command([], {"PLANNER_CACHE_DIR": str(tmp_path / "cache")})
    init = [sys.executable, "-m", "planner", "init-weights", "tied.py", "--out", "init.st"]
    done = subprocess.run(
        [*init, "--seed", "5"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    runs = {}
    for label, extra in (("full", []), ("init", ["--init-from", "init.st"])):
        args = ["tied.py", "--plan", "plan.yaml", "--steps", "3", "--seed", "5", *extra]
        cmd, env = planner_command(args, {"PLANNER_CACHE_DIR": str(tmp_path / "cache")})
        cmd.insert(cmd.index("run"), "-v")  # the workers log at INFO: what each built
        done = subprocess.run(
            cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        runs[label] = re.findall(r"step \d+/3\s+loss (\S+)", out)
        built = re.findall(r"stage materialised on cpu: (\d+) tensors from init.st", out)
        assert len(built) == (2 if extra else 0), out  # each rank filled its own stage
    assert len(runs["full"]) == 3
    assert runs["init"] == runs["full"]  # printed to 6 decimals; the values are bit-equal


# --------------------------------------------------------------------------- memory

WIDTH, LAYERS = 4096, 6
MODEL_BYTES = LAYERS * WIDTH * WIDTH * 4  # fp32, no biases: 384 MiB
LIMIT_BYTES = MODEL_BYTES * 3 // 4
"""The per-rank limit on what building the stage may add to a rank's peak RSS."""


class Wide(nn.Module):
    """Six 4096 × 4096 layers: 384 MiB, 192 MiB a stage at pp 2."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _wide_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, WIDTH, generator=gen), torch.randn(4, WIDTH, generator=gen)


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


def _build_and_measure(plan_path: str, init: str | None) -> dict[str, Any]:
    """One rank: build (full or from ``init``); the build's peak RSS above the start."""
    from runtime.engine import ParallelModel

    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := RSS now
    start = _status("VmRSS")
    torch.manual_seed(0)
    with meta_parameters() if init else contextlib.nullcontext():
        model = Wide()
    x, y = _wide_batch()
    pm = ParallelModel.from_plan(
        model,
        load_plan(plan_path),
        loss_fn=F.mse_loss,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        sample=((x,), {}),
        init_from=init,
    )
    grown = _status("VmHWM") - start
    held = sum(t.numel() * t.element_size() for t in pm.stage.module.state_dict().values())
    loss = pm.step(x, y)
    pm.close()
    return {"grown": grown, "stage": held, "loss": loss}


def test_memory_per_rank_follows_its_stage_not_the_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    full = Wide()
    x, y = _wide_batch()
    plan = plan_model(
        full,
        (x, y),
        cluster=from_gpus(2, "cpu"),
        loss_fn=F.mse_loss,
        options=PlanOptions(
            training=Training(global_batch=4, optimizer="sgd"),
            search=SearchOptions(pp=2, micro_batches=2, schedule="gpipe"),
        ),
        model_file="Wide",
    )
    save_plan(plan, tmp_path / "plan.yaml")
    init = str(write_weights(full, tmp_path / "wide.safetensors"))
    del full
    runs = {
        label: run_world(
            _build_and_measure, 2, args=(str(tmp_path / "plan.yaml"), path), timeout_s=150
        )
        for label, path in (("full", None), ("init", init))
    }
    mib = 2**20
    for r in range(2):  # shown with -s: the figures the README quotes
        print(
            f"rank {r}: stage {runs['init'][r]['stage'] / mib:.0f} MiB; build peak RSS growth "
            f"full {runs['full'][r]['grown'] / mib:.0f} MiB, --init-from "
            f"{runs['init'][r]['grown'] / mib:.0f} MiB (limit {LIMIT_BYTES / mib:.0f} MiB)"
        )
    for r in range(2):
        stage = runs["init"][r]["stage"]
        assert stage < MODEL_BYTES * 0.8  # the split is uneven at most 4:2
        assert runs["full"][r]["grown"] > LIMIT_BYTES, runs["full"][r]  # over the limit
        assert runs["init"][r]["grown"] < LIMIT_BYTES, runs["init"][r]  # under it
        assert runs["init"][r]["grown"] < stage + 64 * 2**20, runs["init"][r]  # ∝ the stage
        assert runs["init"][r]["loss"] == runs["full"][r]["loss"]


def _small() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _whole_rank(plan_path: str, init: str | None) -> tuple[dict[str, torch.Tensor], float]:
    """pp = 1: the whole model is the stage; filled from ``init`` when given."""
    from runtime.engine import ParallelModel

    torch.manual_seed(0)
    with meta_parameters() if init else contextlib.nullcontext():
        model = _small()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    pm = ParallelModel.from_plan(
        model,
        load_plan(plan_path),
        loss_fn=F.mse_loss,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        sample=((x,), {}),
        init_from=init,
    )
    state = {k: v.detach().clone() for k, v in pm.stage_state_dict().items()}
    loss = pm.step(x, y)
    pm.close()
    return state, loss


def test_a_one_stage_plan_fills_the_whole_model_on_every_replica(tmp_path: Path) -> None:
    torch.manual_seed(0)
    full = _small()
    plan = plan_model(
        full,
        (torch.randn(8, 16), torch.randn(8, 4)),
        cluster=from_gpus(2, "cpu"),
        loss_fn=F.mse_loss,
        options=PlanOptions(
            training=Training(global_batch=8, optimizer="sgd"),
            search=SearchOptions(pp=1, dp=2, micro_batches=2, schedule="gpipe"),
        ),
        model_file="small",
    )
    assert plan.pp == 1 and plan.dp == 2
    save_plan(plan, tmp_path / "plan.yaml")
    init = str(write_weights(full, tmp_path / "small.safetensors"))
    args = (str(tmp_path / "plan.yaml"),)
    want = run_world(_whole_rank, 2, args=(*args, None), timeout_s=90)
    got = run_world(_whole_rank, 2, args=(*args, init), timeout_s=90)
    for (w_state, w_loss), (g_state, g_loss) in zip(want, got, strict=True):
        assert sorted(g_state) == sorted(w_state) == sorted(full.state_dict())
        assert all(torch.equal(g_state[k], w_state[k]) for k in w_state)
        assert g_loss == w_loss
