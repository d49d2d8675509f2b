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
pp 2 × v 2 × dp 2 (Interleaved 1F1B and Looped BFS, two stages per rank), the
GPT with its tied embedding and head. A pp 1 × dp 2 checkpoint also loads, with
``reshard``, into a pp 2 × dp 1 run: each stage whole on one rank, with the
saved weights and every parameter's state as the replica that stepped it had it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dp_mode_runs import (
    CASES,
    STEPS,
    WORLD_TIMEOUT_S,
    Trainer,
    reference_run,
    reshard_differences,
    resharded,
    resharded_run,
    trained_like_one_process,
)

pytestmark = pytest.mark.multiprocess


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

    trainer = Trainer(name, plan_path)
    run, batches, reference = trainer.run, trainer.batches, trainer.reference
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
        out.update(reference_run(name, reference, batches, full, copies))
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


@pytest.mark.timeout(2 * WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_zero1_trains_like_one_process_on_disjoint_shares_and_resumes_exactly(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "cache"))
    ranks = trained_like_one_process(_worker, case, tmp_path, "zero1")
    by_stage: dict[int, list[dict[str, Any]]] = {}
    for rank, res in enumerate(ranks):
        assert res["resumed"] == "", (rank, res["resumed"])
        assert res["into_ddp"] == "", (rank, res["into_ddp"])
        by_stage.setdefault(res["stage"], []).append(res)
    for stage, replicas in by_stage.items():
        every = replicas[0]["trainable"]
        shares = [r["stepped"] for r in replicas]
        assert len(shares) == 2 and all(0 < len(s) < len(every) for s in shares), shares
        assert sorted(n for s in shares for n in s) == every, (stage, shares)


def _resharded_worker(plan_path: str, name: str, pp2_path: str) -> str:
    """Train the ZeRO-1 plan, save; load into the pp 2 × dp 1 plan with ``reshard``: "" when
    this rank's stage holds the saved weights and every parameter's optimizer state (each
    saved by the replica that stepped it), else what differs."""
    import torch.distributed as dist

    def state(pm: Any) -> dict[str, torch.Tensor]:
        names = _named(pm)
        return {
            f"{names[id(p)].split(':', 1)[1]}.{key}": torch.as_tensor(v).detach().clone()
            for p, st in pm.optimizer.state.items() for key, v in st.items()
        }  # fmt: skip

    pm, other = resharded_run(plan_path, name, pp2_path)
    shares: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, state(pm))
    want = {k: v for share in shares for k, v in share.items()}
    got = state(other)
    every = {n.split(":", 1)[1] for n in _trainable(other)}
    if {k.rsplit(".", 1)[0] for k in got} != every:
        return f"optimizer state {sorted(got)[:4]}, the stage trains {sorted(every)[:4]}"
    return reshard_differences(want, got, pm.stage_state_dict(), other)


@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
def test_a_zero1_checkpoint_reshards_into_a_pipeline_of_another_dp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pp 1 × dp 2 (each replica steps a share) saved, resumed as pp 2 × dp 1 (DDP)."""
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "cache"))
    assert resharded(_resharded_worker, tmp_path, "zero1") == ["", ""]
