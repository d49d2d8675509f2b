"""Planner benchmarks: python -m bench.bench_plan [--quick].

1. End to end: `planner plan examples/gpt.py --gpus 8` (trace + profile + search),
   wall time of the command, profile cache off.
2. Search alone: a 128-block chain on 64 H100 (8 nodes), every pp, dp, m and
   schedule.
3. Plan quality against the partitioners users have today, on every example at
   8 devices (8 local CPU devices, measured; 8 × A100-80GB, analytic), with the
   pipeline depth pinned to 2, 4 and 8 (at 8 devices the unpinned search picks
   pure data parallelism for these small models, where every partitioner is
   the same): the predicted step time of uniform blocks per stage
   (torchtitan/PiPPy), parameter-balanced (DeepSpeed) and time-balanced
   (torchgpipe) placements at our pp/dp/m/schedule, divided by ours (≥ 1 means
   ours is faster). All are priced by the same cost model; a baseline placement
   that does not fit in memory is reported as such.

Writes bench/results/plan.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ("mlp", "gpt", "resnet", "unet")


def end_to_end(example: str = "gpt", gpus: int = 8) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PLANNER_CACHE_DIR=tmp)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "planner",
                "plan",
                str(ROOT / "examples" / f"{example}.py"),
                "--gpus",
                str(gpus),
                "--out",
                str(Path(tmp) / "plan.yaml"),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"planner plan failed:\n{proc.stderr}")
    return {"command": f"planner plan examples/{example}.py --gpus {gpus}", "wall_s": wall}


def search_scaling(n_blocks: int = 128, devices: int = 64) -> dict[str, object]:
    from planner.cluster import from_gpus
    from planner.cost import Training
    from planner.records import BlockCost, ModelProfile
    from planner.search import SearchOptions, search

    def profile_for(device: str, b: int) -> ModelProfile:
        rnd = random.Random(0)
        blocks = []
        for k in range(n_blocks):
            s = 6.0 if k in (0, n_blocks - 1) else rnd.lognormvariate(0, 0.3)
            blocks.append(
                BlockCost(
                    index=k,
                    name=f"layer{k}",
                    modules=(f"layer{k}",),
                    fwd_ms=0.05 * s * b,
                    bwd_ms=0.1 * s * b,
                    param_bytes=int(50e6 * s),
                    activation_bytes=int(20e6 * b * s),
                    output_bytes=int(2e6 * b),
                    boundary_bytes=0 if k == 0 else int(2e6 * b),
                )
            )
        return ModelProfile(
            fingerprint="synthetic",
            source="analytic",
            device=device,
            batch_size=b,
            dtype="float32",
            threads=0,
            capture="export",
            blocks=tuple(blocks),
        )

    cluster = from_gpus(devices, "h100")
    t0 = time.perf_counter()
    res = search(
        profile_for, cluster, Training(global_batch=512), SearchOptions(), n_blocks=n_blocks
    )
    wall = time.perf_counter() - t0
    statuses: dict[str, int] = {}
    for c in res.candidates:
        statuses[c.status] = statuses.get(c.status, 0) + 1
    lay = res.layout
    return {
        "blocks": n_blocks,
        "devices": devices,
        "wall_s": wall,
        "chosen": f"pp {lay.pp} × dp {lay.dp}, m {lay.micro_batches}, {lay.schedule}",
        "solver_status": res.solution.status,
    }


def baselines(example: str, cluster_kind: str, pp: int, repeats: int) -> dict[str, object]:
    """Our placement vs the baselines' at the same pp (pinned), dp = 8 / pp, m and schedule."""
    from planner import baselines as bl
    from planner.api import PlanOptions, plan_model
    from planner.cluster import from_gpus
    from planner.cost import CostModel, Layout, Training
    from planner.modelfile import load_model_file
    from planner.profile import ProfileOptions
    from planner.scaling import at_batch_size
    from planner.search import SearchOptions

    mf = load_model_file(ROOT / "examples" / f"{example}.py")
    model = mf.build()
    cluster = from_gpus(8) if cluster_kind == "cpu" else from_gpus(8, cluster_kind)
    batch = max(mf.batch_size, 8) // 8 * 8

    def sampler(b: int):  # type: ignore[no-untyped-def]
        s = mf.sample(b)
        return s.args, s.kwargs, s.targets

    options = PlanOptions(
        training=Training(global_batch=batch),
        search=SearchOptions(pp=pp),
        profile=ProfileOptions(repeats=repeats, warmup=1),
    )
    plan = plan_model(model, sampler, cluster=cluster, loss_fn=mf.loss, options=options)
    ours = plan.predicted["step_ms"]
    lay = Layout(
        pp=plan.pp,
        dp=plan.dp,
        micro_batches=plan.micro_batches,
        schedule=plan.schedule,
        ranks=tuple(s.ranks for s in plan.stages),
    )
    key = cluster.devices[0].device.key
    prof = at_batch_size([p for p in plan.profiles if p.device == key], plan.micro_batch_size)
    cm = CostModel({key: prof}, cluster, options.training, lay)
    n, stages = len(prof.blocks), plan.pp
    placements = {
        "uniform": bl.uniform(n, stages),
        "parameter_balanced": bl.parameter_balanced([b.param_bytes for b in prof.blocks], stages),
        "time_balanced": bl.time_balanced([b.fwd_ms + b.bwd_ms for b in prof.blocks], stages),
    }
    row: dict[str, object] = {
        "example": example,
        "cluster": cluster.describe(),
        "pp": plan.pp,
        "ours": f"pp {plan.pp} × dp {plan.dp}, m {plan.micro_batches}, {plan.schedule}",
        "ours_ms": ours,
        "solver": plan.solver.status,
    }
    for name, starts in placements.items():
        pred = cm.predict(starts)
        row[f"{name}_ms"] = pred.step_ms
        row[f"{name}_ratio"] = pred.step_ms / ours
        row[f"{name}_fits"] = pred.fits
    return row


BASELINES = ("uniform", "parameter_balanced", "time_balanced")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer profiling repeats")
    ap.add_argument("--skip-e2e", action="store_true")
    ns = ap.parse_args(argv)
    out: dict[str, object] = {"machine": platform.platform(), "python": sys.version.split()[0]}
    if not ns.skip_e2e:
        out["end_to_end"] = end_to_end()
        print(f"end to end: {out['end_to_end']}")
    out["search"] = search_scaling()
    print(f"search: {out['search']}")
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ["PLANNER_CACHE_DIR"] = cache
        for kind in ("cpu", "a100-80gb"):
            for ex in EXAMPLES:
                for pp in (2, 4, 8):
                    row = baselines(ex, kind, pp, repeats=1 if ns.quick else 3)
                    rows.append(row)
                    print(
                        f"{ex:7s} {kind:10s} ours {row['ours_ms']:9.2f} ms ({row['ours']}); "
                        + ", ".join(
                            f"{b} ×{row[f'{b}_ratio']:.3f}{'' if row[f'{b}_fits'] else ' (OOM)'}"
                            for b in BASELINES
                        )
                    )
    out["baselines"] = rows
    worst = min(min(r[f"{b}_ratio"] for b in BASELINES) for r in rows)
    geo = {b: math.exp(sum(math.log(r[f"{b}_ratio"]) for r in rows) / len(rows)) for b in BASELINES}
    out["baseline_geomean_ratio"] = geo
    out["worst_baseline_ratio"] = worst
    print(f"geometric mean baseline/ours: {geo}; worst ratio {worst:.4f} (≥ 1: never worse)")
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "plan.json").write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
