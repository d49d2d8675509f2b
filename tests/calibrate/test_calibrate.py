"""A stored calibration corrects every later plan of the model; ``planner calibrate`` end to
end: run, fit, store, plan again, check."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from models import tower_plan
from repo import ROOT
from rich.console import Console
from runs import MLP, RUN_TIMEOUT_S, mlp_plan

from planner import cache
from planner.plan.files import load_plan
from planner.plan.records import Calibration
from planner.report.terminal import print_plan


def report(plan: object) -> str:
    out = io.StringIO()
    print_plan(plan, console=Console(file=out, width=200))  # type: ignore[arg-type]
    return out.getvalue()


def test_a_stored_calibration_corrects_the_next_plan(cache_dir: Path) -> None:
    plain = tower_plan(2, pp=2, micro_batches=2)
    cal = Calibration(fwd_scale=2.0, bwd_scale=3.0, action_overhead_ms=0.0, source="a test run")
    assert cache.store_calibration(cal, plain.model.fingerprint, "h100", 0, "fp32") is not None
    assert cache.load_calibration(plain.model.fingerprint, "h100", 0, "fp32") == cal
    assert cache.load_calibration(plain.model.fingerprint, "h100", 0, "bf16-mixed") is None
    assert cache.load_calibration(plain.model.fingerprint, "h100", 2, "fp32") is None

    fixed = tower_plan(2, pp=2, micro_batches=2)
    assert {p.calibration for p in fixed.profiles} == {cal}
    raw, got = plain.profiles[0].blocks[0], fixed.profiles[0].blocks[0]
    assert got.fwd_ms == pytest.approx(2 * raw.fwd_ms)
    assert got.bwd_ms == pytest.approx(3 * raw.bwd_ms)
    assert fixed.predicted.step_ms > plain.predicted.step_ms
    assert "calibrated" in report(fixed) and "a test run" in report(fixed)
    assert "calibrated" not in report(plain)

    ignored = tower_plan(2, pp=2, micro_batches=2, calibration=False)
    assert {p.calibration for p in ignored.profiles} == {None}
    assert ignored.predicted.step_ms == pytest.approx(plain.predicted.step_ms)


def test_a_damaged_calibration_entry_is_ignored(
    cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cal = Calibration(fwd_scale=2.0)
    path = cache.store_calibration(cal, "fp", "cpu", 1, "fp32")
    assert path is not None
    path.write_text(path.read_text().replace('"fwd_scale": 2.0', '"fwd_scale": -2.0'))
    with caplog.at_level(logging.WARNING):
        assert cache.load_calibration("fp", "cpu", 1, "fp32") is None
    assert "not a whole calibration" in caplog.text and "fwd_scale" in caplog.text
    assert not path.exists()


@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
def test_planner_calibrate_runs_fits_stores_and_plans_again(tmp_path: Path) -> None:
    plan, env = mlp_plan(tmp_path, global_batch=64)
    full_env = {**__import__("os").environ, "PYTHONPATH": str(ROOT), **env}
    cmd = [sys.executable, "-m", "planner", "calibrate", str(MLP), "--plan", "plan.yaml"]
    proc = subprocess.run(
        [*cmd, "--steps", "3", "--check"],
        cwd=tmp_path,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=3 * RUN_TIMEOUT_S,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "calibration from a run of pp 2 × dp 1, m 2" in out
    assert "fitted to this run" in out and "measured (--check" in out
    assert "calibration stored in" in out
    new = load_plan(tmp_path / "plan.calibrated.yaml")
    if new.profiles[0].threads != plan.profiles[0].threads:  # fitted for 1 thread only
        assert new.profiles[0].calibration is None and "no calibration" in out
    # a later `planner plan` of the model with processes of the run's threads finds it
    cmd = [sys.executable, "-m", "planner", "plan", str(MLP), "--gpus", "2", "--pp", "2"]
    again = subprocess.run(
        [*cmd, "--micro-batches", "2", "--out", "p.yaml"],
        cwd=tmp_path,
        env={**full_env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert "calibrated" in again.stdout and "planner calibrate" in again.stdout
    cal = load_plan(tmp_path / "p.yaml").profiles[0].calibration
    assert cal is not None and "fwd_scale" in cal.fitted and "p2p_extra_ms" in cal.fitted
    assert cal.measured_step_ms > 0 and cal.before_ms == pytest.approx(plan.predicted.step_ms)
