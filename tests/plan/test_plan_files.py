"""Plan files: saving, loading, validating, the older formats (planner.plan.files, schema)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from models import tower_plan

from planner.plan import Plan, PlanError, load_plan, save_plan


@pytest.fixture(autouse=True)
def _empty_cache(cache_dir):
    """Every test plans into an empty profile cache."""


@pytest.fixture(scope="module")
def plan() -> Plan:
    return tower_plan(pp=2)


def test_save_and_load_round_trip(plan: Plan, tmp_path: Path) -> None:
    path = save_plan(plan, tmp_path / "plan.yaml")
    again = load_plan(path)
    assert again.to_dict() == plan.to_dict()
    # Saving the loaded plan gives the same bytes.
    path2 = save_plan(again, tmp_path / "plan2.yaml")
    assert path.read_bytes() == path2.read_bytes()
    assert not list(tmp_path.glob(".*.tmp"))


def _edited(plan: Plan, tmp_path: Path, edit) -> Path:
    data = plan.to_dict()
    edit(data)
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d.update(version=99),
            "version 99 is not supported (this planner reads versions 1, 2 and 3",
        ),
        (lambda d: d.pop("version"), "no version is not supported"),
        (lambda d: d["solver"].update(solve_s=0.5), "solver: unknown key(s) solve_s"),
        (lambda d: d["layout"].update(pp="two"), "layout.pp: expected an integer, got str"),
        (lambda d: d["stages"][1].pop("ranks"), "stages[1].ranks: missing"),
        (
            lambda d: d["stages"][0].update(ranks=[0, "x"]),
            "stages[0].ranks[1]: expected an integer",
        ),
        (lambda d: d["training"].update(global_batch=15), "global_batch 15 ≠ dp × micro_batches"),
        (lambda d: d["stages"][1].update(blocks=[5, 9]), "must start at"),
        (lambda d: d["stages"][1].update(ranks=d["stages"][0]["ranks"]), "ranks reuses rank(s)"),
        (lambda d: d.update(colour="blue"), "unknown key(s) colour"),
        (lambda d: d["stages"][0].update(recompute=1), "recompute: expected true/false"),
        (
            lambda d: d["layout"].update(dp=1, dp_mode="fsdp"),
            "layout.dp_mode 'fsdp' with layout.dp 1: choose one of ddp, zero1, fsdp; zero1 "
            "and fsdp shard state among replicas (dp ≥ 2)",
        ),
        (lambda d: d["layout"].update(dp_mode="zero3"), "layout.dp_mode 'zero3' with"),
    ],
)
def test_malformed_plans_name_the_key_path(plan, tmp_path, edit, message) -> None:
    with pytest.raises(PlanError) as err:
        load_plan(_edited(plan, tmp_path, edit))
    assert message in str(err.value)


def as_version(data: dict, version: int) -> dict:
    """A current plan's data in the shape of format 1 or 2 (what their files held)."""
    old = {k: v for k, v in data.items() if k != "step"}
    model = dict(old["model"])
    shapes = model.pop("parameter_shapes")
    old["model"] = {**model, "fingerprint": "3dcb3ffbdee89820"}  # a graph hash, then
    old["parameter_shapes"] = shapes
    old["version"] = version
    if version == 1:
        old["solver"] = {**old["solver"], "solve_s": 0.25}
    return old


def test_version_1_files_still_load(plan: Plan, tmp_path: Path) -> None:
    # Version 1 also recorded the solve's wall time; it is read, and not written again.
    data = as_version(plan.to_dict(), 1)
    old = tmp_path / "v1.yaml"
    old.write_text(yaml.safe_dump(data, sort_keys=False))
    loaded = load_plan(old)
    assert loaded.version == 1 and loaded.solver.solve_s == 0.25
    assert [s.blocks for s in loaded.stages] == [s.blocks for s in plan.stages]
    again = yaml.safe_load(save_plan(loaded, tmp_path / "v3.yaml").read_text())
    assert again["version"] == 3 and "solve_s" not in again["solver"]
    assert again["model"]["fingerprint"] is None  # the graph hash is not carried over
    del data["solver"]["solve_s"]  # a version 1 file must have it
    old.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(PlanError, match=r"solver\.solve_s: missing \(expected a number\)"):
        load_plan(old)


def test_version_2_files_load_without_a_fingerprint_or_simulation_inputs(
    plan: Plan, tmp_path: Path
) -> None:
    old = tmp_path / "v2.yaml"
    old.write_text(yaml.safe_dump(as_version(plan.to_dict(), 2), sort_keys=False))
    loaded = load_plan(old)
    assert loaded.version == 2 and loaded.fingerprint is None and loaded.step is None
    assert loaded.model.parameter_shapes == plan.model.parameter_shapes  # what is checked
    fresh = load_plan(save_plan(plan, tmp_path / "plan.yaml"))
    assert loaded.stages == fresh.stages and loaded.predicted == plan.predicted


def test_the_plan_keeps_the_inputs_of_its_predicted_step(plan: Plan, tmp_path: Path) -> None:
    from planner.cost import replay

    assert plan.step is not None
    assert replay(plan.step).step_ms == plan.predicted.step_ms  # bit for bit
    again = load_plan(save_plan(plan, tmp_path / "plan.yaml"))
    assert again.step == plan.step and replay(again.step).step_ms == plan.predicted.step_ms


def test_an_fsdp_plan_round_trips_and_reprices_as_fsdp(tmp_path: Path) -> None:
    from planner.calibrate.priced import plan_cost_model
    from planner.plan.schema import plan_summary

    plan = tower_plan(pp=2, dp=2, dp_mode="fsdp", calibration=False)
    assert plan.dp_mode == "fsdp" and "dp 2 (FSDP)" in plan_summary(plan)
    path = save_plan(plan, tmp_path / "plan.yaml")
    assert "dp_mode: fsdp" in path.read_text()
    again = load_plan(path)
    assert again.to_dict() == plan.to_dict() and again.dp_mode == "fsdp"
    cost = plan_cost_model(again)  # the plan's layout, its dp mode with it
    assert cost.layout.dp_mode == "fsdp"
    starts = tuple(st.blocks[0] for st in again.stages)
    assert cost.predict(starts).step_ms == pytest.approx(again.predicted.step_ms)


def test_the_plan_file_holds_no_wall_clock_time(plan: Plan, tmp_path: Path) -> None:
    assert plan.solver.solve_s is not None  # known to this run's report ...
    text = save_plan(plan, tmp_path / "plan.yaml").read_text()
    assert "solve_s" not in text  # ... never saved
    assert load_plan(tmp_path / "plan.yaml").solver.solve_s is None


def test_unsafe_yaml_tags_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "evil.yaml"
    path.write_text("version: !!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(PlanError, match="no Python tags"):
        load_plan(path)


def test_missing_or_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="not found"):
        load_plan(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(PlanError, match="plan: expected a mapping"):
        Plan.from_dict(yaml.safe_load((tmp_path / "list.yaml").read_text()))


def test_save_failure_is_a_plan_error_and_leaves_nothing(plan: Plan, tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    with pytest.raises(PlanError, match=r"cannot write the plan to .*taken.*choose another --out"):
        save_plan(plan, tmp_path / "taken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no temporary file left
