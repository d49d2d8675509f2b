"""FSDP as it runs (``layout.dp_mode: fsdp``, runtime/fsdp.py): trains like one process.

Multi-process on CPU with gloo (tests/world.py). Each case is planned by the
search with ``--dp-mode fsdp`` pinned, trains 3 Adam steps pipelined (× data
parallel) and on a deep-copied single process on the same global batches, and
requires every step's loss and global gradient norm (on every rank; each step
clipped) and every parameter to match, every
rank's copy of a tensor (replicas, tied copies) to agree after gathering, each
replica to hold half of every parameter and of its optimizer state (a shard),
and a checkpoint of the run to load back into a fresh one with every shard of
weights and optimizer state equal, and into a run of the DDP twin of the plan
(each parameter whole) with the gathered values. World 2: pp 1 × dp 2 (the
model itself, gradients accumulated over 2 micro-batches); world 4: pp 2 × dp 2
(1F1B) and pp 2 × v 2 × dp 2 (Interleaved 1F1B, two stages per rank), the GPT
with its tied embedding and head.
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
CLIP = 0.05  # below every step's gradient norm here: each step clips (the norm over shards)
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


def _params(pm: Any) -> list[tuple[str, Any]]:
    """This rank's trainable parameters, "<stage>:<name>", in the stages' order (the same
    order on every replica of a stage: collectives over them line up)."""
    return [
        (f"{st.index}:{n}", p) for st in pm.stages for n, p in st.module.named_parameters()
        if p.requires_grad
    ]  # fmt: skip


def _state(pm: Any, gather: bool) -> dict[str, torch.Tensor]:
    """Every trainable parameter's optimizer state: "<param>.<key>" → this rank's shard,
    or (``gather``) the whole tensor (a collective over the stage's replicas)."""
    from runtime.fsdp import local, whole

    out: dict[str, torch.Tensor] = {}
    for name, p in _params(pm):
        for key, value in sorted(pm.optimizer.state.get(p, {}).items()):
            value = torch.as_tensor(value)
            out[f"{name}.{key}"] = (whole if gather else local)(value).detach().clone()
    return out


def _worker(plan_path: str, name: str, ddp_path: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from runtime.checkpoint import load, save
    from runtime.engine import ParallelModel
    from runtime.fsdp import local, whole

    model = _model(name)
    reference = copy.deepcopy(model)
    batches = [batch(name, BATCH, k) for k in range(STEPS)]

    def run(seed: int, path: str = plan_path) -> Any:
        return ParallelModel.from_plan(
            model if seed == 0 else _model(name, seed), load_plan(path), loss_fn=loss_for(name),
            optimizer=_adam, sample=((batches[0][0],), {}), clip_grad_norm=CLIP,
        )  # fmt: skip

    pm = run(0)
    losses, norms = [], []
    for x, y in batches:
        losses.append(pm.step(x, y))
        norms.append(pm.last_grad_norm)
    params = _params(pm)
    out: dict[str, Any] = {
        "losses": losses,
        "norms": norms,
        "sharded": all(isinstance(p, DTensor) for _, p in params),
        "held": {n: (local(p).numel(), p.numel()) for n, p in params},
        "state_held": {k: v.numel() for k, v in _state(pm, gather=False).items() if v.dim() > 0},
    }
    path = save(pm, Path(plan_path).parent / f"ckpt-{dist.get_world_size()}", STEPS)
    fresh = run(1)  # other weights than pm's start
    load(fresh, path)
    out["resumed"] = _differences(_state(pm, False), _state(fresh, False), pm, fresh, local)
    ddp = run(2, ddp_path)
    load(ddp, path)
    out["into_ddp"] = _differences(_state(pm, True), _state(ddp, False), pm, ddp, whole)
    full = pm.state_dict()
    mine = {k: whole(v).cpu() for k, v in pm.stage_state_dict().items()}
    copies = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, copies, dst=0)
    if dist.get_rank() == 0:
        out.update(_reference(name, reference, batches, full, copies))
    return out


def _differences(
    want: dict[str, torch.Tensor], got: dict[str, torch.Tensor], pm: Any, other: Any, view: Any
) -> str:
    """ "" when ``other`` holds ``want``'s optimizer state and ``pm``'s weights (each seen
    through ``view``: the local shard, or gathered whole), else what differs."""
    if sorted(want) != sorted(got):
        return f"optimizer state {sorted(got)[:4]}, saved {sorted(want)[:4]}"
    bad = [k for k, v in want.items() if not torch.equal(v, got[k])]
    if bad:
        return f"optimizer state differs: {bad[:3]}"
    mine = {k: view(v) for k, v in pm.stage_state_dict().items()}
    back = other.stage_state_dict()
    bad = [k for k, v in mine.items() if not torch.equal(v, view(back[k]))]
    return f"weights differ: {bad[:3]}" if bad else ""


def _reference(
    name: str, reference: torch.nn.Module, batches: list[Any], full: dict[str, Any], copies: Any
) -> dict[str, Any]:
    """One process on the whole batches: its losses, and how the run's weights differ."""
    opt = _adam(reference.parameters())
    ref_losses, ref_norms = [], []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_for(name)(reference(x), y)
        loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)))
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
    return {
        "ref_losses": ref_losses, "ref_norms": ref_norms, "mismatches": mismatches,
        "spread": spread,
    }  # fmt: skip


@pytest.mark.timeout(2 * WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_fsdp_trains_like_one_process_on_shards_and_resumes_exactly(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    world, name, *_ = CASES[case]
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "cache"))
    plans = (_planned(case, tmp_path, "fsdp"), name, _planned(case, tmp_path, "ddp"))
    ranks = run_world(_worker, world, args=plans, timeout_s=WORLD_TIMEOUT_S)
    root = ranks[0]
    assert not root["mismatches"], "\n".join(root["mismatches"])
    assert root["spread"] <= 1e-6, f"copies differ by {root['spread']}"
    held: dict[str, list[int]] = {}
    for res in ranks:
        for n, (mine, _) in res["held"].items():
            held.setdefault(n, []).append(mine)
        for k, mine in res["state_held"].items():
            held.setdefault(k, []).append(mine)
    numel = {n: whole for res in ranks for n, (_, whole) in res["held"].items()}
    for key, parts in held.items():  # each replica a part, together the whole: shards
        n = numel[key.rsplit(".", 1)[0] if key not in numel else key]
        assert len(parts) == 2 and sum(parts) == n and max(parts) < n, (key, parts, n)
    for rank, res in enumerate(ranks):
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(root["ref_losses"]), rtol=RTOL, atol=ATOL,
            msg=lambda m, r=rank: f"rank {r} losses: {m}",
        )  # fmt: skip
        assert min(root["ref_norms"]) > CLIP  # every step clipped
        torch.testing.assert_close(
            torch.tensor(res["norms"]), torch.tensor(root["ref_norms"]), rtol=RTOL, atol=ATOL,
            msg=lambda m, r=rank: f"rank {r} gradient norms: {m}",
        )  # fmt: skip
        assert res["sharded"], rank
        assert res["state_held"], rank  # Adam's moments, of the shards
        assert res["resumed"] == "", (rank, res["resumed"])
        assert res["into_ddp"] == "", (rank, res["into_ddp"])
