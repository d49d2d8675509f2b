"""Bad-input case 15: plan files malformed, missing, of an unknown version, or unsafe."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import yaml
from bad_input_kit import (
    A100,
    MLP,
    Env,
)

# --------------------------------------------------------------------------- 15. plan files


def test_case15_plan_file_not_yaml(env: Env) -> None:
    bad = env.write("version: 2\nlayout: {pp: 2\n", "plan.yaml")
    err = env.refused(bad, command="show")
    assert f"{bad} is not a valid plan file" in err and "line 3" in err
    assert "regenerate it with `planner plan`" in err


def test_case15_plan_file_unsafe_yaml_tag(env: Env) -> None:
    marker = env.tmp / "hacked"
    bad = env.write(f"version: !!python/object/apply:os.system ['touch {marker}']\n", "plan.yaml")
    err = env.refused(bad, command="show")
    assert "Plan files are plain YAML (no Python tags)" in err
    assert "python/object/apply:os.system" in err
    assert not marker.exists()


def test_case15_plan_file_unknown_version(env: Env) -> None:
    bad = env.write("version: 4\nstages: []\n", "plan.yaml")
    err = env.refused(bad, command="show")
    assert (
        f"{bad}.version: plan format version 4 is not supported (this planner reads versions "
        "1, 2 and 3; it writes version 3)"
    ) in err
    assert "fix: regenerate the plan with `planner plan`" in err


def test_case15_plan_file_missing(env: Env) -> None:
    missing = env.tmp / "nope.yaml"
    err = env.refused(missing, command="show")
    assert f"plan file {missing} not found; create one with `planner plan model.py" in err


def test_case15_plan_file_edited_badly(env: Env) -> None:
    env.planned(env.write(MLP), "--gpus", 2, *A100, "--pp", 2)
    good = yaml.safe_load(env.out.read_text())
    env.out.unlink()
    shutil.rmtree(env.cache)
    edits: list[tuple[Callable[[dict], object], str]] = [
        (lambda d: d["layout"].update(pp="two"), "layout.pp: expected an integer, got str 'two'"),
        (lambda d: d["stages"][1].pop("ranks"), "stages[1].ranks: missing (expected a list of"),
        (
            lambda d: d["stages"][0]["memory"].update(total="lots"),
            "stages[0].memory.total: expected a number, got str 'lots'",
        ),
        (lambda d: d.update(stagse=[]), "plan.yaml: unknown key(s) stagse; allowed: version"),
        (
            lambda d: d["training"].update(global_batch=10),
            "training.global_batch 10 ≠ dp × micro_batches × micro_batch_size = 1 × ",
        ),
        (lambda d: d["layout"].update(pp=3), "layout.pp is 3 but stages lists 2 stages"),
    ]
    for edit, message in edits:
        data = yaml.safe_load(yaml.safe_dump(good))
        edit(data)
        path = env.write(yaml.safe_dump(data, sort_keys=False), "plan.yaml")
        err = env.refused(path, command="show")
        assert message in err, (message, err)
