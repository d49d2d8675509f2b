"""Plan integrity: a plan for a changed model is refused; the same inputs give the same bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from bad_input_kit import (
    A100,
    MLP,
)
from repo import ROOT
from torch import nn

from planner.cli import main
from planner.devices import from_gpus
from planner.options import PlanOptions, Training
from planner.plan import Plan, save_plan
from planner.planning import plan_model

# --------------------------------------------------------------------------- plan integrity


def _mlp(width: int = 32, depth: int = 2) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(16, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, 32), nn.ReLU()]
        width = 32
    return nn.Sequential(*layers, nn.Linear(width, 4))


def _api_plan(model: nn.Module, devices: int = 4) -> Plan:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    return plan_model(
        model,
        (x, y),
        cluster=from_gpus(devices, "a100"),
        loss_fn=F.cross_entropy,
        options=PlanOptions(training=Training(global_batch=8)),
        model_file="mlp.py",
    )


def test_integrity_a_plan_for_a_changed_model_is_refused(cache_dir: Path) -> None:
    from runtime.checks import PlanMismatch, check_plan

    plan = _api_plan(_mlp())
    check_plan(plan, _mlp(), world_size=plan.world_size, backend="gloo")  # the same model
    with pytest.raises(PlanMismatch) as err:
        check_plan(plan, _mlp(width=48), world_size=plan.world_size, backend="gloo")
    msg = str(err.value)
    assert "mlp.py was made for another model: fingerprint" in msg
    assert "3 parameter(s) have other shapes: 0.weight [32, 16] in the plan, [48, 16] here" in msg
    assert "fix: re-plan this model" in msg
    with pytest.raises(PlanMismatch, match=r"2 parameter\(s\) of the model are not in the plan: "):
        check_plan(plan, _mlp(depth=3), world_size=plan.world_size, backend="gloo")


def test_integrity_d_same_inputs_same_bytes_api(cache_dir: Path, tmp_path: Path) -> None:
    first = save_plan(_api_plan(_mlp()), tmp_path / "a.yaml").read_bytes()
    second = save_plan(_api_plan(_mlp()), tmp_path / "b.yaml").read_bytes()
    assert first == second
    other = save_plan(_api_plan(_mlp(), devices=2), tmp_path / "c.yaml").read_bytes()
    assert other != first  # the file does depend on the inputs


def test_integrity_d_same_inputs_same_bytes_cli(cache_dir: Path, tmp_path: Path) -> None:
    # Two processes with different string-hash seeds: set and dict order cannot leak into
    # the file; the second run reuses the first one's cached profiles.
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent(MLP))
    files = []
    for seed in ("1", "2"):
        out = tmp_path / f"plan-{seed}.yaml"
        env = {**os.environ, "PYTHONHASHSEED": seed, "PLANNER_CACHE_DIR": str(cache_dir)}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "planner",
                "plan",
                str(model),
                "--gpus",
                "4",
                *A100,
                "--out",
                out,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        assert "plan written to" in proc.stdout and "planning took" in proc.stdout
        files.append(out.read_bytes())
    assert files[0] == files[1]
    assert b"solve_s" not in files[0]


def test_integrity_d_measured_profile_reused_from_cache_same_bytes(
    cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Measured here (local CPU devices): the second run reads the profile from the cache.
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent(MLP))
    files = []
    for name in ("a.yaml", "b.yaml"):
        argv = ["plan", model, "--gpus", 2, "--repeats", 1, "--warmup", 0, "--out", tmp_path / name]
        rc = main([str(a) for a in argv])
        assert rc == 0, capsys.readouterr().err
        files.append((tmp_path / name).read_bytes())
        if name == "a.yaml":
            assert list(cache_dir.iterdir())  # measured once, then reused
    assert files[0] == files[1]
