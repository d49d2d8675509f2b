"""Cost-model accuracy, uncalibrated and calibrated, through the product's own commands:
python -m bench calibration [--quick] [--models a,b] [--launches N] [--keep DIR] [--merge]
[--refit [--memory-again]]

For each model (the bundled examples, and models of the zoo from transformers,
torchvision and timm: ``tests/zoo``) and each layout (pp, dp, m) of ``CONFIGS``
on local CPU processes (gloo):

1. ``planner plan MODEL --gpus pp·dp --pp --dp --micro-batches m
   --no-calibration``: the plan and its predicted step and per-stage memory
   (a fresh profile cache per model, so nothing calibrated leaks in);
2. ``LAUNCHES`` launches of ``planner run --no-memory --measurements F``, of
   ``steps_for(predicted step)`` steps (at least ``COUNTED_S`` counted): each
   launch's step is the median over its counted steps (the slowest rank's); the
   case's measured step is the median over the launches. The model's layouts
   take turns, a launch each a round ([Note: launches in turn]);
3. one more launch with memory tracked: each stage's peak (the most of its
   replicas; CPU: the peak of live tensor bytes) against the plan's.

**Calibration** (``planner calibrate``'s fit, ``planner.calibrate.fit``) is
fitted on the first ``FIT_LAUNCHES`` launches of ``FIT`` (pp 2, dp 1, m 4),
joined, as ``planner calibrate --launches 2`` does. A calibration applies to
processes of the thread count it was fitted with (as planning applies a stored
one), so the cases whose processes have another (one process with both cores:
pp 1 × dp 1) get their own, fitted on their own first ``FIT_LAUNCHES``
launches, as a user would calibrate the plan they run. Every case's plan is
then priced again with its calibration (the same placement:
``plan_cost_model(plan, calibration).step_ms``, in the model's own profile cache,
whose local-CPU figures its plans were priced with) and compared with the launches
no fit saw (for a fitted case, launches 3…N). So the calibrated figures are
held-out predictions: other layouts, or the same layout's other launches
(``fitted_on`` says which).

Error = (predicted − measured) / measured. The summary: median |error| and
the worst, uncalibrated and calibrated (time), and memory, over every case.
The load average before the run and each launch's are recorded. Writes
bench/results/calibration.json; ``--merge`` replaces only the models run in
it (a rerun of some), the summary recomputed over all cases; ``--keep DIR``
keeps the plans and measurement files, and ``--refit`` then fits and prices
those kept launches again with the current fit, running nothing (the plans and
the measured figures are the kept run's: only the calibrated column changes;
the models not named keep their cases, as with ``--merge``); ``--refit
--memory-again`` runs each kept case's memory launch again first (after a
runtime change that moves memory: the timed launches are the kept run's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench._common import cpu_figures, knobs, table, write_json
from planner.plan.text import ERROR_CONVENTION, rel_error

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "calibration.json"

# path, knobs (env), global batch (a multiple of dp · m = 8)
MODELS: dict[str, tuple[str, dict[str, str], int]] = {
    "mlp": ("examples/mlp.py", {"MLP_SCALE": "2"}, 256),
    "gpt": ("examples/gpt.py", {"GPT_LAYERS": "4", "GPT_SEQ": "64", "GPT_VOCAB": "8192"}, 8),
    "resnet": ("examples/resnet.py", {"RESNET_WIDTH": "16"}, 16),
    "unet": ("examples/unet.py", {}, 8),
    "hf_bert": ("tests/zoo/hf_bert.py", {}, 16),
    "hf_llama": ("tests/zoo/hf_llama.py", {}, 16),
    "tv_mobilenetv3": ("tests/zoo/tv_mobilenetv3.py", {}, 16),
    "timm_vit": ("tests/zoo/timm_vit.py", {}, 16),
}
QUICK_MODELS = ["mlp", "gpt", "hf_bert", "tv_mobilenetv3"]
CONFIGS = [(1, 1, 1), (2, 1, 4), (1, 2, 1), (2, 2, 4)]
FIT = (2, 1, 4)
FIT_LAUNCHES = 2
STEPS = 8  # per launch at least, the first one warm-up
COUNTED_S = 1.0
"""Predicted seconds of counted steps per launch at least: a model of 10 ms a step gets
101 steps, not 8 (BERT's 1 × 2 launches of 8 steps took 9.7 to 16.0 ms, of 60 steps
9.7 to 11.7 ms)."""
MAX_STEPS = 200


def steps_for(predicted_ms: float) -> int:
    """Steps per launch: ``STEPS``, or enough for ``COUNTED_S`` of counted steps (at most
    ``MAX_STEPS``).

    >>> steps_for(200.0), steps_for(10.0), steps_for(1.0)
    (8, 101, 200)
    """
    want = 1 + int(-(-COUNTED_S * 1e3 // max(predicted_ms, 1e-3)))
    return min(MAX_STEPS, max(STEPS, want))


RUN_TIMEOUT_S = 600


def _load() -> float:
    return os.getloadavg()[0]


def _planner(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "150", **env}
    return subprocess.run(
        [sys.executable, "-m", "planner", *args],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )


def _checked(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def _cases(name: str, launches: int, tmp: Path) -> dict[tuple[int, int, int], dict[str, Any]]:
    """Plan every layout of ``CONFIGS`` for ``name``, then run them ``launches`` times in
    turn (one launch of each, then the next round), then once more each with memory
    tracked.

    [Note: launches in turn] The machine has slow spells of minutes (a case's launches
    spread a median 9.6 % in the run of 2026-12-07, one case's four 59–73 ms in a row).
    A case's launches run one after another would put a spell on one case, and always
    on the same layouts (the last of each model: pp 2 × dp 2); in turn, each round
    meets a spell alike, so a case's median and the fit's launches (round 1 and 2) are
    not the layouts' order's."""
    done = {c: _planned(name, *c, tmp) for c in CONFIGS}
    for k in range(launches + 1):
        for case in done.values():
            _launch(case, k, memory=k == launches, tmp=tmp)
    return done


def _planned(name: str, pp: int, dp: int, m: int, tmp: Path) -> dict[str, Any]:
    """Plan one case (no launch yet)."""
    from planner.plan.files import load_plan

    path, _, batch = MODELS[name]
    plan_file = tmp / f"{name}-{pp}-{dp}-{m}.yaml"
    t0 = time.perf_counter()
    cmd = ["plan", str(ROOT / path), "--gpus", str(pp * dp), "--pp", str(pp), "--dp", str(dp)]
    cmd += ["--micro-batches", str(m), "--batch-size", str(batch), "--no-calibration"]
    _checked(_planner([*cmd, "--out", str(plan_file)], _env(name, tmp), tmp), f"planning {name}")
    plan_s = time.perf_counter() - t0
    plan = load_plan(plan_file)
    return {
        "model": name,
        "pp": pp,
        "dp": dp,
        "m": m,
        "plan": str(plan_file),
        "plan_s": plan_s,
        "steps": steps_for(plan.predicted.step_ms),
        "predicted_ms": plan.predicted.step_ms,
        "runs": [],
    }


def _launch(case: dict[str, Any], k: int, *, memory: bool, tmp: Path) -> None:
    """Run ``case``'s plan once (its k-th launch), its figures added to its runs."""
    from planner.plan.measured import load_measurement

    plan_file = Path(case["plan"])
    meas = tmp / f"{plan_file.stem}-{k}.json"
    load = _load()
    args = _run(case["model"], plan_file, case["steps"], meas, memory)
    _checked(_planner(args, _env(case["model"], tmp), tmp), f"running {plan_file.name}")
    step = load_measurement(meas).step_ms
    case["runs"].append({"file": str(meas), "load": load, "memory": memory, "step_ms": step})


def _memory_again(case: dict[str, Any]) -> None:
    """Run a kept case's memory launch again, on its kept plan, into its kept file."""
    from planner.plan.measured import load_measurement

    plan_file = Path(case["plan"])
    run = next(r for r in case["runs"] if r["memory"])
    args = _run(case["model"], plan_file, case["steps"], Path(run["file"]), memory=True)
    run["load"] = _load()
    proc = _planner(args, _env(case["model"], plan_file.parent), plan_file.parent)
    _checked(proc, f"running {plan_file.name} (memory)")
    run["step_ms"] = load_measurement(run["file"]).step_ms


def _env(name: str, folder: Path) -> dict[str, str]:
    """The model's environment, with its own profile cache in ``folder``."""
    return {**MODELS[name][1], "PLANNER_CACHE_DIR": str(folder / f"cache-{name}")}


@contextmanager
def _priced_as_planned(name: str, folder: Path) -> Iterator[None]:
    """Fit and price ``name``'s plans in its own profile cache (``folder``'s), as its
    planning did: a plan records the cluster, not the local CPU's measured figures
    (memory bandwidth, time per op: they price the optimizer step, transfers and
    per-op costs), which a process takes from its cache. This process's own cache
    may hold figures measured hours before, in another state of a shared machine
    (2.57 µs per op against 1.16 when the plans were made, 2026-12-07)."""
    from planner.devices.local import forget_measurements

    with knobs({"PLANNER_CACHE_DIR": _env(name, folder)["PLANNER_CACHE_DIR"]}):
        forget_measurements()
        try:
            yield
        finally:
            forget_measurements()  # the next figures come from the cache restored


def _run(name: str, plan_file: Path, steps: int, meas: Path, memory: bool) -> list[str]:
    """``planner run``'s arguments for one launch of a case (memory tracked or not)."""
    args = ["run", str(ROOT / MODELS[name][0]), "--plan", str(plan_file), "--steps", str(steps)]
    return args + ["--measurements", str(meas)] + ([] if memory else ["--no-memory"])


def _fits(done: dict[tuple[int, int, int], dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """A calibration per thread count of the cases' processes: fitted on ``FIT``'s first
    launches, or (threads ``FIT`` does not have) on the first case with those threads."""
    from planner.calibrate import fit
    from planner.plan.files import load_plan
    from planner.plan.measured import joined, load_measurement

    fits: dict[int, dict[str, Any]] = {}
    for c in [FIT, *(c for c in CONFIGS if c != FIT)]:
        plan = load_plan(done[c]["plan"])
        threads = plan.profiles[0].threads
        if threads in fits:
            continue
        files = [r["file"] for r in done[c]["runs"][:FIT_LAUNCHES]]
        cals = fit(plan, joined([load_measurement(f) for f in files])).calibrations
        fits[threads] = {"layout": c, "files": files, "calibrations": cals}
    return fits


def _figures(case: dict[str, Any], fits: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The case's errors: uncalibrated, calibrated (held out), memory per stage."""
    from planner.calibrate import plan_cost_model
    from planner.plan.files import load_plan
    from planner.plan.measured import load_measurement

    plan = load_plan(case["plan"])
    own = fits[plan.profiles[0].threads]  # as planning applies one: by thread count
    timed = [r for r in case["runs"] if not r["memory"]]
    measured = statistics.median(r["step_ms"] for r in timed)
    held = [r["step_ms"] for r in timed if r["file"] not in own["files"]]
    starts = [s.blocks[0] for s in plan.stages]
    calibrated = plan_cost_model(plan, own["calibrations"]).step_ms(starts)
    mem_run = load_measurement(next(r["file"] for r in case["runs"] if r["memory"]))
    memory = []
    for st in plan.stages:
        peak = mem_run.stage_figures(st.index)["peak_bytes"]
        memory.append(rel_error(st.memory.total, peak))
    return {
        **case,
        "measured_ms": measured,
        "launch_ms": [r["step_ms"] for r in timed],
        "error": rel_error(case["predicted_ms"], measured),
        "calibrated_ms": calibrated,
        "calibrated_error": rel_error(calibrated, statistics.median(held)),
        "held_out_launches": len(held),
        "fitted_on": "{}×{} m{}".format(*own["layout"]),
        "calibration": {k: v.to_dict() for k, v in own["calibrations"].items()},
        "memory_error": memory,
    }


def _kept(
    old: dict[str, Any], names: list[str]
) -> dict[str, dict[tuple[int, int, int], dict[str, Any]]]:
    """``names``' cases of ``old`` (the results file), by model and layout, their launches
    on disk.

    Raises:
        SystemExit: a model is not in the file, or its launches were not kept.
    """
    out: dict[str, dict[tuple[int, int, int], dict[str, Any]]] = {}
    for c in old["cases"]:
        out.setdefault(c["model"], {})[(c["pp"], c["dp"], c["m"])] = c
    for name in names:
        have = out.get(name, {})
        files = [r["file"] for c in have.values() for r in c["runs"]] + [
            c["plan"] for c in have.values()
        ]
        if set(have) != set(CONFIGS) or not all(Path(f).exists() for f in files):
            raise SystemExit(
                f"--refit: {OUT} has no kept launches of {name} (its cases "
                f"{sorted(have)}; files kept: {all(Path(f).exists() for f in files)}).\n"
                "  fix: run it with --keep DIR first, then --refit on this machine"
            )
    return {name: out[name] for name in names}


def _stats(xs: list[float]) -> dict[str, float]:
    a = [abs(x) for x in xs if x == x]
    worst = max(xs, key=abs) if xs else float("nan")
    return {"median_abs": statistics.median(a) if a else float("nan"), "worst": worst, "n": len(a)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"models {', '.join(QUICK_MODELS)}")
    ap.add_argument("--models", default=None, help="comma-separated names of MODELS")
    ap.add_argument("--launches", type=int, default=4, help="timed launches per case (≥ 3)")
    ap.add_argument("--keep", default=None, help="keep the plans and measurements in this folder")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="replace only these models' cases in the results file (a rerun of some models)",
    )
    ap.add_argument(
        "--refit",
        action="store_true",
        help="fit and price the results file's kept launches again, running nothing (a run "
        "made with --keep; after a change to the fit)",
    )
    ap.add_argument(
        "--memory-again",
        action="store_true",
        help="with --refit: run each kept case's memory launch again on its kept plan (after "
        "a runtime change that moves memory), the timed launches kept",
    )
    ns = ap.parse_args(argv)
    if ns.memory_again and not ns.refit:
        raise SystemExit("--memory-again reruns the memory launches of a kept run: add --refit")
    names = ns.models.split(",") if ns.models else (QUICK_MODELS if ns.quick else list(MODELS))
    started, load0 = time.perf_counter(), _load()
    cpu = cpu_figures()  # before the run: it is the machine the cases ran on
    print(f"this CPU now: {cpu}", flush=True)
    rows, cases = [], []
    old = json.loads(OUT.read_text()) if (ns.refit or ns.merge) and OUT.exists() else None
    kept = _kept(old or {"cases": []}, names) if ns.refit else {}
    if ns.memory_again:
        for case in (c for by_layout in kept.values() for c in by_layout.values()):
            _memory_again(case)
    with tempfile.TemporaryDirectory(prefix="bench-calibration-") as scratch:
        tmp = ns.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for name in names:
            done = kept.get(name) or _cases(name, ns.launches, Path(tmp))
            with _priced_as_planned(name, Path(done[FIT]["plan"]).parent):
                fits = _fits(done)
                got_all = {c: _figures(done[c], fits) for c in CONFIGS}
            for c in CONFIGS:
                got = got_all[c]
                cases.append(got)
                rows.append(
                    [
                        name,
                        f"{c[0]}×{c[1]} m{c[2]}",
                        f"{got['predicted_ms']:.1f}",
                        f"{got['calibrated_ms']:.1f}",
                        f"{got['measured_ms']:.1f}",
                        f"{got['error']:+.1%}",
                        f"{got['calibrated_error']:+.1%}",
                        got["fitted_on"],
                        " ".join(f"{e:+.1%}" for e in got["memory_error"]),
                    ]
                )
    table(
        "predicted vs measured step (ms), uncalibrated and calibrated; memory per stage",
        ["model", "pp×dp m", "pred", "calibrated", "measured", "err", "cal err", "fitted on",
         "mem err"],
        rows,
    )  # fmt: skip
    command = "python -m bench calibration " + " ".join(argv or sys.argv[1:])
    earlier: list[str] = []
    wall_s = time.perf_counter() - started
    if old is not None:  # --refit of some models, or --merge: the others' cases stay
        others = [c for c in old["cases"] if c["model"] not in names]
        cases = others + cases
        earlier = [*old.get("earlier_commands", []), old["command"]]
        print(f"merged with {len(others)} cases of {OUT.name} ({old['command']})")
    if ns.refit and old is not None:  # the launches are the earlier run's: its figures stand
        load0, wall_s = old["load_before"], old["wall_s"]
        cpu = old.get("cpu_measured", {})
    summary = {
        "time_uncalibrated": _stats([c["error"] for c in cases]),
        "time_calibrated": _stats([c["calibrated_error"] for c in cases]),
        "memory": _stats([e for c in cases for e in c["memory_error"]]),
    }
    for k, v in summary.items():
        print(f"{k}: median |error| {v['median_abs']:.1%}, worst {v['worst']:+.1%} ({v['n']})")
    print(ERROR_CONVENTION)
    data = {
        "command": command,
        "earlier_commands": earlier,
        "load_before": load0,
        "cpu_measured": cpu,
        "wall_s": wall_s,
        "launches": ns.launches,
        "steps": f"{STEPS} per launch at least, enough for {COUNTED_S:g} s counted "
        f"(at most {MAX_STEPS})",
        "fit_layout": FIT,
        "summary": summary,
        "cases": cases,
    }
    print(f"written to {write_json(OUT, json.loads(json.dumps(data, default=str)))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
