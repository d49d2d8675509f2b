"""``planner run`` on a model file's ``dataset()`` (runtime/data.py), and on the README's pattern.

A 40-sample dataset, global batch 8 (5 steps per epoch), planned for dp 2 on
two local CPU devices, trains through ``planner run`` three times:

* straight, steps 1-7 (it crosses into epoch 1 at step 6), each rank writing
  the index of every sample it reads (``DATA_LOG``) and its losses
  (``--step-log``);
* steps 1-3 with a checkpoint at step 3, then a second ``planner run`` that
  resumes from it and trains steps 4-7.

The resumed run must log the very losses of the straight one, bit for bit (the
same samples in the same order from step 4 on, whatever ran before), and each
replica must have read only its shard: B/dp samples per step, disjoint from
the other replica's, together the step's global batch of [Note: the data order].

A third, one-process run trains the README's model file (``sample_batch`` on
torch's RNG) 6 steps: its losses must stay near ln 10 (fresh random labels
each step). The pattern this replaced, a generator seeded with ``batch_size``,
trained on one batch and fell to 0.01 by step 6 (measured in one process).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from repo import ROOT
from runs import RUN_TIMEOUT_S, planner_run

from planner.devices import from_gpus
from planner.options import PlanOptions, ProfileOptions, SearchOptions, Training
from planner.plan import save_plan
from planner.plan.modelfile import load_model_file
from planner.planning import plan_model
from runtime.data import Sharding

pytestmark = pytest.mark.multiprocess

N_SAMPLES, BATCH, DP, STEPS, RESUME_AT, SEED = 40, 8, 2, 7, 3, 11

MODEL = """
import os
import torch
from torch import nn
from torch.utils.data import Dataset

BATCH_SIZE = 8

class Logged(Dataset):
    \"\"\"40 fixed samples; every read is logged to DATA_LOG/rank{RANK}.txt.\"\"\"

    def __init__(self):
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(40, 16, generator=gen)
        self.y = torch.randint(0, 4, (40,), generator=gen)
        folder = os.environ.get("DATA_LOG")
        rank = os.environ.get("RANK", "0")
        self.log = open(f"{folder}/rank{rank}.txt", "a") if folder else None

    def __len__(self):
        return 40

    def __getitem__(self, i):
        if self.log is not None:
            self.log.write(f"{i}\\n")
            self.log.flush()
        return self.x[i], self.y[i]

def build_model():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

def sample_batch(batch_size):
    return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))

def dataset():
    return Logged()
"""


def _plan(model: Path, tmp: Path, dp: int, batch: int) -> Path:
    mf = load_model_file(model)
    plan = plan_model(
        mf.build(),
        lambda b: (mf.sample(b).args, {}, mf.sample(b).targets),
        cluster=from_gpus(dp),
        loss_fn=mf.loss,
        options=PlanOptions(
            training=Training(global_batch=batch),
            search=SearchOptions(pp=1, dp=dp, micro_batches=2, schedule="gpipe"),
            profile=ProfileOptions(repeats=1, warmup=0),
        ),
        model_file=model.name,
    )
    return save_plan(plan, tmp / f"{model.stem}.yaml")


def _losses(folder: Path, rank: int = 0) -> dict[int, float]:
    lines = (folder / f"rank{rank}.jsonl").read_text().splitlines()
    return {rec["step"]: rec["loss"] for rec in map(json.loads, lines)}


def _reads(folder: Path, rank: int) -> list[int]:
    return [int(x) for x in (folder / f"rank{rank}.txt").read_text().split()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("data")
    model = tmp / "data_model.py"
    model.write_text(MODEL)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLANNER_CACHE_DIR", str(tmp / "cache"))
        plan = _plan(model, tmp, DP, BATCH)
    out: dict[str, Any] = {"tmp": tmp}
    common = [str(model), "--plan", str(plan), "--seed", str(SEED)]
    for name in ("straight", "first", "resumed"):
        (tmp / f"reads-{name}").mkdir()
    env = {"PLANNER_CACHE_DIR": str(tmp / "cache")}
    out["straight"] = planner_run(
        [*common, "--steps", str(STEPS), "--step-log", "log-straight"],
        {**env, "DATA_LOG": str(tmp / "reads-straight")},
        tmp,
    )
    ckpt = ["--checkpoint-dir", "ckpt", "--step-log", "log-resumed"]
    out["first"] = planner_run(
        [*common, *ckpt, "--steps", str(RESUME_AT)],
        {**env, "DATA_LOG": str(tmp / "reads-first")},
        tmp,
    )
    out["resumed"] = planner_run(
        [*common, *ckpt, "--steps", str(STEPS)],
        {**env, "DATA_LOG": str(tmp / "reads-resumed")},
        tmp,
    )
    return out


@pytest.mark.timeout(3 * RUN_TIMEOUT_S + 120)
def test_a_resumed_run_reads_and_trains_exactly_as_a_straight_one(runs: dict[str, Any]) -> None:
    for name in ("straight", "first", "resumed"):
        rc, text, _ = runs[name]
        assert rc == 0, f"{name}:\n{text}"
    assert (
        f"dataset() of {N_SAMPLES} samples, 5 steps per epoch, 4 samples per replica"
        in (runs["straight"][1])
    )
    assert "resumed from " in runs["resumed"][1] and f"(step {RESUME_AT})" in runs["resumed"][1]
    tmp = runs["tmp"]
    straight, resumed = _losses(tmp / "log-straight"), _losses(tmp / "log-resumed")
    assert sorted(straight) == sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == straight  # bit for bit: the same samples, the same order, the same weights
    assert len(set(straight.values())) == STEPS  # every step trained on other samples
    for rank in range(DP):  # every rank logs the global batch's mean loss
        assert _losses(tmp / "log-straight", rank) == straight


@pytest.mark.timeout(3 * RUN_TIMEOUT_S + 120)
def test_each_replica_reads_only_its_shard_of_each_step(runs: dict[str, Any]) -> None:
    assert runs["straight"][0] == 0, runs["straight"][1]
    tmp = runs["tmp"]
    shard = BATCH // DP
    want = [
        Sharding(n_samples=N_SAMPLES, global_batch=BATCH, dp=DP, replica=r, seed=SEED)
        for r in range(DP)
    ]
    reads = [_reads(tmp / "reads-straight", r) for r in range(DP)]
    for r in range(DP):  # step 0's shard is read once: it traces the stage, then trains step 1
        assert reads[r] == [i for step in range(STEPS) for i in want[r].indices(step)], r
    for step in range(STEPS):
        parts = [reads[r][step * shard : (step + 1) * shard] for r in range(DP)]
        assert not set(parts[0]) & set(parts[1]), (step, parts)
        assert parts[0] + parts[1] == want[0].global_indices(step)
    epoch0 = {i for r in range(DP) for i in reads[r][: 5 * shard]}
    assert len(epoch0) == 5 * BATCH  # epoch 0 reads 40 distinct samples
    # The resumed run reads step 0's shard (to trace its stage), then steps 4..7: no others.
    for r in range(DP):
        later = [i for step in range(RESUME_AT, STEPS) for i in want[r].indices(step)]
        assert _reads(tmp / "reads-resumed", r) == want[r].indices(0) + later, r


def _readme_model() -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(# model\.py\n.*?)```", text, re.S)
    assert block is not None, "README.md has no ```python block starting with # model.py"
    return block.group(1)


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_the_readme_pattern_trains_on_new_data_every_step(tmp_path: Path) -> None:
    model = tmp_path / "model.py"
    model.write_text(_readme_model())
    env = {"PLANNER_CACHE_DIR": str(tmp_path / "cache")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLANNER_CACHE_DIR", env["PLANNER_CACHE_DIR"])
        plan = _plan(model, tmp_path, 1, 32)
    rc, text, _ = planner_run(
        [str(model), "--plan", str(plan), "--steps", "6", "--step-log", "log"], env, tmp_path
    )
    assert rc == 0, text
    assert "data: sample_batch(32), torch's RNG seeded to 0 + step" in text
    losses = list(_losses(tmp_path / "log").values())
    assert len(losses) == 6 and len(set(losses)) == 6, losses
    # Fresh random labels: the loss stays near ln 10 = 2.30 (one batch, trained 6 times: 0.01).
    assert all(abs(x - math.log(10)) < 0.5 for x in losses), losses
