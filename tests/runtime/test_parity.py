"""The runtime's transparency: a planned, pipelined (× data-parallel) model trains like one process.

Multi-process on CPU with gloo (tests/world.py: spawned ranks, hard timeouts).
Every case trains the pipelined model and a deep-copied single-process
reference for 3 optimizer steps on the same global batches with the same mean
loss, and requires every step's loss (on every rank) and every parameter and
buffer to match, and every rank's copy of a tensor (tied copies, DDP replicas)
to agree. Worlds of 2 (pp = 2; and pp = 1 × dp = 2), 3 (pp = 3, long skips)
and 4 ranks (pp = 2 × dp = 2) each start once and run all their cases.

Both ways to split are covered: ``pipeline()`` (torch.export), the fx fallback
forced, and the fallback taken on its own for a model torch.export refuses.

BatchNorm: statistics are per micro-batch, so with m > 1 training-mode BN
cannot match one process on the whole batch. The CNN cases use BN in eval
mode (running statistics, fixed) with m ≥ 2, and training-mode BN with m = 1
(one micro-batch = the whole batch: exact, running statistics included).
Dropout is off in every model (bit-exact parity needs it off).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from small_examples import batch, build, loss_for
from torch import nn
from world import run_world

from planner.devices import from_gpus
from planner.options import PlanOptions, SearchOptions, Training
from planner.plan import Plan, load_plan, save_plan
from planner.planning import plan_model

STEPS = 3
BATCH = 8
RTOL, ATOL = 1e-4, 1e-5
WORLD_TIMEOUT_S = 180

pytestmark = pytest.mark.multiprocess


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One parity run: a model, a layout, a schedule, an optimizer."""

    name: str
    model: str  # "mlp" | "resnet" | "gpt" | "unet" | "branchy"
    pp: int = 2
    dp: int = 1
    m: int = 2
    schedule: str = "gpipe"
    optimizer: str = "sgd"
    split: str = "auto"
    bn_eval: bool = False
    expect_method: str = "pipeline"
    plan_path: str = ""


WORLD2 = [
    Case("mlp-m1", "mlp", m=1),
    Case("mlp-m2-adam", "mlp", m=2, optimizer="adam"),
    Case("mlp-m4-1f1b", "mlp", m=4, schedule="1f1b"),
    Case("mlp-m2-fx", "mlp", m=2, split="fx", expect_method="fx"),
    Case("resnet-m2-bn-eval", "resnet", m=2, bn_eval=True),
    Case("resnet-m1-bn-train", "resnet", m=1),
    Case("resnet-m2-fx", "resnet", m=2, bn_eval=True, split="fx", expect_method="fx"),
    Case("gpt-m2-1f1b-tied", "gpt", m=2, schedule="1f1b", optimizer="adam"),
    Case("branchy-auto-fallback", "branchy", m=2, expect_method="fx"),
    # pp = 1: the model itself under DDP, gradients accumulated (runtime.accumulate)
    Case("pp1-dp2-mlp", "mlp", pp=1, dp=2, m=2, expect_method="whole"),
]
WORLD3 = [  # the U-Net's long skips cross both split points
    Case("pp3-unet-m4-1f1b", "unet", pp=3, m=4, schedule="1f1b", bn_eval=True),
    Case("pp3-unet-m4-fx", "unet", pp=3, m=4, bn_eval=True, split="fx", expect_method="fx"),
]
WORLD4 = [
    Case("dp2-mlp-m2", "mlp", dp=2, m=2),
    Case("dp2-gpt-m2-tied", "gpt", dp=2, m=2, schedule="1f1b", optimizer="adam"),
    Case("dp2-resnet-m2-bn-eval", "resnet", dp=2, m=2, bn_eval=True),
]


def _optimizer(kind: str) -> Any:
    if kind == "adam":
        # Adam's step is about lr for ANY gradient above eps, so a near-zero gradient whose
        # rounding differs (another summation order) would move a weight by up to ±lr: a
        # larger eps keeps such noise-level gradients' steps noise-sized.
        return lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=1e-6)
    return lambda ps: torch.optim.SGD(ps, lr=0.1)


def _model(case: Case) -> nn.Module:
    """The case's model, seeded; BatchNorm in eval mode when the case says so.

    The plan is made from the model in the same mode (eval-mode BN traces another
    graph, and so profiles another way).
    """
    torch.manual_seed(0)
    model = build(case.model)
    if case.bn_eval:
        for mod in model.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.eval()
    return model


def _plan(case: Case) -> Plan:
    x, y = batch(case.model, BATCH, 0)
    return plan_model(
        _model(case),
        (x, y),
        cluster=from_gpus(case.pp * case.dp, "h100"),
        loss_fn=loss_for(case.model),
        options=PlanOptions(
            training=Training(global_batch=BATCH, optimizer=case.optimizer),
            search=SearchOptions(
                pp=case.pp, dp=case.dp, micro_batches=case.m, schedule=case.schedule
            ),
        ),
        model_file=f"{case.model}.py",
    )


# --------------------------------------------------------------------------- the worker


def _worker(cases: list[Case]) -> dict[str, dict[str, Any]]:
    """Runs on every rank: each case pipelined, and (on rank 0) its reference."""
    import torch.distributed as dist

    from runtime.engine import ParallelModel

    results = {}  # the first from_plan joins the group from the environment (torchrun's)
    for case in cases:
        plan = load_plan(case.plan_path)
        model = _model(case)
        reference = copy.deepcopy(model)
        batches = [batch(case.model, BATCH, k) for k in range(STEPS)]
        pm = ParallelModel.from_plan(
            model,
            plan,
            loss_fn=loss_for(case.model),
            optimizer=_optimizer(case.optimizer),
            sample=((batches[0][0],), {}),
            split=case.split,
        )
        synced = _count_syncs(pm)
        losses, syncs = [], []
        for x, y in batches:
            losses.append(pm.step(x, y))
            syncs.append(list(synced))
            synced.clear()
        out: dict[str, Any] = {
            "losses": losses,
            "method": pm.stage.method,
            "syncs": syncs,
            "tied": [g.stages for g in pm.tied.groups],
        }
        if case.name == "dp2-mlp-m2":
            out["bad_batch"] = _bad_batch(pm, batches[0])
        full = pm.state_dict()
        out["fallback_reason"] = pm.stage.fallback_reason
        copies = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object({k: v.cpu() for k, v in pm.stage_state_dict().items()}, copies, dst=0)
        if dist.get_rank() == 0:
            out.update(_reference(case, reference, batches, full, copies))
        results[case.name] = out
    return results


def _count_syncs(pm: Any) -> list[int]:
    """The DDP buckets all-reduced, as they happen (a comm hook around the default one)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    seen: list[int] = []
    if pm.stage.ddp:

        def hook(group, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
            seen.append(bucket.index())
            return default_hooks.allreduce_hook(group, bucket)

        pm.stage.wrapped.register_comm_hook(pm.mesh.dp_group, hook)
    return seen


def _bad_batch(pm: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> str:
    x, y = batch
    try:
        pm.step(x[:3], y[:3])
    except ValueError as exc:
        return str(exc)
    return "no error"


def _reference(
    case: Case, reference: nn.Module, batches: list[Any], full: dict[str, Any], copies: Any
) -> dict[str, Any]:
    loss_fn = loss_for(case.model)
    opt = _optimizer(case.optimizer)(reference.parameters())
    ref_losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(reference(x), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    mismatches = []
    expected = dict(reference.named_parameters())
    expected.update(
        {
            k: v
            for k, v in reference.state_dict().items()
            if k not in expected and any(k == n for n, _ in reference.named_buffers())
        }
    )
    for name, want in expected.items():
        got = full.get(name)
        if got is None:
            mismatches.append(f"{name}: missing from state_dict()")
            continue
        try:
            torch.testing.assert_close(got, want.detach(), rtol=RTOL, atol=ATOL)
        except AssertionError as exc:
            mismatches.append(f"{name}: {str(exc).splitlines()[0:4]}")
    # Tied copies and DDP replicas: every rank's copy of a tensor must agree.
    spread = 0.0
    seen: dict[str, torch.Tensor] = {}
    for part in copies:
        for k, v in part.items():
            if k in seen:
                spread = max(spread, (seen[k].float() - v.float()).abs().max().item())
            else:
                seen[k] = v
    return {
        "ref_losses": ref_losses,
        "mismatches": mismatches,
        "copy_spread": spread,
        "extra_keys": sorted(set(full) - set(reference.state_dict())),
    }


def _world3_worker(mlp_pp2_plan: str, cases: list[Case]) -> dict[str, Any]:
    """World 3: a pp=2 plan is refused on every rank before any communication; then pp=3."""
    from runtime.checks import PlanMismatch
    from runtime.engine import ParallelModel

    x, _ = batch("mlp", BATCH, 0)
    started = time.monotonic()
    try:
        ParallelModel.from_plan(
            build("mlp"),
            load_plan(mlp_pp2_plan),
            loss_fn=F.cross_entropy,
            optimizer=_optimizer("sgd"),
            sample=((x,), {}),
        )
        refused = "not refused"
    except PlanMismatch as exc:
        refused = str(exc)
    return {"refused": refused, "refused_s": time.monotonic() - started, **_worker(cases)}


# --------------------------------------------------------------------------- fixtures


def _planned(cases: list[Case], tmp: Path) -> list[Case]:
    out = []
    for case in cases:
        path = tmp / f"{case.name}.yaml"
        save_plan(_plan(case), path)
        out.append(dataclasses.replace(case, plan_path=str(path)))
    return out


@pytest.fixture(scope="module")
def plans_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLANNER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield tmp_path_factory.mktemp("plans")


@pytest.fixture(scope="module")
def world2(plans_dir: Path) -> list[dict[str, Any]]:
    return run_world(_worker, 2, args=(_planned(WORLD2, plans_dir),), timeout_s=WORLD_TIMEOUT_S)


@pytest.fixture(scope="module")
def world4(plans_dir: Path) -> list[dict[str, Any]]:
    return run_world(_worker, 4, args=(_planned(WORLD4, plans_dir),), timeout_s=WORLD_TIMEOUT_S)


@pytest.fixture(scope="module")
def world3(plans_dir: Path) -> list[dict[str, Any]]:
    (mlp,) = _planned([Case("mismatch-mlp-pp2", "mlp")], plans_dir)
    return run_world(
        _world3_worker,
        3,
        args=(mlp.plan_path, _planned(WORLD3, plans_dir)),
        timeout_s=WORLD_TIMEOUT_S,
    )


def _check(ranks: list[dict[str, Any]], case: Case) -> dict[str, Any]:
    root = ranks[0][case.name]
    assert root["method"] == case.expect_method, root["fallback_reason"]
    assert not root["mismatches"], "\n".join(root["mismatches"])
    for rank, res in enumerate(ranks):
        torch.testing.assert_close(
            torch.tensor(res[case.name]["losses"]),
            torch.tensor(root["ref_losses"]),
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m, r=rank: f"rank {r} losses: {m}",
        )
    assert root["copy_spread"] <= 1e-6, f"copies differ by {root['copy_spread']}"
    assert not root["extra_keys"], root["extra_keys"]
    return root


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", WORLD2, ids=lambda c: c.name)
def test_two_processes_match_one_process(world2: list[dict[str, Any]], case: Case) -> None:
    root = _check(world2, case)
    if case.model == "gpt":  # the tied embedding/head: a copy on each of the 2 stages
        assert root["tied"] == [(0, 1)]
    if case.split == "auto" and case.expect_method == "fx":
        assert "RuntimeError" in root["fallback_reason"]  # pipeline() failed first


@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", WORLD4, ids=lambda c: c.name)
def test_pp2_dp2_matches_one_process(world4: list[dict[str, Any]], case: Case) -> None:
    root = _check(world4, case)
    if case.model == "gpt":
        assert root["tied"] == [(0, 1)]


@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", WORLD3, ids=lambda c: c.name)
def test_pp3_with_long_skips_matches_one_process(world3: list[dict[str, Any]], case: Case) -> None:
    _check(world3, case)


@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
def test_ddp_syncs_once_per_step_after_the_last_micro_batch(
    world4: list[dict[str, Any]],
) -> None:
    for case in WORLD4:
        for rank, res in enumerate(world4):
            syncs = res[case.name]["syncs"]  # per step: the buckets all-reduced
            assert len(syncs) == STEPS and syncs[0], (case.name, rank, syncs)
            for buckets in syncs:  # every bucket once, not once per micro-batch (m = 2)
                assert sorted(buckets) == list(range(len(buckets))), (case.name, rank, syncs)


@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
def test_wrong_batch_size_is_refused_on_every_rank(world4: list[dict[str, Any]]) -> None:
    for res in world4:
        msg = res["dp2-mlp-m2"]["bad_batch"]
        assert "3 samples" in msg and "8 (global) or 4" in msg, msg


@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
def test_wrong_world_size_is_refused_on_every_rank(world3: list[dict[str, Any]]) -> None:
    messages = {res["refused"] for res in world3}
    assert len(messages) == 1, messages  # the same message on every rank
    (msg,) = messages
    assert "world size 3" in msg and "torchrun --nproc-per-node 2" in msg, msg
    assert all(res["refused_s"] < 30 for res in world3)  # no rank waited on a peer
