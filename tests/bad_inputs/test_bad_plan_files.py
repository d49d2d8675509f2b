"""Bad-input case 15: plan files malformed, missing, of an unknown version, unsafe, or
crafted to exhaust the reader (issue 15, items 7 and 8: ``planner show`` and ``planner
run`` each refuse them cleanly, before anything starts)."""

from __future__ import annotations

import os
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


def _two_stage_plan(env: Env) -> dict:
    """A good 2-stage MLP plan as plain data, its file and the profile cache removed
    (each edit below is written back and must be refused by itself)."""
    env.planned(env.write(MLP), "--gpus", 2, *A100, "--pp", 2)
    good = yaml.safe_load(env.out.read_text())
    env.out.unlink()
    shutil.rmtree(env.cache)
    return good


def test_case15_plan_file_missing(env: Env) -> None:
    missing = env.tmp / "nope.yaml"
    err = env.refused(missing, command="show")
    assert f"plan file {missing} not found; create one with `planner plan model.py" in err


def test_case15_plan_file_edited_badly(env: Env) -> None:
    good = _two_stage_plan(env)
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


# --------------------------------------------------------------------------- 15. crafted plan files


def _refused_by_show_and_run(env: Env, bad: object) -> str:
    """Both commands that read a plan refuse it the same way; returns `show`'s message."""
    err = env.refused(bad, command="show")
    model = env.write(MLP)
    run_err = env.refused(model, "--plan", bad, command="run")
    assert run_err.splitlines()[0] == err.splitlines()[0], (err, run_err)
    return err


def test_case15_plan_file_nested_100000_deep(env: Env) -> None:
    bad = env.write("[" * 100_000 + "\n", "plan.yaml")
    err = _refused_by_show_and_run(env, bad)
    assert f"{bad}[0][0][0]…(65 levels)…[0][0] (line 1, column 65): lists and mappings " in err
    assert "nested more than 64 levels deep (a plan nests 6)" in err
    assert "regenerate it with `planner plan`" in err
    block = env.write("- " * 100_000 + "x\n", "block.yaml")  # block style nests as deep
    assert "nested more than 64 levels deep" in env.refused(block, command="show")


def test_case15_plan_file_integer_of_5000_digits(env: Env) -> None:
    bad = env.write("version: 3\nlayout: {pp: " + "7" * 5000 + "}\n", "plan.yaml")
    err = _refused_by_show_and_run(env, bad)
    assert (
        f"{bad}.layout.pp (line 2, column 14): an integer of 5000 digits, more than the 40 a "
        "plan's counts and sizes need; fix the value or regenerate the plan"
    ) in err
    assert "int_max_str_digits" not in err


def test_case15_plan_file_of_nested_aliases_is_refused_before_it_is_walked(env: Env) -> None:
    rows = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    rows += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    bad = env.write("\n".join(rows) + "\n", "plan.yaml")  # a0..a8: 10**9 values in 9 lines
    err = env.refused(bad, command="show")
    assert (
        f"{bad}.a6 (line 7, column 5): stands for 11111111 values (through YAML aliases), "
        "more than the 4000000 a plan may hold"
    ) in err


def test_case15_plan_file_too_large_or_not_a_file(env: Env) -> None:
    from planner.plan.files import MAX_PLAN_BYTES

    big = env.tmp / "plan.yaml"
    with big.open("wb") as f:
        f.truncate(MAX_PLAN_BYTES + 1)  # sparse: nothing is written, nothing read
    err = env.refused(big, command="show")
    assert f"plan file {big} has {MAX_PLAN_BYTES + 1} bytes, more than the {MAX_PLAN_BYTES}" in err
    big.unlink()
    fifo = env.tmp / "fifo.yaml"
    os.mkfifo(fifo)  # opening it would block until a writer came
    err = _refused_by_show_and_run(env, fifo)
    assert f"plan file {fifo} is not a regular file; create one with `planner plan" in err


def test_case15_plan_file_split_point_blocks_and_micro_batches_disagree(env: Env) -> None:
    good = _two_stage_plan(env)
    first, second = good["stages"][0]["blocks"], good["stages"][1]["blocks"]
    split = good["stages"][1]["split_point"]
    edits: list[tuple[Callable[[dict], object], str]] = [
        (
            lambda d: d["stages"][1].update(blocks=[second[0] + 1, second[1]]),
            f"stages[1].blocks [{second[0] + 1}, {second[1]}] must start at {first[1]} (where "
            "the previous stage ends) and hold at least one block",
        ),
        (
            lambda d: d["stages"][1].update(split_point="0"),
            f"stages[1].split_point '0' is not the stage's first module call (modules[0] is "
            f"{split!r}); edit split_point, blocks and modules together, or re-plan",
        ),
        (
            lambda d: d["training"].update(micro_batches=0, global_batch=0),
            "training.global_batch 0, training.micro_batches 0: must be ≥ 1 (a step trains at "
            "least one micro-batch",
        ),
        (
            lambda d: d["training"].update(micro_batches=-2, micro_batch_size=-4),
            "training.micro_batches -2, training.micro_batch_size -4: must be ≥ 1",
        ),
    ]
    for edit, message in edits:
        data = yaml.safe_load(yaml.safe_dump(good))
        edit(data)
        path = env.write(yaml.safe_dump(data, sort_keys=False), "plan.yaml")
        err = _refused_by_show_and_run(env, path)
        assert message in err, (message, err)
