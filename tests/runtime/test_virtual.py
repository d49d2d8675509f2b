"""Several stages per rank: Interleaved 1F1B and Looped BFS train like one process.

Multi-process on CPU with gloo (tests/world.py). Each plan is the search's own
with pp 2 × v 2 pinned (one is a planned 4-stage plan made into pp 2 × v 2, as
``planner.plan`` documents it: tests/plan/test_plan_consistency.py): stage k on
pipeline rank k mod 2, so
rank 0 runs stages 0 and 2 and rank 1 stages 1 and 3 (of each replica). Every
case trains the pipelined model and a deep-copied single-process reference for
3 optimizer steps on the same global batches and requires every step's loss
(on every rank), the first step's gradients and every parameter after the
last step to match, and every rank's copy of a tensor (tied copies, DDP
replicas) to agree. GPT's embedding and LM head are tied: stage 0 (rank 0)
and stage 3 (rank 1) each hold a copy.

World 2 (pp 2 × v 2) also measures a run (per-stage intervals, the
comparison table) and saves a checkpoint, resumes it into a fresh model and
requires the resumed step to be bit-identical to the uninterrupted one. World
4 (pp 2 × v 2 × dp 2) checks DDP's all-reduce. The refusals are in
test_virtual_checks.py.
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
from virtual_plans import BATCH, planned_4, planned_virtual, virtual_plan
from world import run_world

from planner.plan import Plan, load_plan

STEPS = 3
RTOL, ATOL = 1e-4, 1e-5  # as tests/runtime/test_parity.py
WORLD_TIMEOUT_S = 240

pytestmark = pytest.mark.multiprocess


@dataclass(frozen=True)
class Case:
    """One run of pp 2 × v 2: a model, a schedule, dp, micro-batches, an optimizer, a split."""

    name: str
    model: str  # "gpt" (tied embedding/head) | "mlp"
    schedule: str
    dp: int = 1
    m: int = 4
    optimizer: str = "adam"
    split: str = "auto"
    expect_method: str = "pipeline"
    edited: bool = False  # a 4-stage plan edited into pp 2 × v 2, not the search's own
    plan_path: str = ""


WORLD2 = [
    Case("gpt-interleaved-tied", "gpt", "interleaved-1f1b", m=4),
    Case("gpt-looped-bfs-tied", "gpt", "looped-bfs", m=2),
    Case("mlp-interleaved-fx", "mlp", "interleaved-1f1b", m=2, split="fx", expect_method="fx"),
    Case("mlp-looped-bfs-sgd", "mlp", "looped-bfs", m=4, optimizer="sgd", edited=True),
]
WORLD4 = [
    Case("dp2-gpt-interleaved-tied", "gpt", "interleaved-1f1b", dp=2, m=2),
    Case("dp2-gpt-looped-bfs-tied", "gpt", "looped-bfs", dp=2, m=4),
    Case("dp2-mlp-interleaved-sgd", "mlp", "interleaved-1f1b", dp=2, m=2, optimizer="sgd"),
]
MEASURED = "gpt-interleaved-tied"  # also measured and checkpointed (world 2)


def _optimizer(kind: str) -> Any:
    if kind == "adam":  # eps as test_parity's: noise-level gradients take noise-sized steps
        return lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=1e-6)
    return lambda ps: torch.optim.SGD(ps, lr=0.1)


def _model(case: Case) -> nn.Module:
    torch.manual_seed(0)
    return build(case.model)


# --------------------------------------------------------------------------- the worker


def _worker(cases: list[Case], ckpt_dir: str) -> dict[str, dict[str, Any]]:
    """Runs on every rank: each case pipelined, and (on rank 0) its reference."""
    import torch.distributed as dist

    from runtime.engine import ParallelModel

    results = {}
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
        out: dict[str, Any] = {
            "stages": [st.index for st in pm.stages],
            "method": pm.stage.method,
            "ddp": [st.ddp for st in pm.stages],
            "trainable": [bool(st.trainable()) for st in pm.stages],
            "tied": [(g.stages, g.ranks) for g in pm.tied.groups],
            "prefix": pm.mesh.prefix,
        }
        recorder = _recorder(pm) if case.name == MEASURED else None
        losses, grads = [], {}
        for k, (x, y) in enumerate(batches):
            if case.name == MEASURED and k == STEPS - 1:  # saved after step 2, resumed
                out["resumed"] = _resume(pm, case, plan, batches, ckpt_dir)
            losses.append(pm.step(x, y))
            if k == 0:
                grads = _grads(pm)
        out["losses"] = losses
        out["final"] = _copies(pm)
        if recorder is not None:
            out["measured"] = _measured(pm, recorder)
        full = pm.state_dict()
        every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object((_copies(pm), grads), every, dst=0)
        if dist.get_rank() == 0:
            out.update(_reference(case, reference, batches, full, every))
        results[case.name] = out
    return results


def _copies(pm: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in pm.stage_state_dict().items()}


def _grads(pm: Any) -> dict[str, torch.Tensor]:
    """This rank's gradients after a step, under the model's names (each tied copy's own)."""
    out = {}
    for st in pm.stages:
        for name, p in st.module.named_parameters():
            if p.grad is not None:
                out[name] = p.grad.detach().cpu().clone()
    return out


def _reference(
    case: Case, reference: nn.Module, batches: list[Any], full: dict[str, Any], every: Any
) -> dict[str, Any]:
    loss_fn = loss_for(case.model)
    opt = _optimizer(case.optimizer)(reference.parameters())
    ref_losses, ref_grads = [], {}
    for k, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = loss_fn(reference(x), y)
        loss.backward()
        if k == 0:  # every name of a tied tensor gets its (one) gradient
            ref_grads = {
                n: p.grad.clone()
                for n, p in reference.named_parameters(remove_duplicate=False)
                if p.grad is not None
            }
        opt.step()
        ref_losses.append(loss.item())
    mismatches = []
    for name, want in reference.state_dict().items():
        got = full.get(name)
        if got is None:
            if name in dict(reference.named_parameters()):
                mismatches.append(f"{name}: missing from state_dict()")
            continue
        mismatches += _differs(name, got, want.detach())
    seen_grads = 0
    for _, grads in every:
        for name, got in grads.items():
            seen_grads += 1
            mismatches += _differs(f"grad {name}", got, ref_grads[name])
    spread = 0.0
    seen: dict[str, torch.Tensor] = {}
    for part, _ in every:
        for k, v in part.items():
            if k in seen:
                spread = max(spread, (seen[k].float() - v.float()).abs().max().item())
            else:
                seen[k] = v
    return {
        "ref_losses": ref_losses,
        "mismatches": mismatches,
        "copy_spread": spread,
        "grads_checked": seen_grads,
        "params": len(list(reference.parameters())),
    }


def _differs(name: str, got: torch.Tensor, want: torch.Tensor) -> list[str]:
    try:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    except AssertionError as exc:
        return [f"{name}: {str(exc).splitlines()[0:4]}"]
    return []


def _recorder(pm: Any) -> Any:
    from runtime.measure.recorder import Recorder

    return Recorder(pm, warmup_steps=1)


def _measured(pm: Any, recorder: Any) -> dict[str, Any]:
    """Per-stage figures and the comparison table (rank 0), per-rank intervals (all)."""
    from runtime.measure.compare import comparison_table, trace_json

    result = recorder.gather()
    recorder.close()
    mine = recorder.record()
    out: dict[str, Any] = {
        "interval_stages": sorted({(iv.kind, iv.stage) for iv in mine.intervals if iv.stage >= 0}),
        "peak": mine.peak_bytes,
    }
    if result is not None:
        out["figures"] = {s: result.stage_figures(s) for s in range(4)}
        out["table"] = comparison_table(pm.plan, result, width=200)
        trace = trace_json(result)
        out["lanes"] = sorted(
            {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e.get("ph") == "X"}
        )
    return out


def _resume(pm: Any, case: Case, plan: Plan, batches: list[Any], ckpt_dir: str) -> dict[str, Any]:
    """Save ``pm`` (after step 2), resume it into a fresh model (other initial weights),
    run step 3 there: the step it resumed at, the loss and the weights it ends with."""
    from runtime.checkpoint import load, save
    from runtime.engine import ParallelModel

    path = save(pm, ckpt_dir, 2)
    torch.manual_seed(123)  # other initial weights: the checkpoint must replace them
    fresh = build(case.model)
    pm2 = ParallelModel.from_plan(
        fresh,
        plan,
        loss_fn=loss_for(case.model),
        optimizer=_optimizer(case.optimizer),
        sample=((batches[0][0],), {}),
        split=case.split,
    )
    step = load(pm2, path)
    x, y = batches[STEPS - 1]
    loss = pm2.step(x, y)
    return {"step": step, "loss": loss, "weights": _copies(pm2)}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def plans_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLANNER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield tmp_path_factory.mktemp("plans")


def _planned(cases: list[Case], tmp: Path) -> list[Case]:
    """Each case's plan: the search's own (pp 2 × v 2 pinned), or, for ``edited`` cases, a
    4-stage plan made into pp 2 × v 2 by hand (the plan format's documented edit)."""
    out = []
    for case in cases:
        path = tmp / f"{case.name}.yaml"
        if case.edited:
            four = planned_4(case.model, case.dp, case.m, case.optimizer)
            virtual_plan(four, case.schedule, path)
        else:
            planned_virtual(case.model, case.schedule, case.dp, case.m, case.optimizer, path)
        out.append(dataclasses.replace(case, plan_path=str(path)))
    return out


@pytest.fixture(scope="module")
def world2(plans_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    cases = _planned(WORLD2, plans_dir)
    return run_world(_worker, 2, args=(cases, ckpt), timeout_s=WORLD_TIMEOUT_S)


@pytest.fixture(scope="module")
def world4(plans_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    ckpt = str(tmp_path_factory.mktemp("ckpt4"))
    cases = _planned(WORLD4, plans_dir)
    return run_world(_worker, 4, args=(cases, ckpt), timeout_s=WORLD_TIMEOUT_S)


def _check(ranks: list[dict[str, Any]], case: Case) -> dict[str, Any]:
    root = ranks[0][case.name]
    assert root["method"] == case.expect_method
    assert not root["mismatches"], "\n".join(root["mismatches"])
    assert root["grads_checked"] >= root["params"], root  # every parameter's gradient compared
    for rank, res in enumerate(ranks):
        mine = res[case.name]
        assert mine["stages"] == ([0, 2] if rank % 2 == 0 else [1, 3]), (rank, mine["stages"])
        # DDP on each stage with replicas, but one that holds no parameter (runtime.stage)
        want = [case.dp > 1 and t for t in mine["trainable"]]
        assert mine["ddp"] == want and any(mine["trainable"]), (rank, mine["ddp"])
        torch.testing.assert_close(
            torch.tensor(mine["losses"]),
            torch.tensor(root["ref_losses"]),
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m, r=rank: f"rank {r} losses: {m}",
        )
    assert root["copy_spread"] <= 1e-6, f"copies differ by {root['copy_spread']}"
    return root


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(WORLD_TIMEOUT_S + 120)
@pytest.mark.parametrize("case", WORLD2, ids=lambda c: c.name)
def test_two_stages_per_rank_match_one_process(world2: list[dict[str, Any]], case: Case) -> None:
    root = _check(world2, case)
    if case.model == "gpt":  # embedding on stage 0 (rank 0), head on stage 3 (rank 1)
        assert root["tied"] == [((0, 3), (0, 1))]
    assert world2[0][case.name]["prefix"] == "[rank 0 r0 s0,2]"


@pytest.mark.timeout(WORLD_TIMEOUT_S + 120)
@pytest.mark.parametrize("case", WORLD4, ids=lambda c: c.name)
def test_two_stages_per_rank_with_ddp_match_one_process(
    world4: list[dict[str, Any]], case: Case
) -> None:
    _check(world4, case)
    if case.model == "gpt":
        assert [t for res in world4 for t in res[case.name]["tied"]] == [
            ((0, 3), (0, 1)),
            ((0, 3), (0, 1)),
            ((0, 3), (2, 3)),
            ((0, 3), (2, 3)),
        ]


@pytest.mark.timeout(WORLD_TIMEOUT_S + 120)
def test_a_measured_run_records_each_stage(world2: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(world2):
        got = res[MEASURED]["measured"]
        mine = [0, 2] if rank == 0 else [1, 3]
        want = {("F", s) for s in mine} | {("B", s) for s in mine}
        if rank == 1:
            want.add(("loss", 3))
        assert set(map(tuple, got["interval_stages"])) == want, (rank, got["interval_stages"])
        assert got["peak"] > 0
    root = world2[0][MEASURED]["measured"]
    for s, fig in root["figures"].items():
        assert fig["fwd_ms"] > 0 and fig["bwd_ms"] > 0 and fig["peak_bytes"] > 0, (s, fig)
    assert "2 stages per rank" in root["table"], root["table"]
    assert [line.split()[0] for line in root["table"].splitlines()[2:6]] == ["0", "1", "2", "3"]
    assert root["lanes"] == [(0, 0), (0, 2), (0, 1000), (1, 1), (1, 3), (1, 1000)]


@pytest.mark.timeout(WORLD_TIMEOUT_S + 120)
def test_a_checkpoint_resumes_bit_identical(world2: list[dict[str, Any]]) -> None:
    """Saved after step 2 (Adam's state included), resumed into a model of other initial
    weights, step 3 there ends where the uninterrupted run's step 3 does, bit for bit."""
    for rank, res in enumerate(world2):
        out = res[MEASURED]
        resumed = out["resumed"]
        assert resumed["step"] == 2
        assert resumed["loss"] == out["losses"][2], (rank, resumed["loss"], out["losses"])
        assert resumed["weights"].keys() == out["final"].keys()
        assert len(out["final"]) >= 4, out["final"].keys()  # the rank's two stages' weights
        differ = [k for k, v in resumed["weights"].items() if not torch.equal(v, out["final"][k])]
        assert not differ, (rank, differ)
