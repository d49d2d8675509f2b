"""``python -m bench calibration``'s modes that run nothing or little: ``--refit`` and
``--memory-again`` on a kept run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest


def test_calibration_refit_refuses_launches_that_were_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--refit`` runs nothing: without the kept plan and launch files it says how to get
    them, for a model whose files are gone and for one the results file lacks."""
    from bench import bench_calibration as bc

    out = tmp_path / "calibration.json"
    gone = str(tmp_path / "gone.yaml")
    cases = [
        {"model": "mlp", "pp": p, "dp": d, "m": m, "plan": gone, "runs": [{"file": gone}]}
        for p, d, m in bc.CONFIGS
    ]
    out.write_text(json.dumps({"cases": cases}))
    monkeypatch.setattr(bc, "OUT", out)
    for model in ("mlp", "gpt"):
        with pytest.raises(SystemExit, match=f"(?s)no kept launches of {model}.*--keep DIR"):
            bc.main(["--refit", "--models", model])


def test_calibration_refit_of_one_model_keeps_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--refit --models mlp`` prices mlp's kept launches again and writes the file with
    the other models' cases as they were, and the kept run's command, load and time."""
    from bench import bench_calibration as bc

    kept = tmp_path / "kept"
    kept.write_text("")

    def case(model: str, c: tuple[int, int, int], err: float) -> dict[str, Any]:
        return {"model": model, "pp": c[0], "dp": c[1], "m": c[2], "plan": str(kept),
                "runs": [{"file": str(kept)}], "predicted_ms": 10.0, "calibrated_ms": 10.0,
                "measured_ms": 10.0, "error": err, "calibrated_error": err,
                "fitted_on": "2×1 m4", "memory_error": [0.0]}  # fmt: skip

    cases = [case(m, c, 0.1) for m in ("mlp", "gpt") for c in bc.CONFIGS]
    old = {"command": "python -m bench calibration --keep D", "load_before": 0.7, "wall_s": 99.0}
    old["cases"] = cases
    out = tmp_path / "calibration.json"
    out.write_text(json.dumps(old))
    monkeypatch.setattr(bc, "OUT", out)
    monkeypatch.setattr(bc, "_fits", lambda done: {})
    monkeypatch.setattr(bc, "_figures", lambda c, fits: {**c, "calibrated_error": 0.02})
    assert bc.main(["--refit", "--models", "mlp"]) == 0
    got = json.loads(out.read_text())
    by = {(c["model"], c["calibrated_error"]) for c in got["cases"]}
    assert by == {("mlp", 0.02), ("gpt", 0.1)} and len(got["cases"]) == 2 * len(bc.CONFIGS)
    assert got["earlier_commands"] == [old["command"]]
    assert (got["load_before"], got["wall_s"]) == (0.7, 99.0)


def test_calibration_memory_again_reruns_each_kept_memory_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--refit --memory-again`` runs each kept case's memory launch again, on its kept
    plan, into its kept file, the timed launches untouched; alone it is refused."""
    from bench import bench_calibration as bc

    with pytest.raises(SystemExit, match="add --refit"):
        bc.main(["--memory-again", "--models", "mlp"])
    plan = tmp_path / "mlp-2-1-4.yaml"
    plan.write_text("")
    timed, mem = str(tmp_path / "t.json"), str(tmp_path / "m.json")
    case = {"model": "mlp", "pp": 2, "dp": 1, "m": 4, "plan": str(plan), "steps": 7,
            "runs": [{"file": timed, "memory": False, "step_ms": 9.0, "load": 0.5},
                     {"file": mem, "memory": True, "step_ms": 11.0, "load": 0.5}]}  # fmt: skip
    ran: list[tuple[list[str], dict[str, str]]] = []

    def planner(args: list[str], env: dict[str, str], cwd: Path) -> Any:
        ran.append((args, env))
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(bc, "_planner", planner)
    monkeypatch.setattr(
        "planner.plan.measured.load_measurement", lambda f: type("M", (), {"step_ms": 12.5})
    )
    bc._memory_again(case)
    ((args, env),) = ran
    assert args[:4] == ["run", str(bc.ROOT / bc.MODELS["mlp"][0]), "--plan", str(plan)]
    assert args[4:] == ["--steps", "7", "--measurements", mem]  # memory tracked: no --no-memory
    assert env["PLANNER_CACHE_DIR"] == str(tmp_path / "cache-mlp")
    assert [r["step_ms"] for r in case["runs"]] == [9.0, 12.5]


def test_calibration_prices_in_the_models_own_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fit and the calibrated figures price a plan with the local-CPU figures its
    planning used (the model's cache), not this process's own cache's; both are put
    back after."""
    from bench import bench_calibration as bc
    from planner.devices.local import forget_measurements, local_cpu

    own = tmp_path / "own"
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(own))
    forget_measurements()
    mine = local_cpu()
    ((entry,),) = [list(own.glob("profile-*.json"))]
    theirs = json.loads(entry.read_text())
    theirs["memory_bandwidth"] = 3 * mine.memory_bandwidth
    (tmp_path / "cache-mlp").mkdir()
    (tmp_path / "cache-mlp" / entry.name).write_text(json.dumps(theirs))
    try:
        with bc._priced_as_planned("mlp", tmp_path):
            assert local_cpu().memory_bandwidth == 3 * mine.memory_bandwidth
        assert local_cpu().memory_bandwidth == mine.memory_bandwidth
        assert os.environ["PLANNER_CACHE_DIR"] == str(own)
    finally:
        forget_measurements()


def test_calibration_launches_take_turns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's layouts are planned first, then launched a round at a time (each layout
    once, then the next round), the memory launches last; each case keeps its own
    launches in order ([Note: launches in turn])."""
    from bench import bench_calibration as bc

    ran: list[str] = []

    def planner(args: list[str], env: dict[str, str], cwd: Path) -> Any:
        if args[0] == "plan":
            ran.append("plan " + Path(args[args.index("--out") + 1]).stem)
        else:
            mem = "" if "--no-memory" in args else " memory"
            ran.append("run " + Path(args[args.index("--measurements") + 1]).stem + mem)
        return subprocess.CompletedProcess(args, 0, "", "")

    plan = type("P", (), {"predicted": type("Q", (), {"step_ms": 50.0})})
    monkeypatch.setattr(bc, "_planner", planner)
    monkeypatch.setattr("planner.plan.files.load_plan", lambda f: plan)
    monkeypatch.setattr(
        "planner.plan.measured.load_measurement", lambda f: type("M", (), {"step_ms": 9.0})
    )
    done = bc._cases("mlp", 2, tmp_path)
    names = [f"mlp-{p}-{d}-{m}" for p, d, m in bc.CONFIGS]
    assert ran == [f"plan {n}" for n in names] + [
        f"run {n}-{k}" + (" memory" if k == 2 else "") for k in range(3) for n in names
    ]
    for (p, d, m), case in done.items():
        files = [Path(r["file"]).name for r in case["runs"]]
        assert files == [f"mlp-{p}-{d}-{m}-{k}.json" for k in range(3)]
        assert [r["memory"] for r in case["runs"]] == [False, False, True]
