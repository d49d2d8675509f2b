"""Options declared once (planner.options, runtime.options, planner.plan.fields): the CLI's
flags, defaults and help come from the dataclasses, and parse back into them."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from planner.cli import build_parser
from planner.options import PlanOptions, ProfileOptions, SearchOptions, Training
from planner.plan.fields import add_options, flag_of, from_namespace, to_argv
from runtime.options import LaunchOptions, RunOptions


def _sub(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize(
    ("command", "cls", "skip"),
    [
        ("plan", Training, ()),
        ("plan", SearchOptions, ()),
        ("profile", ProfileOptions, ()),
        ("run", RunOptions, ()),
        ("run", LaunchOptions, ()),
    ],
)
def test_every_cli_field_is_a_flag_with_the_fields_default_and_help(command, cls, skip) -> None:
    flags = _flags(_sub(command))
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli") or f.metadata.get("positional") or f.name in skip:
            continue
        action = flags[flag_of(cls, f.name)]
        assert action.dest == f.name
        assert action.help is not None and action.help.startswith(f.metadata["help"])
        if f.type in ("bool",) or isinstance(f.default, bool):
            assert action.default == f.default  # a switch: store_true / store_false
        elif f.default is not dataclasses.MISSING:
            assert action.default == f.default
            if f.default is not None:
                assert f"(default: {f.default})" in action.help


def test_plan_takes_only_the_profile_knobs_it_uses() -> None:
    flags = _flags(_sub("plan"))
    assert {"--repeats", "--warmup", "--max-stages", "--no-cache"} <= set(flags)
    assert "--threads" not in flags and "--dtype" not in flags  # set per cluster, not by hand
    assert flags["--device-type"].dest == "device_type"  # the cluster's, not the profile's


def test_the_cli_parses_into_the_same_dataclasses() -> None:
    ns = build_parser().parse_args(
        ["plan", "m.py", "--gpus", "2", "--pp", "2", "--time-limit", "5", "--no-cache"]
    )
    options = PlanOptions(
        training=from_namespace(Training, ns, global_batch=16),
        search=from_namespace(SearchOptions, ns),
        profile=from_namespace(ProfileOptions, ns),
    )
    assert options.search == SearchOptions(pp=2, time_limit_s=5.0)
    assert options.profile == ProfileOptions(cache=False)
    assert options.training == Training(global_batch=16)


def test_errors_name_the_field_and_its_flag() -> None:
    with pytest.raises(ValueError, match=r"time_limit_s \(--time-limit\) must be > 0 seconds"):
        SearchOptions(time_limit_s=0)
    with pytest.raises(ValueError, match=r"global_batch \(--batch-size\) must be ≥ 1, got 0"):
        Training(global_batch=0)
    with pytest.raises(ValueError, match=r"target_blocks \(--max-stages\) must be ≥ 1"):
        ProfileOptions(target_blocks=0)
    with pytest.raises(ValueError, match=r"^max_micro_batches must be ≥ 1"):  # not a flag
        SearchOptions(max_micro_batches=0)
    with pytest.raises(ValueError, match=r"checkpoint_every \(--checkpoint-every\) needs"):
        RunOptions(model_file="m.py", plan="p.yaml", checkpoint_every=2)


def test_a_worker_gets_its_options_back_from_the_command_line() -> None:
    run = RunOptions(
        model_file="m.py",
        plan="p.yaml",
        steps=6,
        checkpoint_dir="ck",
        checkpoint_every=2,
        reshard=True,
        lr=0.5,
        timeout=30.0,
        split="fx",
    )
    argv = to_argv(run)
    assert argv[0] == "m.py" and "--reshard" in argv and "--trace" not in argv
    parser = argparse.ArgumentParser()
    add_options(parser, RunOptions)
    assert from_namespace(RunOptions, parser.parse_args(argv)) == run
