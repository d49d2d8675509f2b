"""Soak run: ``planner run`` for many steps on 4 CPU processes; memory, hangs, learning.

    python -m bench.soak [--steps 200] [--every 50] [--quick] [--out bench/results/soak.json]

Plans ``examples/mlp.py`` (``MLP_IN=64``: 1.0 M parameters) for 4 local
processes at pp 2 × dp 2 (2 micro-batches, GPipe, Adam), then trains it with
``planner run`` for ``--steps`` steps with a checkpoint every ``--every``
steps, every rank logging its resident set size after each step
(``--step-log``, read from ``/proc/self/statm``). Three properties:

1. **memory**: per rank, RSS growth from the first checkpoint (step
   ``--every``: by then the checkpoint's buffers, Adam's state and the
   allocator's pools exist) to the last step is at most
   ``RSS_GROWTH_BOUND_MIB``;
2. **no hang**: the run ends, exit status 0, within ``WALL_TIMEOUT_S``
   (every process is killed at that point);
3. **it learns**: the mean loss of the last 10 steps is below that of the
   first 10.

``--quick``: 100 steps, a checkpoint every 25. Writes ``bench/results/soak.json``
(the numbers, the bounds, a verdict per property) and prints a table; exit
status 0 when all three hold. ``main(argv)`` is what ``python -m bench all`` calls.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import knobs

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "soak.json"
MODEL = ROOT / "examples" / "mlp.py"
MODEL_ENV = {"MLP_IN": "64", "MLP_SCALE": "1"}
PP, DP, MICRO_BATCHES = 2, 2, 2

RSS_GROWTH_BOUND_MIB = 12.0
"""Largest RSS growth per rank from the first checkpoint to the last step (MiB).

Measured on 2 shared CPU cores, 200 steps, five runs: -1.7 to +4.3 MiB per
rank (RSS ~350-380 MiB; the stage-0 ranks, which hold the wider layers, vary
most), flat over the last 50 steps: allocator noise (glibc arenas of gloo's
and DCP's threads), not a trend. What the bound catches: a leak of one
activation-sized tensor per step (16 × 2048 floats, 128 KiB) adds 19 MiB
over 150 steps; a checkpoint's copy of a stage's state kept per save
(weights and Adam's moments, ~7 MiB for stage 0) adds 21 MiB over 3 saves."""

WALL_TIMEOUT_S = 300.0
"""The whole run (start, 200 steps, 4 checkpoints, exit) must end within this.

Measured: 19-26 s on 2 shared CPU cores (20 s with --quick). A rank stuck in a
collective fails after ``TIMEOUT_S`` and torchrun then stops the rest; this
bound is the last resort, past both."""

TIMEOUT_S = 120.0
"""The run's collective timeout (``planner run --timeout``): a stuck peer fails a rank."""

LOSS_WINDOW = 10


def plan_for(workdir: Path) -> Path:
    """The pp 2 × dp 2 plan of the soak model, written to ``workdir/plan.yaml``."""
    from planner.devices import from_gpus
    from planner.options import PlanOptions, SearchOptions, Training
    from planner.plan import save_plan
    from planner.plan.modelfile import load_model_file
    from planner.planning import plan_model

    with knobs(MODEL_ENV):
        mf = load_model_file(MODEL)
        batch = mf.sample(mf.batch_size)
        plan = plan_model(
            mf.build(),
            (batch.args[0], batch.targets),
            cluster=from_gpus(PP * DP, "h100"),  # analytic: the soak is of the runtime
            loss_fn=mf.loss,
            options=PlanOptions(
                training=Training(global_batch=mf.batch_size, optimizer="adam"),
                search=SearchOptions(pp=PP, dp=DP, micro_batches=MICRO_BATCHES, schedule="gpipe"),
            ),
            model_file=str(MODEL),
        )
    return save_plan(plan, workdir / "plan.yaml")


def run(steps: int, every: int, workdir: Path) -> dict[str, Any]:
    """Plan, then ``planner run`` the soak; returns the raw figures (see :func:`summarize`)."""
    plan_path = plan_for(workdir)
    log_dir = workdir / "steps"
    cmd = [
        sys.executable,
        "-m",
        "planner",
        "run",
        str(MODEL),
        "--plan",
        str(plan_path),
        "--steps",
        str(steps),
        "--checkpoint-dir",
        str(workdir / "ckpt"),
        "--checkpoint-every",
        str(every),
        "--step-log",
        str(log_dir),
        "--timeout",
        str(TIMEOUT_S),
        "--warmup-steps",
        "1",
        "--allow-device-mismatch",  # the plan's H100 costs are analytic; the soak is of the runtime
    ]
    env = {
        **os.environ,
        **MODEL_ENV,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PLANNER_CACHE_DIR": str(workdir / "cache"),
    }
    output = workdir / "run.log"
    start = time.monotonic()
    with open(output, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout=WALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None  # a hang: stop the launcher, its agent and every worker
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall = time.monotonic() - start
    ranks = {}
    for path in sorted(log_dir.glob("rank*.jsonl")):
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        ranks[int(path.stem[4:])] = lines
    return {
        "rc": rc,
        "wall_s": wall,
        "ranks": ranks,
        "log_tail": output.read_text()[-3000:],
    }


def summarize(raw: dict[str, Any], steps: int, every: int) -> dict[str, Any]:
    """The three properties from :func:`run`'s figures."""
    mib = 2**20
    rows = []
    for rank, lines in sorted(raw["ranks"].items()):
        by_step = {x["step"]: x for x in lines}
        first, last = by_step.get(every), by_step.get(steps)
        window = [x["rss_bytes"] for x in lines if x["step"] >= every]
        row: dict[str, Any] = {"rank": rank, "steps_logged": len(lines)}
        if first and last:
            growth = (last["rss_bytes"] - first["rss_bytes"]) / mib
            row.update(
                rss_from_mib=first["rss_bytes"] / mib,
                rss_to_mib=last["rss_bytes"] / mib,
                growth_mib=growth,
                growth_pct=100 * growth / (first["rss_bytes"] / mib),
                peak_mib=max(window) / mib,
                min_mib=min(window) / mib,
            )
        rows.append(row)
    lead = raw["ranks"].get(0, [])
    losses = [x["loss"] for x in sorted(lead, key=lambda x: x["step"])]
    first10 = statistics.fmean(losses[:LOSS_WINDOW]) if losses else float("nan")
    last10 = statistics.fmean(losses[-LOSS_WINDOW:]) if losses else float("nan")
    complete = len(rows) == PP * DP and all("growth_mib" in r for r in rows)
    return {
        "ranks": rows,
        "loss": {"first10_mean": first10, "last10_mean": last10, "steps": len(losses)},
        "wall_s": raw["wall_s"],
        "rc": raw["rc"],
        "pass": {
            "memory": complete and all(r["growth_mib"] <= RSS_GROWTH_BOUND_MIB for r in rows),
            "no_hang": raw["rc"] == 0 and raw["wall_s"] <= WALL_TIMEOUT_S,
            "learns": len(losses) == steps and last10 < first10,
        },
    }


def table(summary: dict[str, Any], steps: int, every: int) -> str:
    lines = [
        f"RSS per rank, step {every} (first checkpoint) → step {steps} "
        f"(bound: growth ≤ {RSS_GROWTH_BOUND_MIB:.0f} MiB)",
        f"{'rank':>4}  {'from MiB':>9}  {'to MiB':>9}  {'growth MiB':>10}  {'growth %':>8}  "
        f"{'peak MiB':>9}",
    ]
    for r in summary["ranks"]:
        if "growth_mib" not in r:
            lines.append(f"{r['rank']:>4}  (only {r['steps_logged']} steps logged)")
            continue
        lines.append(
            f"{r['rank']:>4}  {r['rss_from_mib']:9.1f}  {r['rss_to_mib']:9.1f}  "
            f"{r['growth_mib']:10.2f}  {r['growth_pct']:8.2f}  {r['peak_mib']:9.1f}"
        )
    loss = summary["loss"]
    verdict = summary["pass"]
    lines += [
        f"loss: mean of the first {LOSS_WINDOW} steps {loss['first10_mean']:.4g}, of the last "
        f"{LOSS_WINDOW} {loss['last10_mean']:.4g}",
        f"wall {summary['wall_s']:.1f} s (bound {WALL_TIMEOUT_S:.0f} s), exit status "
        f"{summary['rc'] if summary['rc'] is not None else 'none: killed'}",
        "memory {} · no hang {} · learns {}".format(
            *("ok" if verdict[k] else "FAIL" for k in ("memory", "no_hang", "learns"))
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="default 200 (100 with --quick)")
    ap.add_argument("--every", type=int, default=None, help="checkpoint every K steps (50; 25)")
    ap.add_argument("--quick", action="store_true", help="100 steps, a checkpoint every 25")
    ap.add_argument("--out", default=str(OUT))
    ns = ap.parse_args(argv)
    steps = ns.steps or (100 if ns.quick else 200)
    every = ns.every or (25 if ns.quick else 50)
    if not (0 < every < steps and steps >= 2 * LOSS_WINDOW):
        ap.error(f"need 0 < --every < --steps and --steps ≥ {2 * LOSS_WINDOW}")
    print(
        f"soak: {MODEL.name} {MODEL_ENV} on {PP * DP} processes (pp {PP} × dp {DP}), "
        f"{steps} steps, a checkpoint every {every}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        raw = run(steps, every, Path(tmp))
    summary = summarize(raw, steps, every)
    print(table(summary, steps, every))
    ok = all(summary["pass"].values())
    if not ok:
        print(raw["log_tail"], file=sys.stderr)
    out = {
        "command": " ".join(["python -m bench.soak", *(sys.argv[1:] if argv is None else argv)]),
        "config": {
            "model": f"examples/{MODEL.name}",
            "model_env": MODEL_ENV,
            "pp": PP,
            "dp": DP,
            "micro_batches": MICRO_BATCHES,
            "steps": steps,
            "checkpoint_every": every,
        },
        "bounds": {
            "rss_growth_mib": RSS_GROWTH_BOUND_MIB,
            "wall_s": WALL_TIMEOUT_S,
            "collective_timeout_s": TIMEOUT_S,
        },
        "meta": {
            "machine": platform.platform(),
            "python": sys.version.split()[0],
            "cpu_count": os.cpu_count(),
            "load_avg": os.getloadavg(),
        },
        **summary,
    }
    path = Path(ns.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
