"""A plan's fields must agree when it loads (planner.plan.schema.check_consistent).

Each test edits one real plan's file (the tower of ``tests/models.py``, planned
at pp = 2: stage 1 starts at ``layers.3`` and holds blocks 4..8) the way a
person editing it by hand might, and checks that loading refuses it with the
key path and the numbers, before any worker starts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from models import tower_plan

from planner.plan import Plan, PlanError, load_plan


@pytest.fixture(autouse=True)
def _empty_cache(cache_dir):
    """Every test plans into an empty profile cache."""


@pytest.fixture(scope="module")
def plan() -> Plan:
    return tower_plan(pp=2)


def _load_edited(plan: Plan, tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Plan:
    data = plan.to_dict()
    edit(data)
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_plan(path)


def _refused(plan: Plan, tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> str:
    with pytest.raises(PlanError) as err:
        _load_edited(plan, tmp_path, edit)
    return str(err.value)


def _no_profile(d: dict[str, Any]) -> None:
    d.pop("profiles")


def test_the_fixture_is_what_the_tests_assume(plan: Plan) -> None:
    one = plan.stages[1]
    assert one.split_point == "layers.3" and one.blocks == (4, 8)
    assert one.modules == ("layers.3", "layers.4", "layers.5", "head")
    assert [b.name for b in plan.profiles[0].blocks][4] == "layers.3"


def test_a_real_plan_loads_with_and_without_its_profile(plan: Plan, tmp_path: Path) -> None:
    loaded = _load_edited(plan, tmp_path, lambda d: None)
    assert loaded.to_dict() == plan.to_dict()
    assert _load_edited(plan, tmp_path, _no_profile).stages == loaded.stages


@pytest.mark.parametrize("key", ["micro_batches", "micro_batch_size"])
def test_zero_micro_batches_or_samples_are_refused_even_when_the_product_holds(
    plan: Plan, tmp_path: Path, key: str
) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["training"].update({key: 0, "global_batch": 0})  # dp × ... × 0 = 0: consistent

    msg = _refused(plan, tmp_path, edit)
    assert f"training.global_batch 0, training.{key} 0: must be ≥ 1" in msg, msg


def test_a_negative_global_batch_is_refused(plan: Plan, tmp_path: Path) -> None:
    msg = _refused(plan, tmp_path, lambda d: d["training"].update(global_batch=-16))
    assert "training.global_batch -16: must be ≥ 1" in msg, msg


@pytest.mark.parametrize("profile", [True, False], ids=["profile", "no-profile"])
def test_a_split_point_moved_inside_its_stage_is_refused(
    plan: Plan, tmp_path: Path, profile: bool
) -> None:
    # The measured case: only split_point edited. Before, it ran on the edited split.
    def edit(d: dict[str, Any]) -> None:
        d["stages"][1]["split_point"] = "layers.4"
        if not profile:
            _no_profile(d)

    msg = _refused(plan, tmp_path, edit)
    assert "stages[1].split_point 'layers.4' is not the stage's first module call" in msg, msg
    assert "(modules[0] is 'layers.3')" in msg, msg


def test_a_split_point_moved_with_its_modules_but_not_its_blocks_is_refused(
    plan: Plan, tmp_path: Path
) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["stages"][0]["modules"].append("layers.3")
        d["stages"][1]["modules"].remove("layers.3")
        d["stages"][1]["split_point"] = "layers.4"

    msg = _refused(plan, tmp_path, edit)
    assert "stages[0].modules (5) are not those of its blocks [0, 4] (4 in" in msg, msg
    assert "not in its blocks ['layers.3']" in msg, msg


def test_with_the_profile_the_split_point_must_name_the_first_block(
    plan: Plan, tmp_path: Path
) -> None:
    # Modules and split point moved together, stage 0 left alone: only the profile can tell.
    def edit(d: dict[str, Any]) -> None:
        d["stages"][1]["modules"].remove("layers.3")
        d["stages"][1]["split_point"] = "layers.4"

    msg = _refused(plan, tmp_path, edit)
    assert "stages[1].split_point is 'layers.4' but its first block, 4, starts at 'layers.3'" in msg
    assert "profiles[0].blocks[4].name" in msg, msg


def test_without_a_profile_a_consistent_move_is_all_that_can_be_checked(
    plan: Plan, tmp_path: Path
) -> None:
    def edit(d: dict[str, Any]) -> None:
        _no_profile(d)
        d["stages"][0]["modules"].append("layers.3")
        d["stages"][1]["modules"].remove("layers.3")
        d["stages"][1]["split_point"] = "layers.4"

    assert _load_edited(plan, tmp_path, edit).split_points == ["layers.4"]


def test_modules_that_are_not_those_of_the_blocks_are_refused(plan: Plan, tmp_path: Path) -> None:
    msg = _refused(plan, tmp_path, lambda d: d["stages"][1]["modules"].remove("head"))
    assert "stages[1].modules (3) are not those of its blocks [4, 8] (4 in" in msg, msg
    assert "missing ['head']" in msg, msg
    reordered = _refused(plan, tmp_path, lambda d: d["stages"][1]["modules"].reverse())
    assert "stages[1].split_point 'layers.3' is not the stage's first module call" in reordered
    swapped = _refused(
        plan,
        tmp_path,
        lambda d: d["stages"][1].update(modules=["layers.3", "layers.5", "layers.4", "head"]),
    )
    assert "another order" in swapped, swapped


def test_the_first_stage_has_no_split_point(plan: Plan, tmp_path: Path) -> None:
    msg = _refused(plan, tmp_path, lambda d: d["stages"][0].update(split_point="emb"))
    assert "stages[0].split_point is 'emb'; the first stage starts at the model's inputs" in msg


def test_a_stage_without_modules_loads_only_where_its_blocks_have_none(
    plan: Plan, tmp_path: Path
) -> None:
    # The planner writes stages without module calls (torchvision's ViT-B/16 at pp 4):
    # without the profile nothing contradicts one; with it, its blocks' modules must match.
    def emptied(d: dict[str, Any]) -> None:
        d["stages"][1]["modules"] = []

    msg = _refused(plan, tmp_path, emptied)
    assert "stages[1].modules (0) are not those of its blocks [4, 8] (4 in" in msg, msg

    def without_profile(d: dict[str, Any]) -> None:
        _no_profile(d)
        emptied(d)

    assert _load_edited(plan, tmp_path, without_profile).stages[1].modules == ()


@pytest.fixture(scope="module")
def four() -> Plan:
    """The tower on 4 devices, 4 stages (pp 4 × dp 1): made into pp 2 × 2 stages per rank."""
    return tower_plan(4, pp=4, dp=1, micro_batches=4)


def _interleaved(d: dict[str, Any]) -> None:
    """pp 4 → pp 2 with 2 stages per rank: stages 0, 2 on the devices of 0, 1, 3 on 1's."""
    d["layout"] |= {"pp": 2, "virtual": 2}
    d["training"]["schedule"] = "interleaved-1f1b"
    d.pop("step")
    for k, st in enumerate(d["stages"]):
        st["ranks"] = [k % 2]


def test_a_plan_of_two_stages_per_rank_loads_and_says_so(four: Plan, tmp_path: Path) -> None:
    from planner.plan.schema import plan_summary

    got = _load_edited(four, tmp_path, _interleaved)
    assert (got.pp, got.virtual, len(got.stages), got.world_size) == (2, 2, 4, 2)
    assert got.stage_ranks == (0, 1, 0, 1)
    assert got.ranks() == [[0, 1, 0, 1]]
    assert "(interleaved-1f1b, 2 stages per rank)" in plan_summary(got)
    assert four.virtual == 1 and "virtual: 1" in yaml.safe_dump(four.to_dict())


def test_stages_of_one_pipeline_rank_must_share_its_devices(four: Plan, tmp_path: Path) -> None:
    def moved(d: dict[str, Any]) -> None:
        _interleaved(d)
        d["stages"][2]["ranks"] = [1]

    msg = _refused(four, tmp_path, moved)
    assert (
        "stages[2].ranks [1] differ from [0], those of the other stages of pipeline rank 0" in msg
    )


def test_a_one_stage_schedule_with_several_stages_per_rank_is_refused(
    four: Plan, tmp_path: Path
) -> None:
    def one_stage(d: dict[str, Any]) -> None:
        _interleaved(d)
        d["training"]["schedule"] = "1f1b"

    msg = _refused(four, tmp_path, one_stage)
    assert "training.schedule: 1f1b runs one stage per rank (v 2); fix: layout.virtual: 1" in msg


def test_the_stage_count_is_pp_times_virtual(four: Plan, tmp_path: Path) -> None:
    msg = _refused(four, tmp_path, lambda d: (_interleaved(d), d["layout"].update(virtual=3)))
    assert "layout.pp × layout.virtual is 2 × 3 but stages lists 4 stages" in msg
