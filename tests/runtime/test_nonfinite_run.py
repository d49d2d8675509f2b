"""A NaN loss in ``planner run``: training stops at that step, nothing non-finite is saved.

Two workers (pp = 2, gloo); the model file's loss turns NaN from step 3 on.
With ``--on-nonfinite stop`` (the default) the run fails at step 3, naming it,
and only steps 1 and 2 were checkpointed; with ``skip`` every later step's
update is skipped, the run ends, and its final checkpoint holds the weights of
step 2 (finite).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runs import RUN_TIMEOUT_S, planner_run

from planner.devices import from_gpus
from planner.options import PlanOptions, SearchOptions, Training
from planner.plan import save_plan
from planner.plan.modelfile import load_model_file
from planner.planning import plan_model

pytestmark = pytest.mark.multiprocess

MODEL = '''"""An MLP whose loss turns NaN after NAN_AFTER calls (2 per step on the last stage)."""
import os

import torch
import torch.nn.functional as F
from torch import nn

BATCH_SIZE = 8
CALLS = [0]


def build_model():
    layers = [nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)]
    return nn.Sequential(*layers)


def sample_batch(batch_size):
    return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))


def loss_fn(out, y):
    CALLS[0] += 1
    loss = F.cross_entropy(out, y)
    return loss * float("nan") if CALLS[0] > int(os.environ.get("NAN_AFTER", "1000")) else loss
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("nonfinite")
    (tmp / "nan.py").write_text(MODEL)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLANNER_CACHE_DIR", str(tmp / "cache"))
        mf = load_model_file(tmp / "nan.py")
        batch = mf.sample(mf.batch_size)
        plan = plan_model(
            mf.build(),
            (batch.args[0], batch.targets),
            cluster=from_gpus(2),
            loss_fn=mf.loss,
            options=PlanOptions(
                training=Training(global_batch=mf.batch_size),
                search=SearchOptions(pp=2, dp=1, micro_batches=2),
            ),
            model_file="nan.py",
        )
    save_plan(plan, tmp / "plan.yaml")
    return tmp


def _complete(directory: Path) -> list[str]:
    return sorted(p.parent.name for p in directory.glob("step-*/COMPLETE"))


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_a_nan_loss_stops_the_run_at_its_step_and_is_never_saved(setup: Path) -> None:
    ckpt = setup / "stop"
    rc, out, _ = planner_run(
        ["nan.py", "--plan", "plan.yaml", "--steps", "6", "--checkpoint-dir", str(ckpt),
         "--checkpoint-every", "1"],
        {"NAN_AFTER": "4"},
        setup,
    )  # fmt: skip
    assert rc != 0, out
    assert "failed at step 3: NonFiniteError: the loss is nan" in out, out
    assert _complete(ckpt) == ["step-00000001", "step-00000002"], out


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_skipping_nan_steps_keeps_the_weights_finite(setup: Path) -> None:
    ckpt, log = setup / "skip", setup / "log"
    rc, out, _ = planner_run(
        ["nan.py", "--plan", "plan.yaml", "--steps", "5", "--checkpoint-dir", str(ckpt),
         "--on-nonfinite", "skip", "--step-log", str(log)],
        {"NAN_AFTER": "4"},
        setup,
    )  # fmt: skip
    assert rc == 0, out
    skipped = [line for line in out.splitlines() if "update skipped: non-finite" in line]
    assert [line.split()[1] for line in skipped] == ["3/5", "4/5", "5/5"], out
    assert _complete(ckpt) == ["step-00000005"], out  # saved: the weights stayed finite
    losses = [json.loads(line)["loss"] for line in (log / "rank0.jsonl").read_text().splitlines()]
    assert all(x == x for x in losses[:2]) and all(x != x for x in losses[2:]), losses
