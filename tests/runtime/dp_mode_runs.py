"""What the dp modes' run tests share (test_zero1_runs.py, test_fsdp_runs.py): the cases,
their plans, and one process's training of the same batches to compare with."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from small_examples import batch, build, loss_for
from world import run_world

from planner.devices import from_gpus
from planner.options import PlanOptions, SearchOptions, Training
from planner.plan import load_plan, save_plan
from planner.planning import plan_model

__all__ = [
    "ATOL",
    "BATCH",
    "CASES",
    "RTOL",
    "STEPS",
    "WORLD_TIMEOUT_S",
    "Trainer",
    "adam",
    "fresh_model",
    "plan_file",
    "planned",
    "reference_run",
    "reshard_differences",
    "resharded",
    "resharded_run",
    "trained_like_one_process",
]

STEPS = 3
BATCH = 8
RTOL, ATOL = 1e-4, 1e-5  # as tests/runtime/test_parity.py
WORLD_TIMEOUT_S = 180

CASES = {  # name: world size, model, pp, schedule, stages per rank, micro-batches
    "pp1-dp2-mlp": (2, "mlp", 1, "gpipe", 1, 2),
    "pp2-dp2-gpt": (4, "gpt", 2, "1f1b", 1, 2),
    "pp2-v2-dp2-gpt": (4, "gpt", 2, "interleaved-1f1b", 2, 4),
    "pp2-v2-dp2-gpt-looped": (4, "gpt", 2, "looped-bfs", 2, 4),
}


def adam(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(ps, lr=1e-3, eps=1e-6)  # eps: as test_parity's


def fresh_model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build(name)


def planned(case: str, tmp: Path, dp_mode: str) -> str:
    """The case planned by the search with its configuration and ``dp_mode`` pinned; the
    plan file's path."""
    world, name, pp, schedule, v, m = CASES[case]
    search = SearchOptions(
        pp=pp, dp=2, micro_batches=m, schedule=schedule, virtual=v, dp_mode=dp_mode
    )
    return plan_file(name, world, search, tmp / f"{dp_mode}-{case}.yaml")


def plan_file(name: str, world: int, search: SearchOptions, path: Path) -> str:
    """The example ``name`` planned for ``world`` devices as ``search`` pins it, saved at
    ``path``; the path."""
    x, y = batch(name, BATCH, 0)
    plan = plan_model(
        fresh_model(name), (x, y), cluster=from_gpus(world, "h100"), loss_fn=loss_for(name),
        options=PlanOptions(training=Training(global_batch=BATCH), search=search),
        model_file=f"{name}.py",
    )  # fmt: skip
    assert (plan.dp_mode, plan.virtual) == (search.dp_mode, search.virtual or 1)
    return str(save_plan(plan, path))


class Trainer:
    """In a rank: the model of ``name`` (seed 0), an untouched copy of it (``reference``), the
    batches, and :meth:`run`, a ``ParallelModel`` of a plan (``clip``: the norm to clip to;
    ``split``: how to split the model, ``runtime.split``)."""

    def __init__(
        self, name: str, plan_path: str, clip: float | None = None, split: str = "auto"
    ) -> None:
        self.name, self.plan_path, self.clip, self.split = name, plan_path, clip, split
        self.model = fresh_model(name)
        self.reference = copy.deepcopy(self.model)
        self.batches = [batch(name, BATCH, k) for k in range(STEPS)]

    def run(self, seed: int, path: str | None = None) -> Any:
        """The plan at ``path`` (default: this trainer's) over the model (seed 0) or a fresh
        one of another seed (other starting weights)."""
        from runtime.engine import ParallelModel

        return ParallelModel.from_plan(
            self.model if seed == 0 else fresh_model(self.name, seed),
            load_plan(path or self.plan_path), loss_fn=loss_for(self.name), optimizer=adam,
            sample=((self.batches[0][0],), {}), clip_grad_norm=self.clip, split=self.split,
        )  # fmt: skip


def reference_run(
    name: str,
    reference: torch.nn.Module,
    batches: list[Any],
    full: dict[str, Any],
    copies: Any,
    clip: float | None = None,
) -> dict[str, Any]:
    """One process on the whole batches (clipping the gradient norm to ``clip``): its losses
    and norms, how the run's weights ``full`` differ, and how far ``copies`` (each rank's
    tensors) spread."""
    opt = adam(reference.parameters())
    ref_losses, ref_norms = [], []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_for(name)(reference(x), y)
        loss.backward()
        if clip is not None:
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)))
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


def trained_like_one_process(
    worker: Callable[..., dict[str, Any]], case: str, tmp: Path, dp_mode: str
) -> list[dict[str, Any]]:
    """Run ``worker(plan, model name, DDP twin's plan)`` on the case's world, planned in
    ``dp_mode``; check that every rank's losses, rank 0's gathered weights and every
    rank's copies match one process's; every rank's result."""
    world, name, *_ = CASES[case]
    plans = (planned(case, tmp, dp_mode), name, planned(case, tmp, "ddp"))
    ranks = run_world(worker, world, args=plans, timeout_s=WORLD_TIMEOUT_S)
    root = ranks[0]
    assert not root["mismatches"], "\n".join(root["mismatches"])
    assert root["spread"] <= 1e-6, f"copies differ by {root['spread']}"
    for rank, res in enumerate(ranks):
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(root["ref_losses"]), rtol=RTOL, atol=ATOL,
            msg=lambda m, r=rank: f"rank {r} losses: {m}",
        )  # fmt: skip
    return ranks


def resharded(worker: Callable[[str, str, str], str], tmp: Path, dp_mode: str) -> list[str]:
    """The MLP at pp 1 × dp 2 in ``dp_mode`` and at pp 2 × dp 1 (GPipe) planned, and
    ``worker(that plan, "mlp", the pp 2 plan)`` run on 2 ranks: each rank's answer."""
    source = planned("pp1-dp2-mlp", tmp, dp_mode)
    pipeline = SearchOptions(pp=2, dp=1, micro_batches=2, schedule="gpipe")
    pp2 = plan_file("mlp", 2, pipeline, tmp / "pp2.yaml")
    return run_world(worker, 2, args=(source, "mlp", pp2), timeout_s=WORLD_TIMEOUT_S)


def resharded_run(plan_path: str, name: str, pp2_path: str) -> tuple[Any, Any]:
    """(``plan_path``'s run trained, a run of ``pp2_path`` loaded from its checkpoint with
    ``reshard``); a worker of :func:`resharded`."""
    from runtime.checkpoint import load, save

    trainer = Trainer(name, plan_path)
    pm = trainer.run(0)
    for x, y in trainer.batches:
        pm.step(x, y)
    path = save(pm, Path(plan_path).parent / "ckpt-reshard", STEPS)
    other = trainer.run(2, pp2_path)
    load(other, path, reshard=True)
    return pm, other


def reshard_differences(
    want: dict[str, torch.Tensor], got: dict[str, torch.Tensor], weights: dict[str, Any], other: Any
) -> str:
    """ "" when ``other`` holds optimizer state ``got`` ⊆ the saved ``want``, equal, and the
    saved ``weights``; else what differs."""
    if not got or not set(got) <= set(want):
        return f"optimizer state {sorted(got)[:4]}, saved {sorted(want)[:4]}"
    bad = [k for k, v in got.items() if not torch.equal(v, want[k])]
    bad += [k for k, v in other.stage_state_dict().items() if not torch.equal(v, weights[k])]
    return f"differ: {bad[:3]}" if bad else ""
