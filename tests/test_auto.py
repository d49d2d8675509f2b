"""``auto_parallel`` (planner/auto.py): plans for the job's processes; the losses of one process.

One process (no torchrun): a pp = dp = 1 plan, micro-batching only. Two
processes (tests/world.py sets torchrun's variables): rank 0 plans for 2 local
devices (pp × dp = 2) and broadcasts the plan; every rank builds the same
placement; its errors reach every rank. Both train 2 steps and must give the
losses of the plain model trained in this process.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from repo import EXAMPLES
from torch import nn
from world import run_world

from planner.plan.modelfile import load_model_file

MLP = EXAMPLES / "mlp.py"
BATCH = 8
STEPS = 2
FAST = {"repeats": 1, "warmup": 0}  # profiling rounds: enough for a plan in a test
RTOL, ATOL = 1e-4, 1e-5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return load_model_file(MLP).module.build_model(in_features=32)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(BATCH, 32, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _reference() -> list[float]:
    model, (x, y) = _model(), _batch()
    opt = _sgd(model.parameters())
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _train() -> dict[str, Any]:
    from planner.auto import auto_parallel

    x, y = _batch()
    pm = auto_parallel(_model(), sample=(x, y), loss_fn=F.cross_entropy, optimizer=_sgd, **FAST)
    try:
        out: dict[str, Any] = {
            "losses": [pm.step(x, y) for _ in range(STEPS)],
            "layout": (pm.plan.pp, pm.plan.dp, pm.plan.split_points, pm.plan.fingerprint),
            "optimizer": pm.plan.optimizer,
        }
        try:  # pinned to 4 processes in a job of 2: rank 0's error, on every rank
            auto_parallel(_model(), sample=(x, y), pp=2, dp=2, **FAST)
            out["error"] = "no error"
        except ValueError as exc:
            out["error"] = str(exc)
    finally:
        pm.close()
    return out


def _one_process(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """No torchrun variables (a plain process), and an empty profile cache."""
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(cache))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.timeout(120)
def test_one_process_plans_micro_batching_only_and_matches(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _one_process(monkeypatch, tmp_path)
    from planner import auto_parallel

    x, y = _batch()
    pm = auto_parallel(_model(), sample=(x, y), loss_fn=F.cross_entropy, optimizer=_sgd, **FAST)
    try:
        losses = [pm.step(x, y) for _ in range(STEPS)]
        assert (pm.plan.pp, pm.plan.dp, pm.plan.optimizer) == (1, 1, "sgd")
    finally:
        pm.close()
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(_reference()), rtol=RTOL, atol=ATOL
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_processes_share_rank0s_plan_and_match(tmp_path: Path) -> None:
    ranks = run_world(_train, 2, timeout_s=150, env={"PLANNER_CACHE_DIR": str(tmp_path)})
    want = torch.tensor(_reference())
    for res in ranks:
        torch.testing.assert_close(torch.tensor(res["losses"]), want, rtol=RTOL, atol=ATOL)
    (pp, dp, _, _), other = ranks[0]["layout"], ranks[1]["layout"]
    assert pp * dp == 2 and ranks[0]["layout"] == other  # the same placement everywhere
    errors = {res["error"] for res in ranks}
    assert len(errors) == 1, errors
    (msg,) = errors
    assert msg.startswith("planning on rank 0 failed: ValueError: pp 2 × dp 2 = 4"), msg


def test_unknown_plan_options_are_refused_naming_the_valid_ones() -> None:
    from planner.auto import auto_parallel

    with pytest.raises(TypeError, match=r"unknown plan option.*'stages'.*micro_batches"):
        auto_parallel(_model(), sample=_batch(), stages=2)


class _DictOut(nn.Module):
    """Returns a dict, as library models do: the loss reads ``outputs["logits"]``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = load_model_file(MLP).module.build_model(in_features=32)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.body(x)
        return {"logits": logits, "norm": logits.norm(dim=-1)}


def _dict_loss(outputs: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs["logits"], y)


def test_the_loss_sees_the_models_own_output_in_auto_parallel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _one_process(monkeypatch, tmp_path)
    from planner import auto_parallel

    x, y = _batch()
    torch.manual_seed(0)
    model = _DictOut()
    reference = copy.deepcopy(model)
    pm = auto_parallel(model, sample=(x, y), loss_fn=_dict_loss, optimizer=_sgd, **FAST)
    try:
        losses = [pm.step(x, y) for _ in range(STEPS)]
    finally:
        pm.close()
    opt, want = _sgd(reference.parameters()), []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _dict_loss(reference(x), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=RTOL, atol=ATOL)
