"""The plan's choice section (planner.plan.choice): the band, the fastest, through the codec."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from models import tower_plan

from planner.plan import ChoiceRecord, FastestRecord, Plan, PlanError, load_plan, save_plan

FASTEST = FastestRecord(
    pp=16,
    dp=1,
    micro_batches=32,
    schedule="1f1b",
    step_ms=18.0,
    bubble_fraction=0.67,
    status="optimal",
    gap=0.0,
    bound_ms=17.999999999,
)


@pytest.fixture(autouse=True)
def _empty_cache(cache_dir):
    """Every test plans into an empty profile cache."""


@pytest.fixture(scope="module")
def plan() -> Plan:
    return tower_plan(pp=2)


@pytest.mark.parametrize(
    "record",
    [
        ChoiceRecord(band_pct=8.0, fastest=FASTEST, reason="pp 2 × dp 8 chosen over ..."),
        ChoiceRecord(band_pct=0.0, reason="the fastest predicted step"),
        ChoiceRecord(band_pct=5.5),
    ],
)
def test_the_record_round_trips_through_yaml(record: ChoiceRecord) -> None:
    data = yaml.safe_load(yaml.safe_dump(record.to_dict(), sort_keys=False))
    assert ChoiceRecord.from_dict(data) == record
    assert data["band_pct"] == record.band_pct
    assert ("fastest" in data) and (data["fastest"] is None) == (record.fastest is None)


def test_the_interval_is_the_step_times_one_plus_minus_the_band() -> None:
    assert ChoiceRecord(band_pct=8.0).interval(100.0) == pytest.approx((92.0, 108.0))
    assert ChoiceRecord(band_pct=0.0).interval(100.0) == (100.0, 100.0)


def test_a_new_plan_records_its_band_and_round_trips(plan: Plan, tmp_path: Path) -> None:
    assert plan.choice is not None and plan.choice.band_pct == 8.0 and plan.choice.reason
    path = save_plan(plan, tmp_path / "plan.yaml")
    assert "choice:\n  band_pct: 8.0" in path.read_text()
    again = load_plan(path)
    assert again.choice == plan.choice and again.to_dict() == plan.to_dict()
    # With a fastest configuration recorded too.
    slower = dataclasses.replace(FASTEST, step_ms=plan.predicted.step_ms * 0.99)
    chose = dataclasses.replace(plan, choice=ChoiceRecord(band_pct=8.0, fastest=slower))
    loaded = load_plan(save_plan(chose, tmp_path / "chose.yaml"))
    assert loaded.to_dict()["choice"] == chose.to_dict()["choice"]  # figures: 6 digits
    assert loaded.choice is not None and loaded.choice.fastest is not None


def test_a_plan_file_without_the_choice_still_loads(plan: Plan, tmp_path: Path) -> None:
    data = plan.to_dict()
    del data["choice"]
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(data, sort_keys=False))
    loaded = load_plan(old)
    assert loaded.choice is None
    assert loaded.to_dict() == {**plan.to_dict(), "choice": None}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(band_pct=-3), "choice: band_pct must be in [0, 100) percent"),
        (lambda c: c.update(band="8"), "choice: unknown key(s) band"),
        (lambda c: c["fastest"].update(step_ms=1e9), "choice.fastest.step_ms 1000000000.0"),
        (lambda c: c["fastest"].pop("status"), "choice.fastest.status: missing"),
    ],
)
def test_a_bad_choice_names_the_key(plan: Plan, tmp_path: Path, edit, message) -> None:
    data = plan.to_dict()
    data["choice"] = ChoiceRecord(band_pct=8.0, fastest=FASTEST).to_dict()
    data["choice"]["fastest"]["step_ms"] = plan.predicted.step_ms / 2
    edit(data["choice"])
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(PlanError) as err:
        load_plan(path)
    assert message in str(err.value)
