"""The runtime keeps the plan's promises: recompute, bf16-mixed, clipping, non-finite steps, pp = 1.

One world of 2 ranks (gloo, spawned, hard timeout) runs every case; each is
compared with one process doing the same thing by hand: the same
micro-batches accumulated (loss / m), the same autocast, the same clipping.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from small_examples import batch, build, loss_for
from torch import nn
from world import run_world

from planner.devices import from_gpus
from planner.options import PlanOptions, SearchOptions, Training
from planner.plan import load_plan, save_plan
from planner.planning import plan_model

STEPS = 3
BATCH = 8
WORLD_TIMEOUT_S = 240

pytestmark = pytest.mark.multiprocess


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    pp: int = 2
    dp: int = 1
    m: int = 2
    precision: str = "fp32"
    recompute: bool = False
    clip: float | None = None
    nan_at: int | None = None  # the loss is NaN at this step (0-based)
    on_nonfinite: str = "stop"
    split: str = "auto"
    plan_path: str = ""


CASES = [
    Case("recompute-mlp", "mlp", recompute=True),
    Case("bf16-gpt", "gpt", precision="bf16-mixed"),
    Case("bf16-recompute-mlp-fx", "mlp", precision="bf16-mixed", recompute=True, split="fx"),
    Case("clip-gpt-tied", "gpt", clip=0.05),
    Case("nan-stop", "mlp", nan_at=1),
    Case("nan-skip", "mlp", nan_at=1, on_nonfinite="skip"),
    Case(
        "pp1-dp2-bf16-recompute-clip",
        "mlp",
        pp=1,
        dp=2,
        precision="bf16-mixed",
        recompute=True,
        clip=0.5,
    ),
]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


class _NanAt:
    """The model's loss, NaN on every micro-batch of one step (counted by calls)."""

    def __init__(self, loss_fn: Any, step: int | None, per_step: int) -> None:
        self.loss_fn, self.step, self.per_step, self.calls = loss_fn, step, per_step, 0

    def __call__(self, out: Any, y: Any) -> torch.Tensor:
        loss = self.loss_fn(out, y)
        step = self.calls // self.per_step
        self.calls += 1
        return loss * float("nan") if step == self.step else loss


def _model(case: Case) -> nn.Module:
    torch.manual_seed(0)
    return build(case.model)


# --------------------------------------------------------------------------- the worker


def _worker(cases: list[Case]) -> dict[str, dict[str, Any]]:
    import torch.distributed as dist

    from runtime.engine import ParallelModel
    from runtime.gradients import NonFiniteError
    from runtime.recompute import Recompute

    out: dict[str, dict[str, Any]] = {}
    for case in cases:
        model = _model(case)
        reference = copy.deepcopy(model)
        batches = [batch(case.model, BATCH, k) for k in range(STEPS)]
        pm = ParallelModel.from_plan(
            model,
            load_plan(case.plan_path),
            loss_fn=_NanAt(loss_for(case.model), case.nan_at, case.m),
            optimizer=_sgd,
            sample=((batches[0][0],), {}),
            clip_grad_norm=case.clip,
            on_nonfinite=case.on_nonfinite,
            split=case.split,
        )
        calls = _count_calls(pm.stage.module)
        res: dict[str, Any] = {"losses": [], "calls": [], "norms": [], "skipped": []}
        res["recompute_wrapped"] = any(isinstance(m, Recompute) for m in pm.stage.wrapped.modules())
        for k, (x, y) in enumerate(batches):
            before = {n: v.clone() for n, v in pm.stage_state_dict().items()}
            calls[0] = 0
            try:
                res["losses"].append(pm.step(x, y))
            except NonFiniteError as exc:
                res["stopped"] = (k, str(exc))
                break
            res["calls"].append(calls[0])
            res["norms"].append(pm.last_grad_norm)
            res["skipped"].append(pm.last_step_skipped)
            if pm.last_step_skipped:
                after = pm.stage_state_dict()
                res["unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
        if case.pp > 1 and pm.mesh.stage == 1:
            recv = pm.stage.pipeline_stage.args_recv_info[0]
            res["recv_dtypes"] = [str(r.buffer.dtype) for r in recv if r.buffer is not None]
        full = pm.state_dict()
        if dist.get_rank() == 0 and "stopped" not in res:
            res["reference"] = _reference(case, reference, batches)
            res["state"] = {k: v.float() for k, v in full.items()}
        out[case.name] = res
    return out


def _count_calls(module: nn.Module) -> list[int]:
    """``calls[0]``: how many times ``module`` ran (its forward pre-hook)."""
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1

    module.register_forward_pre_hook(hook)
    return calls


def _reference(case: Case, model: nn.Module, batches: list[Any]) -> dict[str, Any]:
    """One process: the plan's micro-batches accumulated, its autocast and clipping."""
    loss_fn = loss_for(case.model)
    opt = _sgd(model.parameters())
    losses, norms = [], []
    b = BATCH // case.m
    for k, (x, y) in enumerate(batches):
        opt.zero_grad()
        total = 0.0
        for i in range(case.m):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.precision != "fp32"):
                loss = loss_fn(model(x[i * b : (i + 1) * b]), y[i * b : (i + 1) * b])
            (loss / case.m).backward()
            total += loss.item() / case.m
        losses.append(total)
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        if k == case.nan_at:  # skipped
            continue
        if case.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        opt.step()
    fp32 = {k: v.detach().float() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "state": fp32}


# --------------------------------------------------------------------------- fixtures


def _plan(case: Case, tmp: Path) -> Case:
    x, y = batch(case.model, BATCH, 0)
    plan = plan_model(
        _model(case),
        (x, y),
        cluster=from_gpus(case.pp * case.dp, "h100"),
        loss_fn=loss_for(case.model),
        options=PlanOptions(
            training=Training(global_batch=BATCH, optimizer="sgd", precision=case.precision),
            search=SearchOptions(pp=case.pp, dp=case.dp, micro_batches=case.m),
        ),
        model_file=f"{case.model}.py",
    )
    if case.recompute:
        stages = tuple(dataclasses.replace(s, recompute=True) for s in plan.stages)
        plan = dataclasses.replace(plan, stages=stages)
    path = tmp / f"{case.name}.yaml"
    save_plan(plan, path)
    return dataclasses.replace(case, plan_path=str(path))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLANNER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        tmp = tmp_path_factory.mktemp("plans")
        cases = [_plan(c, tmp) for c in CASES]
        yield run_world(_worker, 2, args=(cases,), timeout_s=WORLD_TIMEOUT_S)


def _close(got: Any, want: Any, rtol: float, atol: float) -> None:
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), rtol=rtol, atol=atol)


def _states_close(root: dict[str, Any], rtol: float, atol: float) -> float:
    """Every weight matches the reference's; returns the largest difference."""
    worst = 0.0
    want = root["reference"]["state"]
    for k, v in root["state"].items():
        torch.testing.assert_close(v, want[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
        worst = max(worst, (v - want[k]).abs().max().item())
    return worst


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(WORLD_TIMEOUT_S + 120)
def test_a_recomputing_stage_runs_its_forward_twice_and_trains_the_same(world: Any) -> None:
    for rank in world:
        res = rank["recompute-mlp"]
        assert res["recompute_wrapped"]
        # each micro-batch: its forward, then the forward again at the start of its backward
        assert res["calls"] == [2 * 2] * STEPS, res["calls"]
    root = world[0]["recompute-mlp"]
    _close(root["losses"], root["reference"]["losses"], 1e-5, 1e-6)
    _states_close(root, 1e-5, 1e-6)
    assert not world[0]["bf16-gpt"]["recompute_wrapped"]  # only where the plan says


@pytest.mark.timeout(WORLD_TIMEOUT_S + 120)
def test_bf16_mixed_trains_in_bf16_like_one_process_under_the_same_autocast(world: Any) -> None:
    root = world[0]["bf16-gpt"]
    assert "torch.bfloat16" in world[1]["bf16-gpt"]["recv_dtypes"], world[1]["bf16-gpt"]
    _close(root["losses"], root["reference"]["losses"], 1e-4, 1e-5)
    _states_close(root, 1e-3, 1e-4)
    # bf16 really ran: the first step's loss (the same model and batch as clip-gpt-tied's,
    # before any update) differs from fp32's far more than from the autocast reference's
    fp32_first = world[0]["clip-gpt-tied"]["reference"]["losses"][0]
    parity_gap = abs(root["losses"][0] - root["reference"]["losses"][0])
    assert abs(fp32_first - root["losses"][0]) > 10 * max(parity_gap, 1e-7)


@pytest.mark.timeout(WORLD_TIMEOUT_S + 120)
def test_bf16_mixed_and_recompute_on_the_fx_split(world: Any) -> None:
    res = world[1]["bf16-recompute-mlp-fx"]
    assert "torch.bfloat16" in res["recv_dtypes"], res
    assert res["recompute_wrapped"] and res["calls"] == [2 * 2] * STEPS
    root = world[0]["bf16-recompute-mlp-fx"]
    _close(root["losses"], root["reference"]["losses"], 1e-4, 1e-5)
    _states_close(root, 1e-3, 1e-4)


@pytest.mark.timeout(WORLD_TIMEOUT_S + 120)
def test_global_norm_clipping_equals_one_process_with_tied_weights_counted_once(
    world: Any,
) -> None:
    root = world[0]["clip-gpt-tied"]
    _close(root["norms"], root["reference"]["norms"], 1e-5, 1e-7)
    assert all(n > 0.05 for n in root["norms"])  # it clipped every step
    _close(root["losses"], root["reference"]["losses"], 1e-5, 1e-6)
    _states_close(root, 1e-4, 1e-6)
    assert world[1]["clip-gpt-tied"]["norms"] == root["norms"]  # both stages: one norm


@pytest.mark.timeout(WORLD_TIMEOUT_S + 120)
def test_a_nan_loss_stops_every_rank_before_the_update(world: Any) -> None:
    for rank in world:
        step, message = rank["nan-stop"]["stopped"]
        assert step == 1
        assert "the loss is nan" in message and "--on-nonfinite skip" in message


@pytest.mark.timeout(WORLD_TIMEOUT_S + 120)
def test_a_nan_loss_skips_the_update_when_asked(world: Any) -> None:
    for rank in world:
        res = rank["nan-skip"]
        assert res["skipped"] == [False, True, False]
        assert res["unchanged"]
    root = world[0]["nan-skip"]
    _states_close(root, 1e-5, 1e-6)


@pytest.mark.timeout(WORLD_TIMEOUT_S + 120)
def test_pp1_is_plain_ddp_with_accumulation_bf16_recompute_and_clipping(world: Any) -> None:
    for rank in world:
        res = rank["pp1-dp2-bf16-recompute-clip"]
        assert res["recompute_wrapped"] and res["calls"] == [2 * 2] * STEPS
    root = world[0]["pp1-dp2-bf16-recompute-clip"]
    # DDP averages the replicas' gradients in bf16 (half the bytes, as priced): bf16 rounding
    _close(root["losses"], root["reference"]["losses"], 2e-2, 1e-3)
    _states_close(root, 2e-2, 2e-3)
