"""``planner calibrate``: run a plan, fit the cost model to the run, keep the fit, plan again.

Example::

    planner plan examples/gpt.py --gpus 2 --pp 2
    planner calibrate examples/gpt.py --plan plan.yaml --check

1. the plan trains ``--steps`` steps on this machine (``planner run``, with
   its measurements saved and no memory tracking), ``--launches`` times (their
   counted steps joined: one launch can be slowed by the machine's other work);
2. :func:`~planner.calibrate.fit.fit` fits a calibration per device type;
3. it is stored with the profile cache, keyed by the model's fingerprint, the
   device type, the threads per process (a local CPU) and the precision, where
   every later ``planner plan`` of the model finds it (``--no-calibration``
   ignores it);
4. the model is planned again with it, on the plan's cluster (or ``--gpus`` /
   ``--cluster``), and the new plan written to ``--out``;
5. with ``--check`` the new plan is run too: its measured step beside its
   calibrated prediction, a run the fit never saw.

The report gives the step of the plan as run, predicted before and after, and
measured; the fitted figures beside the defaults; whether the plan changed.

The run itself (``runtime``) is passed in by the command line (``planner.cli``),
which is the one part of the planner that starts it.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.cache import store_calibration
from planner.calibrate.fit import Fit, fit
from planner.calibrate.text import summary
from planner.options import PlanOptions, ProfileOptions, SearchOptions, Training
from planner.plan.files import load_plan, save_plan
from planner.plan.measured import Measurement, joined, load_measurement
from planner.plan.schema import Plan

__all__ = ["Calibrated", "RunPlan", "add_calibrate_parser", "calibrate"]

RunPlan = Callable[[str, str, int, str], int]
"""``run(model_file, plan_file, steps, measurements_file)``: train the plan here, save
its measurements; the exit status."""


@dataclass(frozen=True)
class Calibrated:
    """What ``planner calibrate`` did: the plan as run, its run, the fit, the new plan."""

    plan: Plan
    result: Measurement
    fit: Fit
    stored: list[str]
    new_plan: Plan
    new_plan_path: str
    checked_step_ms: float | None  # the new plan's measured step (--check)


def calibrate(
    model_file: str,
    plan_file: str,
    run: RunPlan,
    *,
    steps: int = 8,
    launches: int = 2,
    out: str | None = None,
    check: bool = False,
    cluster: Any = None,
) -> Calibrated:
    """Run, fit, store, re-plan (and, with ``check``, run the new plan); see the module.

    Raises:
        ValueError: a run failed (its exit status; its own output says why), or its
            measurements are not of the plan.
    """
    from planner.devices.cluster_file import from_record
    from planner.planning import plan_model_file

    plan = load_plan(plan_file)
    if not plan.model.fingerprint:
        raise ValueError(
            f"{plan_file} records no model fingerprint (format {plan.version}), so a "
            "calibration could not be kept for the model: plan it again with this version"
        )
    if steps < 2:
        raise ValueError(f"--steps must be ≥ 2 (one is warm-up, not counted), got {steps}")
    if launches < 1:
        raise ValueError(f"--launches must be ≥ 1, got {launches}")
    with tempfile.TemporaryDirectory(prefix="planner-calibrate-") as tmp:
        result = joined(
            [
                load_measurement(_run(run, model_file, plan_file, steps, f"{tmp}/{k}.json"))
                for k in range(launches)
            ]
        )
    fitted = fit(plan, result)
    fingerprint = plan.model.fingerprint
    stored = []
    for device, cal in fitted.calibrations.items():
        threads = next(p.threads for p in plan.profiles if p.device == device)
        path = store_calibration(cal, fingerprint, device, threads, plan.precision)
        stored.append(str(path) if path else f"{device}: not stored (the cache is not writable)")
    training = Training(
        global_batch=plan.global_batch, optimizer=plan.optimizer, precision=plan.precision
    )
    options = PlanOptions(training=training, search=SearchOptions(), profile=ProfileOptions())
    new = plan_model_file(model_file, cluster or from_record(plan.cluster), lambda _: options)
    out = out or str(Path(plan_file).with_suffix("")) + ".calibrated.yaml"
    save_plan(new, out)
    checked = None
    if check:
        with tempfile.TemporaryDirectory(prefix="planner-calibrate-") as tmp:
            checked = load_measurement(_run(run, model_file, out, steps, f"{tmp}/c.json")).step_ms
    return Calibrated(plan, result, fitted, stored, new, out, checked)


def _run(run: RunPlan, model_file: str, plan_file: str, steps: int, path: str) -> str:
    rc = run(model_file, plan_file, steps, path)
    if rc != 0 or not Path(path).is_file():
        raise ValueError(
            f"running {plan_file} for calibration failed (exit status {rc}); its output above "
            f"says why. Check that `planner run {model_file} --plan {plan_file}` runs"
        )
    return path


# --------------------------------------------------------------------------- the command


def add_calibrate_parser(sub: Any, run: RunPlan) -> None:
    """Add ``planner calibrate`` to the ``planner`` command's subparsers; ``run`` trains a
    plan here (``planner run``)."""
    p = sub.add_parser(
        "calibrate",
        help="run a plan, fit the cost model to what it measured, and plan again with the fit",
        description=(
            "Train PLAN on this machine for a few steps, fit the cost model's corrections "
            "(compute speed per device type, co-run slow-down, action overhead, transfers, "
            "all-reduce, optimizer step) to the measured actions, keep them with the profile "
            "cache for every later plan of this model, and plan again. Loading the model "
            "file runs its code."
        ),
    )
    p.add_argument("model_file", help="a model.py defining build_model() and sample_batch(n)")
    p.add_argument("--plan", required=True, help="the plan to run (`planner plan ... --out`)")
    p.add_argument("--steps", type=int, default=8, help="steps per run, the first not counted")
    p.add_argument(
        "--launches",
        type=int,
        default=2,
        help="runs of the plan to fit on (their counted steps together: one launch can be "
        "slowed by the machine's other work)",
    )
    p.add_argument(
        "--out", default=None, help="the new plan (default: the plan's name + .calibrated.yaml)"
    )
    p.add_argument("--check", action="store_true", help="also run the new plan and measure it")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--gpus", type=int, default=None, help="plan again on N devices")
    where.add_argument("--cluster", default=None, help="plan again on this cluster YAML")
    p.add_argument("--device-type", default=None, help="catalogue device for --gpus")

    def command(ns: argparse.Namespace) -> int:
        from planner.devices.build import from_gpus
        from planner.devices.cluster_file import load_cluster

        cluster = None
        if ns.cluster:
            cluster = load_cluster(ns.cluster)
        elif ns.gpus:
            cluster = from_gpus(ns.gpus, ns.device_type)
        done = calibrate(
            ns.model_file,
            ns.plan,
            run,
            steps=ns.steps,
            launches=ns.launches,
            out=ns.out,
            check=ns.check,
            cluster=cluster,
        )
        print(summary(done.plan, done.result, done.fit, done.new_plan, done.checked_step_ms))
        for path in done.stored:
            print(f"calibration stored in {path}")
        print(f"new plan written to {done.new_plan_path} (planner show {done.new_plan_path})")
        return 0

    p.set_defaults(func=command)
