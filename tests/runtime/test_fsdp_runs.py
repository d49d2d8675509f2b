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
(1F1B) and pp 2 × v 2 × dp 2 (Interleaved 1F1B and Looped BFS, two stages per
rank), the GPT with its tied embedding and head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dp_mode_runs import (
    ATOL,
    CASES,
    RTOL,
    STEPS,
    WORLD_TIMEOUT_S,
    Trainer,
    reference_run,
    reshard_differences,
    resharded,
    resharded_run,
    trained_like_one_process,
)

CLIP = 0.05  # below every step's gradient norm here: each step clips (the norm over shards)

pytestmark = pytest.mark.multiprocess


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
    from runtime.fsdp import local, whole

    trainer = Trainer(name, plan_path, CLIP)
    run, batches, reference = trainer.run, trainer.batches, trainer.reference
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
        out.update(reference_run(name, reference, batches, full, copies, CLIP))
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


@pytest.mark.timeout(2 * WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_fsdp_trains_like_one_process_on_shards_and_resumes_exactly(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "cache"))
    ranks = trained_like_one_process(_worker, case, tmp_path, "fsdp")
    root = ranks[0]
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
        assert min(root["ref_norms"]) > CLIP  # every step clipped
        torch.testing.assert_close(
            torch.tensor(res["norms"]), torch.tensor(root["ref_norms"]), rtol=RTOL, atol=ATOL,
            msg=lambda m, r=rank: f"rank {r} gradient norms: {m}",
        )  # fmt: skip
        assert res["sharded"], rank
        assert res["state_held"], rank  # Adam's moments, of the shards
        assert res["resumed"] == "", (rank, res["resumed"])
        assert res["into_ddp"] == "", (rank, res["into_ddp"])


def _resharded_worker(plan_path: str, name: str, pp2_path: str) -> str:
    """Train the FSDP plan, save; load into the pp 2 × dp 1 plan with ``reshard``: "" when
    this rank's stage holds the gathered weights and optimizer state, else what differs."""
    from runtime.fsdp import whole

    pm, other = resharded_run(plan_path, name, pp2_path)
    want = {k.split(":", 1)[1]: v for k, v in _state(pm, gather=True).items()}
    weights = {k: whole(v) for k, v in pm.stage_state_dict().items()}
    got = {k.split(":", 1)[1]: v for k, v in _state(other, gather=False).items()}
    return reshard_differences(want, got, weights, other)


@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
def test_an_fsdp_checkpoint_reshards_into_a_pipeline_of_another_dp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pp 1 × dp 2 (FSDP shards) saved, resumed as pp 2 × dp 1 (each stage whole on one rank)."""
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "cache"))
    assert resharded(_resharded_worker, tmp_path, "fsdp") == ["", ""]
