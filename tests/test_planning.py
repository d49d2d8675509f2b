"""Planning a small model end to end (planner.planning): stages, a proof, reproducible files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import tower_plan

from planner.plan import Plan, save_plan


@pytest.fixture(autouse=True)
def _empty_cache(cache_dir):
    """Every test plans into an empty profile cache."""


@pytest.fixture(scope="module")
def plan() -> Plan:
    return tower_plan(pp=2)


def test_plan_has_stages_ranks_and_a_proof(plan: Plan) -> None:
    assert plan.pp == 2 and plan.dp == 2 and len(plan.stages) == 2
    assert plan.global_batch == plan.dp * plan.micro_batches * plan.micro_batch_size
    assert plan.stages[0].split_point == "" and plan.stages[1].split_point
    assert sorted(r for s in plan.stages for r in s.ranks) == [0, 1, 2, 3]
    assert plan.solver.status == "optimal" and plan.solver.gap == 0
    assert plan.candidates and plan.candidates[0].status == "chosen"
    assert plan.predicted.step_ms > 0
    assert plan.model.file == "tower.py" and len(plan.model.fingerprint or "") == 16
    # The head shares the embedding's weight: the stage without the owner pays for a copy.
    assert plan.stages[1].memory.tied_copies > 0
    assert plan.profiles and plan.profiles[0].tied


def test_same_inputs_give_the_same_placement() -> None:
    a, b = tower_plan(pp=2), tower_plan(pp=2)
    assert [s.blocks for s in a.stages] == [s.blocks for s in b.stages]
    assert a.micro_batches == b.micro_batches and a.schedule == b.schedule


def test_same_inputs_give_byte_identical_files(tmp_path: Path) -> None:
    # [Note: reproducible plan files]; the search is free here (pp unpinned).
    first = save_plan(tower_plan(), tmp_path / "a.yaml").read_bytes()
    second = save_plan(tower_plan(), tmp_path / "b.yaml").read_bytes()
    assert first == second


class BatchOneShortcut(torch.nn.Module):
    """A library's batch-1 branch: one op fewer at micro-batch 1 (the traced graphs differ)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.head = torch.nn.Linear(16, 32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        if idx.shape[0] > 1:
            bias = torch.zeros(idx.shape[1], 1).expand(idx.shape[0], -1, -1)
        else:
            bias = torch.zeros(1, idx.shape[1], 1)
        for layer in self.layers:
            h = torch.relu(layer(h)) + bias
        return self.head(h)


def test_profiles_at_micro_batch_one_combine_with_larger_ones() -> None:
    from planner.devices import from_gpus
    from planner.options import PlanOptions, SearchOptions, Training
    from planner.planning import plan_model

    torch.manual_seed(0)
    ids = torch.randint(0, 32, (8, 6))
    options = PlanOptions(training=Training(global_batch=8), search=SearchOptions(pp=2, dp=1))
    plan = plan_model(
        BatchOneShortcut(),
        (ids, ids),
        cluster=from_gpus(2, "h100"),
        loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
        options=options,
    )
    assert plan.pp == 2
    assert {p.batch_size for p in plan.profiles} == {1, 8}  # both anchors, one model
