"""Checkpoints (runtime/checkpoint.py): exact resume, incomplete checkpoints skipped, refusals.

Two 2-process worlds (pp = 2, gloo on CPU), run one after the other as two
separate jobs, so the resume happens in new processes with a new process group:

* job A trains a model with dropout 4 steps straight (the reference); then a
  second copy 2 steps, saves (step 2), 1 more step, saves (step 3), and the
  step-3 checkpoint is then broken as a crash mid-save would leave it;
* job B (other initial weights) resumes from the latest complete checkpoint,
  which must be step 2 (step 3 is skipped with a warning), trains steps 3 and
  4, and must end bit-identical to the reference: weights, Adam's state and
  the losses. Dropout stays on: each rank's RNG is seeded per (stage,
  replica, step) by ``seed_step`` (reliability item 23), so the masks of
  steps 3 and 4 do not depend on what ran before.

Job B also checks the refusals, on both ranks with the same message: a plan
of another layout (pp 1 × dp 2), unless ``reshard=True`` (which loads the
step-2 weights into that layout by name), and a checkpoint of another model.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import run_world
from torch import nn

from planner.api import PlanOptions, plan_model
from planner.cluster import from_gpus
from planner.cost import Training
from planner.plan import Plan, load_plan, save_plan
from planner.search import SearchOptions

BATCH = 8
TIMEOUT_S = 90

pytestmark = pytest.mark.multiprocess


class DropMLP(nn.Module):
    """An MLP with dropout (on) between its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0 = nn.Linear(16, 64)
        self.act0 = nn.ReLU()
        self.drop0 = nn.Dropout(0.2)
        self.fc1 = nn.Linear(64, 64)
        self.act1 = nn.ReLU()
        self.drop1 = nn.Dropout(0.2)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop0(self.act0(self.fc0(x)))
        return self.fc2(self.drop1(self.act1(self.fc1(h))))


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return DropMLP()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 16, generator=gen), torch.randint(0, 4, (BATCH,), generator=gen)


def _plan(pp: int, dp: int) -> Plan:
    x, y = _batch(0)
    return plan_model(
        _model(0),
        (x, y),
        cluster=from_gpus(pp * dp, "h100"),
        loss_fn=F.cross_entropy,
        options=PlanOptions(
            training=Training(global_batch=BATCH, optimizer="adam"),
            search=SearchOptions(pp=pp, dp=dp, micro_batches=2, schedule="gpipe"),
        ),
        model_file="DropMLP",
    )


def _build(plan_path: str, seed: int) -> Any:
    from runtime.engine import ParallelModel

    return ParallelModel.from_plan(
        _model(seed),
        load_plan(plan_path),
        loss_fn=F.cross_entropy,
        optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2),
        sample=((_batch(0)[0],), {}),
    )


def _train(pm: Any, steps: range) -> list[float]:
    from runtime.checkpoint import seed_step

    losses = []
    for step in steps:
        seed_step(pm, step, seed=7)
        losses.append(pm.step(*_batch(step)))
    return losses


def _snapshot(pm: Any) -> dict[str, Any]:
    return {
        "weights": {k: v.detach().clone() for k, v in pm.stage_state_dict().items()},
        "optim": pm.optimizer.state_dict(),
    }


# --------------------------------------------------------------------------- the jobs


def _job_a(plan_path: str, ckpt: str) -> dict[str, Any]:
    import torch.distributed as dist

    from runtime.checkpoint import checkpoint_path, save

    ref = _build(plan_path, seed=0)
    out = {"ref_losses": _train(ref, range(4)), **_snapshot(ref)}
    pm = _build(plan_path, seed=0)
    _train(pm, range(2))
    save(pm, ckpt, 2)
    out["step2_weights"] = _snapshot(pm)["weights"]
    _train(pm, range(2, 3))
    save(pm, ckpt, 3)
    if dist.get_rank() == 0:  # what a crash during the step-3 save leaves behind
        broken = checkpoint_path(ckpt, 3)
        (broken / "COMPLETE").unlink()
        part = next(broken.glob("*.distcp"))
        part.write_bytes(part.read_bytes()[:100])
    dist.barrier()
    return out


def _job_b(plan_path: str, other_plan_path: str, ckpt: str, alien: str) -> dict[str, Any]:
    from runtime.checkpoint import latest_complete, load

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("runtime.checkpoint").addHandler(Keep(level=logging.WARNING))
    out: dict[str, Any] = {}
    other = _build(other_plan_path, seed=1)  # pp 1 × dp 2: another layout
    path = latest_complete(ckpt)
    assert path is not None
    latest_complete(ckpt)  # a second look does not warn again
    out["path"] = path.name
    out["warnings"] = list(seen)
    for name, target, kwargs in [
        ("other_layout", other, {}),
        ("alien", other, {"reshard": True}),
    ]:
        try:
            load(target, alien if name == "alien" else path, **kwargs)
            out[name] = "not refused"
        except ValueError as exc:
            out[name] = str(exc)
    out["reshard_step"] = load(other, path, reshard=True)
    out["reshard_weights"] = {k: v.clone() for k, v in other.stage_state_dict().items()}
    pm = _build(plan_path, seed=1)  # other initial weights: the checkpoint must overwrite them
    out["step"] = load(pm, path)
    out["losses"] = _train(pm, range(out["step"], 4))
    out.update(_snapshot(pm))
    return out


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("ckpt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLANNER_CACHE_DIR", str(tmp / "cache"))
        pp2 = str(save_plan(_plan(2, 1), tmp / "pp2.yaml"))
        dp2 = str(save_plan(_plan(1, 2), tmp / "dp2.yaml"))
    ckpt = tmp / "checkpoints"
    a = run_world(_job_a, 2, args=(pp2, str(ckpt)), timeout_s=TIMEOUT_S)
    alien = tmp / "alien" / "step-00000002"  # the step-2 checkpoint, of "another model"
    shutil.copytree(ckpt / "step-00000002", alien)
    marker = json.loads((alien / "COMPLETE").read_text())
    marker["fingerprint"] = "0123456789abcdef"
    (alien / "COMPLETE").write_text(json.dumps(marker))
    b = run_world(_job_b, 2, args=(pp2, dp2, str(ckpt), str(alien)), timeout_s=TIMEOUT_S)
    return {"a": a, "b": b, "ckpt": ckpt}


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_resume_in_a_new_process_group_is_exact(jobs: dict[str, Any]) -> None:
    for rank, (a, b) in enumerate(zip(jobs["a"], jobs["b"], strict=True)):
        assert b["step"] == 2
        assert b["losses"] == a["ref_losses"][2:], (rank, b["losses"], a["ref_losses"])
        assert a["weights"].keys() == b["weights"].keys()
        for name, want in a["weights"].items():
            assert torch.equal(b["weights"][name], want), (rank, name)
        sa, sb = a["optim"], b["optim"]
        assert sa["param_groups"] == sb["param_groups"]
        for idx, per in sa["state"].items():
            for key, want in per.items():
                assert torch.equal(sb["state"][idx][key], want), (rank, idx, key)


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_an_incomplete_checkpoint_is_skipped_with_one_warning(jobs: dict[str, Any]) -> None:
    ckpt: Path = jobs["ckpt"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000003"]
    marker = json.loads((ckpt / "step-00000002" / "COMPLETE").read_text())
    assert (marker["step"], marker["pp"], marker["dp"], marker["world_size"]) == (2, 2, 1, 2)
    for b in jobs["b"]:
        assert b["path"] == "step-00000002"
        (warning,) = b["warnings"]
        assert "skipping incomplete checkpoint" in warning
        assert str(ckpt / "step-00000003") in warning


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_another_layout_or_model_is_refused_with_the_same_message_on_every_rank(
    jobs: dict[str, Any],
) -> None:
    b0, b1 = jobs["b"]
    assert b0["other_layout"] == b1["other_layout"]
    msg = b0["other_layout"]
    assert "another layout" in msg and "pp 2 in the checkpoint, 1 now" in msg, msg
    assert "dp 1 in the checkpoint, 2 now" in msg and "reshard=True" in msg, msg
    assert b0["alien"] == b1["alien"]
    assert "another model" in b0["alien"] and "0123456789abcdef" in b0["alien"], b0["alien"]


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_reshard_loads_the_weights_by_name_into_another_layout(jobs: dict[str, Any]) -> None:
    saved: dict[str, torch.Tensor] = {}
    for a in jobs["a"]:  # each pp-2 stage's weights at step 2
        saved.update(a["step2_weights"])
    for b in jobs["b"]:  # pp 1 × dp 2: every weight, on both replicas
        assert b["reshard_step"] == 2
        assert set(b["reshard_weights"]) == set(saved)
        for name, want in saved.items():
            assert torch.equal(b["reshard_weights"][name], want), name
