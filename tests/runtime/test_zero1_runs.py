"""ZeRO-1 as it runs (``layout.dp_mode: zero1``, runtime/zero.py): trains like one process.

Multi-process on CPU with gloo (tests/world.py). Each case is planned by the
search with ``--dp-mode zero1`` pinned, trains 3 Adam steps pipelined (× data
parallel) and on a deep-copied single process on the same global batches, and
requires every step's loss (on every rank) and every parameter to match, every
rank's copy of a tensor (DDP replicas, tied copies) to agree, each replica's
optimizer to step a share of its stage's parameters (the shares of a stage's
replicas disjoint, and covering it), and a checkpoint of the run to load back
into a fresh one with every rank's optimizer state and weights equal, and into
a run of the DDP twin of the plan with every rank holding the state of all its
stages' parameters (its own share's equal to what it stepped). World 2:
pp 1 × dp 2 (the model itself under DDP); world 4: pp 2 × dp 2 (1F1B), and
pp 2 × v 2 × dp 2 (Interleaved 1F1B, two stages per rank), the GPT with its
tied embedding and head.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from small_examples import batch, build, loss_for
from world import run_world

from planner.devices import from_gpus
from planner.options import PlanOptions, SearchOptions, Training
from planner.plan import load_plan, save_plan
from planner.planning import plan_model

STEPS = 3
BATCH = 8
RTOL, ATOL = 1e-4, 1e-5  # as tests/runtime/test_parity.py
WORLD_TIMEOUT_S = 180

pytestmark = pytest.mark.multiprocess

CASES = {  # name: world size, model, pp, schedule, stages per rank, micro-batches
    "pp1-dp2-mlp": (2, "mlp", 1, "gpipe", 1, 2),
    "pp2-dp2-gpt": (4, "gpt", 2, "1f1b", 1, 2),
    "pp2-v2-dp2-gpt": (4, "gpt", 2, "interleaved-1f1b", 2, 4),
}


def _adam(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(ps, lr=1e-3, eps=1e-6)  # eps: as test_parity's


def _model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build(name)


def _planned(case: str, tmp: Path, dp_mode: str) -> str:
    world, name, pp, schedule, v, m = CASES[case]
    x, y = batch(name, BATCH, 0)
    search = SearchOptions(
        pp=pp, dp=2, micro_batches=m, schedule=schedule, virtual=v, dp_mode=dp_mode
    )
    plan = plan_model(
        _model(name), (x, y), cluster=from_gpus(world, "h100"), loss_fn=loss_for(name),
        options=PlanOptions(training=Training(global_batch=BATCH), search=search),
        model_file=f"{name}.py",
    )  # fmt: skip
    assert (plan.dp_mode, plan.virtual) == (dp_mode, v)
    return str(save_plan(plan, tmp / f"{dp_mode}-{case}.yaml"))


def _named(pm: Any) -> dict[int, str]:
    """Every parameter of this rank's stages: "<stage>:<name>"."""
    return {id(p): f"{st.index}:{n}" for st in pm.stages for n, p in st.module.named_parameters()}


def _trainable(pm: Any) -> list[str]:
    return sorted(
        f"{st.index}:{n}" for st in pm.stages for n, p in st.module.named_parameters()
        if p.requires_grad
    )  # fmt: skip


def _worker(plan_path: str, name: str, ddp_path: str) -> dict[str, Any]:
    import torch.distributed as dist

    from runtime.checkpoint import load, save
    from runtime.engine import ParallelModel

    model = _model(name)
    reference = copy.deepcopy(model)
    batches = [batch(name, BATCH, k) for k in range(STEPS)]

    def run(seed: int, path: str = plan_path) -> Any:
        return ParallelModel.from_plan(
            model if seed == 0 else _model(name, seed), load_plan(path), loss_fn=loss_for(name),
            optimizer=_adam, sample=((batches[0][0],), {}),
        )  # fmt: skip

    pm = run(0)
    losses = [pm.step(x, y) for x, y in batches]
    names = _named(pm)
    stepped = [p for g in pm.optimizer.param_groups for p in g["params"]] if pm.optimizer else []
    out: dict[str, Any] = {
        "losses": losses,
        "stage": pm.mesh.stage,
        "trainable": _trainable(pm),
        "stepped": sorted(names[id(p)] for p in stepped),
    }
    path = save(pm, Path(plan_path).parent / f"ckpt-{dist.get_world_size()}", STEPS)
    fresh = run(1)  # other weights than pm's start
    load(fresh, path)
    out["resumed"] = _differences(pm, fresh)
    ddp = run(2, ddp_path)
    load(ddp, path)
    out["into_ddp"] = _into_ddp(pm, ddp)
    full = pm.state_dict()
    copies = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object({k: v.cpu() for k, v in pm.stage_state_dict().items()}, copies, dst=0)
    if dist.get_rank() == 0:
        out.update(_reference(name, reference, batches, full, copies))
    return out


def _differences(pm: Any, fresh: Any) -> str:
    """ "" when ``fresh`` holds ``pm``'s optimizer state and weights, else what differs."""
    want, got = pm.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    if sorted(want) != sorted(got):
        return f"optimizer state of {sorted(got)}, saved {sorted(want)}"
    for k, state in want.items():
        for key, value in state.items():
            if not torch.equal(torch.as_tensor(value), torch.as_tensor(got[k][key])):
                return f"optimizer state {k}.{key} differs"
    mine, back = pm.stage_state_dict(), fresh.stage_state_dict()
    bad = [k for k, v in mine.items() if not torch.equal(v, back[k])]
    return f"weights differ: {bad[:3]}" if bad else ""


def _into_ddp(pm: Any, ddp: Any) -> str:
    """ "" when the DDP run ``ddp`` holds optimizer state for every parameter of its stage,
    this rank's share's equal to ``pm``'s, and ``pm``'s weights; else what differs."""
    names = _named(ddp)
    have = {names[id(p)]: st for p, st in ddp.optimizer.state.items() if st}
    every = _trainable(ddp)
    if sorted(have) != every:
        return f"state for {sorted(have)}, the stages train {every}"
    mine = _named(pm)
    for p, st in pm.optimizer.state.items():
        for key, value in st.items():
            if not torch.equal(torch.as_tensor(value), torch.as_tensor(have[mine[id(p)]][key])):
                return f"optimizer state {mine[id(p)]}.{key} differs"
    back = ddp.stage_state_dict()
    bad = [k for k, v in pm.stage_state_dict().items() if not torch.equal(v, back[k])]
    return f"weights differ: {bad[:3]}" if bad else ""


def _reference(
    name: str, reference: torch.nn.Module, batches: list[Any], full: dict[str, Any], copies: Any
) -> dict[str, Any]:
    """One process on the whole batches: its losses, and how the run's weights differ."""
    opt = _adam(reference.parameters())
    ref_losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_for(name)(reference(x), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    mismatches = []
    for key, want in reference.named_parameters():
        try:
            torch.testing.assert_close(full[key], want.detach(), rtol=RTOL, atol=ATOL)
        except (AssertionError, KeyError) as exc:
            mismatches.append(f"{key}: {str(exc).splitlines()[:3]}")
    spread, seen = 0.0, {}
    for part in copies:
        for k, v in part.items():
            if k in seen:
                spread = max(spread, (seen[k].float() - v.float()).abs().max().item())
            seen.setdefault(k, v)
    return {"ref_losses": ref_losses, "mismatches": mismatches, "spread": spread}


@pytest.mark.timeout(2 * WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_zero1_trains_like_one_process_on_disjoint_shares_and_resumes_exactly(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    world, name, *_ = CASES[case]
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "cache"))
    plans = (_planned(case, tmp_path, "zero1"), name, _planned(case, tmp_path, "ddp"))
    ranks = run_world(_worker, world, args=plans, timeout_s=WORLD_TIMEOUT_S)
    root = ranks[0]
    assert not root["mismatches"], "\n".join(root["mismatches"])
    assert root["spread"] <= 1e-6, f"copies differ by {root['spread']}"
    by_stage: dict[int, list[dict[str, Any]]] = {}
    for rank, res in enumerate(ranks):
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(root["ref_losses"]), rtol=RTOL, atol=ATOL,
            msg=lambda m, r=rank: f"rank {r} losses: {m}",
        )  # fmt: skip
        assert res["resumed"] == "", (rank, res["resumed"])
        assert res["into_ddp"] == "", (rank, res["into_ddp"])
        by_stage.setdefault(res["stage"], []).append(res)
    for stage, replicas in by_stage.items():
        every = replicas[0]["trainable"]
        shares = [r["stepped"] for r in replicas]
        assert len(shares) == 2 and all(0 < len(s) < len(every) for s in shares), shares
        assert sorted(n for s in shares for n in s) == every, (stage, shares)
