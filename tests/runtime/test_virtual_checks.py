"""Several stages per rank: what the runtime refuses, before any process group exists, and
a rank's stages seen as one module (what checkpoints save the optimizer's state against).

The refusals are raised by ``ParallelModel.from_plan`` in this process: a
pipeline against the rank order torch's multi-stage schedules need, pp 1
with several stages; and, on a rank, two stages sharing one tensor (the fx
split's tied weight). The zero-bubble schedules run
(tests/runtime/test_zero_bubble_runs.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from small_examples import batch, build, loss_for
from torch import nn
from virtual_plans import BATCH, planned_4, virtual_plan

from planner.plan import Plan, load_plan


@pytest.fixture(scope="module")
def gpt4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plan]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLANNER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield planned_4("gpt", 1, 4, "adam")


def _refusal(plan_path: Path) -> str:
    """What ``ParallelModel.from_plan`` says of the plan, in this process (no group needed)."""
    from runtime.engine import ParallelModel

    x, _ = batch("gpt", BATCH, 0)
    with pytest.raises(ValueError) as err:
        ParallelModel.from_plan(
            build("gpt"),
            load_plan(plan_path),
            loss_fn=loss_for("gpt"),
            optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
            sample=((x,), {}),
        )
    return str(err.value)


def test_a_pipeline_against_the_rank_order_is_refused(gpt4: Plan, tmp_path: Path) -> None:
    def swapped(d: dict[str, Any]) -> None:  # pipeline rank 0 on global rank 1
        for k, st in enumerate(d["stages"]):
            st["ranks"] = [1 - k % 2]

    msg = _refusal(virtual_plan(gpt4, "interleaved-1f1b", tmp_path / "sw.yaml", swapped))
    assert "replica 0's pipeline runs on ranks [1, 0]" in msg, msg
    assert "here [0, 1]" in msg, msg


def test_pp_1_with_several_stages_per_rank_is_refused(gpt4: Plan, tmp_path: Path) -> None:
    def one_rank(d: dict[str, Any]) -> None:
        d["layout"] |= {"pp": 1, "virtual": 4}
        for st in d["stages"]:
            st["ranks"] = [0]

    msg = _refusal(virtual_plan(gpt4, "interleaved-1f1b", tmp_path / "pp1.yaml", one_rank))
    assert "pp 1 with 4 stages per rank: one process runs the whole model" in msg, msg


# --------------------------------------------------------------------------- this rank's stages


def test_two_stages_of_a_rank_sharing_a_tensor_are_refused() -> None:
    """The fx split shares a tied weight's tensor between its stages: refused on one rank."""
    from runtime.split import StageError
    from runtime.stage import _check_unshared

    shared = nn.Linear(2, 2)
    first, third = nn.Sequential(shared), nn.Sequential(nn.ReLU(), shared)
    mesh = SimpleNamespace(stages=(0, 2), prefix="[rank 0 r0 s0,2]")
    _check_unshared([first, nn.Sequential(nn.Linear(2, 2))], mesh, "fx")  # nothing shared
    with pytest.raises(StageError) as err:
        _check_unshared([first, third], mesh, "fx")
    msg = str(err.value)
    assert "stages 0 and 2, both on this rank, hold one tensor ('0.weight' in stage 0, " in msg
    assert "'1.weight' in stage 2), as the fx split shares a tied weight" in msg, msg
    assert "fix: split with 'pipeline'" in msg, msg


def test_a_rank_s_stages_as_one_module_keep_the_model_s_names_and_tensors() -> None:
    from runtime.split import StageError
    from runtime.stage import rank_module

    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 3), nn.Linear(3, 2))
    zero, two = nn.Module(), nn.Module()
    zero.add_module("0", model[0])
    zero.add_module("1", model[1])
    two.add_module("3", model[3])
    stages = [SimpleNamespace(index=0, module=zero), SimpleNamespace(index=2, module=two)]
    one = rank_module(stages)  # type: ignore[arg-type]
    want = {n: t for n, t in model.state_dict(keep_vars=True).items() if not n.startswith("2.")}
    got = one.state_dict(keep_vars=True)
    assert list(got) == list(want)
    assert all(got[n] is want[n] for n in want)  # the same tensors, nothing copied
    names = [n for n, _ in one.named_parameters()]
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]
    assert rank_module(stages[:1]) is zero  # type: ignore[arg-type]

    clash = nn.Module()
    clash.add_module("3", nn.Linear(3, 2))  # another tensor under stage 2's names
    with pytest.raises(StageError) as err:
        rank_module([*stages, SimpleNamespace(index=4, module=clash)])  # type: ignore[list-item]
    assert "stages 2 and 4 of this rank hold different tensors named '3.weight'" in str(err.value)
