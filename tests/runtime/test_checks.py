"""The checks before any communication (runtime.checks): the plan fits this model and launch."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch.nn.functional as F
import yaml
from small_examples import batch, build, example_module
from torch import nn

from planner.devices import from_gpus
from planner.options import PlanOptions, SearchOptions, Training
from planner.plan import Plan, load_plan
from planner.planning import plan_model
from runtime.checks import PlanMismatch, check_plan


def _plan() -> Plan:
    x, y = batch("mlp", 8, 0)
    return plan_model(
        build("mlp"),
        (x, y),
        cluster=from_gpus(2, "h100"),
        loss_fn=F.cross_entropy,
        options=PlanOptions(
            training=Training(global_batch=8), search=SearchOptions(pp=2, dp=1, micro_batches=2)
        ),
        model_file="mlp.py",
    )


def test_changed_model_is_refused_saying_what_differs(cache_dir: Path) -> None:
    plan = _plan()
    check_plan(plan, build("mlp"), world_size=2)  # the same model passes
    wider = example_module("mlp").build_model(in_features=32, scale=2)
    with pytest.raises(PlanMismatch, match=r"parameter\(s\) have other shapes: fc0.weight"):
        check_plan(plan, wider, world_size=2)
    fewer = build("mlp")
    del fewer.fc4  # the last Linear: 10 classes become 128 outputs
    with pytest.raises(PlanMismatch, match=r"2 parameter\(s\) in the plan are missing"):
        check_plan(plan, fewer, world_size=2)
    other_act = build("mlp")
    other_act.act1 = nn.GELU()  # same parameters, another graph
    with pytest.raises(PlanMismatch, match="so the module tree"):
        check_plan(plan, other_act, world_size=2)
    with pytest.raises(PlanMismatch, match="torchrun --nproc-per-node 2"):
        check_plan(plan, build("mlp"), world_size=4)


def test_a_format_2_plan_is_checked_by_its_parameter_shapes_with_a_warning(
    cache_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = _plan().to_dict()
    model = dict(data.pop("model"))
    data["parameter_shapes"] = model.pop("parameter_shapes")
    data["model"] = {**model, "fingerprint": "3dcb3ffbdee89820"}  # its graph hash, then
    data["version"] = 2
    del data["step"]
    path = tmp_path / "v2.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    old = load_plan(path)
    assert old.fingerprint is None
    with caplog.at_level(logging.WARNING, logger="runtime.checks"):
        check_plan(old, build("mlp"), world_size=2)  # same names and shapes: it runs
    assert "format 2 plan: it has no structural fingerprint" in caplog.text
    assert "re-plan" in caplog.text
    with pytest.raises(
        PlanMismatch, match=r"format 2, no structural fingerprint.*\n.*other shapes"
    ):
        check_plan(old, example_module("mlp").build_model(in_features=32, scale=2), world_size=2)
