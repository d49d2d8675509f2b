"""Cost-model accuracy on local CPU processes (gloo): python -m bench.bench_accuracy [--quick].

1. **Predicted vs measured**, for each example (``examples/mlp.py``, ``gpt.py``,
   ``resnet.py``, ``unet.py`` at the sizes in ``EXAMPLES``) at (pp, dp, m) in
   ``CONFIGS``: the planner plans with those pins (``plan_model`` on
   ``from_gpus(pp·dp)``, the profile measured here, Adam, the schedule its
   choice) and ``ParallelModel`` runs the plan in pp·dp gloo processes with the
   plan's threads per process. Each case is planned inside its world, by rank 0
   while the others wait, right before it runs (see ``_accuracy_workers``).
   Step time: warm-up, then the median over repeated steps, each timed barrier
   to barrier (the slowest rank), keeping the rounds in which other processes
   used under 10 % of the machine (all rounds when fewer than 3 were). Peak
   memory per rank: the peak of live CPU tensor bytes over a step (torch's
   profiler reports every allocation and free; [Note: what "peak memory" is] in
   ``bench/_accuracy_workers.py``), against the plan's per-stage prediction.
   Error = (predicted − measured) / measured; the median |error| and the worst,
   for time (one point per case) and memory (one point per stage). Also, as a
   check on the machine: how much the world's processes slowed a fixed kernel
   when all ran it at once, just before the steps ("co-run x"; the cost model
   assumes ``CPU_CORUN_SLOWDOWN`` with 2 processes, time-slicing beyond).
2. **Plan quality**, measured: with pp = 2, our plan against the uniform split
   (equal blocks per stage, ``planner.search.baselines.uniform``; same m and
   micro-batch) for the imbalanced examples (GPT with a 16k vocabulary, the
   residual CNN), both in the same two processes, stepping in turn: the
   step-time ratio uniform / ours, measured and predicted.

The machine is shared: every world records the load (the share of the cores
other processes kept busy), and ``--repredict FILE`` re-prices a results file's
plans with the current cost model against its stored measurements (to calibrate
without re-running). ``--quick`` (9 timed steps per case) takes about 3
minutes on a quiet 2-core machine, up to ~8 under load (it waits for quiet
rounds); the full run (15 steps) about 4. Writes bench/results/accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import cpu_figures, table, write_json
from planner.plan.text import ERROR_CONVENTION, rel_error

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "accuracy.json"

EXAMPLES: dict[str, dict[str, Any]] = {
    # env: the example's knobs; batch: the global batch (a multiple of dp·m = 8).
    "mlp": {"env": {"MLP_SCALE": "2"}, "batch": 256},
    "gpt": {"env": {"GPT_LAYERS": "4", "GPT_SEQ": "64", "GPT_VOCAB": "8192"}, "batch": 8},
    "resnet": {"env": {"RESNET_WIDTH": "16"}, "batch": 16},
    "unet": {"env": {}, "batch": 8},
}
ZOO: dict[str, dict[str, Any]] = {
    # ``--zoo``: models of the zoo (``tests/zoo``: transformers, torchvision, timm), the
    # calibration benchmark's, at its global batch.
    "hf_bert": {"env": {}, "batch": 16},
    "hf_llama": {"env": {}, "batch": 16},
    "tv_mobilenetv3": {"env": {}, "batch": 16},
    "timm_vit": {"env": {}, "batch": 16},
}
CONFIGS = [(1, 1, 1), (2, 1, 4), (2, 1, 8), (1, 2, 1), (2, 2, 4)]
QUALITY: dict[str, dict[str, Any]] = {
    "gpt-16k": {
        "example": "gpt",
        "env": {"GPT_LAYERS": "4", "GPT_SEQ": "64", "GPT_VOCAB": "16384"},
        "batch": 8,
        "m": 4,
    },
    "resnet": {"example": "resnet", "env": {"RESNET_WIDTH": "16"}, "batch": 16, "m": 4},
}
QUIET_SHARE = 0.10  # as bench._runtime_workers.QUIET_SHARE
GOALS = {"time": 0.10, "memory": 0.15}


def settings(quick: bool, memory_only: bool = False) -> dict[str, Any]:
    """Steps per case: memory steps (profiled), warm-up, timed rounds and their limits."""
    if memory_only:
        return {"memory_steps": 4, "warmup": 0, "repeats": 1, "max_rounds": 1, "budget_s": 0.0}
    # Warm-up after the profiled memory steps: the first unprofiled steps run slow.
    if quick:
        return {"memory_steps": 4, "warmup": 4, "repeats": 9, "max_rounds": 16, "budget_s": 20.0}
    return {"memory_steps": 4, "warmup": 5, "repeats": 15, "max_rounds": 30, "budget_s": 45.0}


# --------------------------------------------------------------------------- printing


def _pct(x: float) -> str:
    return "—" if x != x else f"{x * 100:+.1f}%"


_err = rel_error  # the planner's one convention: (predicted − measured) / measured


# --------------------------------------------------------------------------- measuring


def _quiet_ms(times: dict[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """Median ms per implementation over the quiet rounds (all rounds if fewer than 3)."""
    fo = times["foreign"]
    idx = [i for i, f in enumerate(fo) if f < QUIET_SHARE]
    used = idx if len(idx) >= 3 else list(range(len(fo)))
    ms = {k: statistics.median(v[i] for i in used) * 1e3 for k, v in times["times"].items()}
    info = {
        "rounds": len(fo),
        "quiet_rounds": len(idx),
        "rounds_used": len(used),
        "foreign_share_median": statistics.median(fo) if fo else float("nan"),
        "foreign_share": fo,
        "raw_ms": {k: [x * 1e3 for x in v] for k, v in times["times"].items()},
    }
    return ms, info


def _world(fn: Any, world: int, args: tuple, threads: int, quick: bool, wait: bool) -> Any:
    from bench import _runtime_workers as w

    quiet = w.wait_quiet(15 if quick else 60) if wait else {}
    rs, load = w.spawn(fn, world, args=args, omp_threads=str(threads), timeout_s=1800)
    load.update(quiet)
    print(
        f"  {fn.__name__}, {world} process(es): {load['wall_s']:.0f} s; other processes "
        f"kept {load['foreign_share'] * 100:.0f} % of the machine busy meanwhile",
        flush=True,
    )
    return rs[0], load


def run_accuracy(
    cases: list[dict[str, Any]], quick: bool, memory_only: bool = False
) -> list[dict[str, Any]]:
    """Run every case in one world per world size (the processes are reused)."""
    from bench import _accuracy_workers as aw

    opts = settings(quick, memory_only)
    out: dict[str, dict[str, Any]] = {}
    for world in sorted({c["config"][0] * c["config"][1] for c in cases}):
        group = [c for c in cases if c["config"][0] * c["config"][1] == world]
        threads = max(1, (os.cpu_count() or 1) // world)  # what from_gpus(world) gives
        rs, load = _world(aw.accuracy_worker, world, (group, opts), threads, quick, not memory_only)
        for c, r in zip(group, rs, strict=True):
            out[c["name"]] = {**r, "world_load": load}
    return [out[c["name"]] for c in cases]


def assess(case: dict[str, Any], meas: dict[str, Any], plan: Any) -> dict[str, Any]:
    """``plan``'s predictions against the measured figures, for one case."""
    ms, info = _quiet_ms(meas["times"])
    step_meas = ms["step"]
    step_pred = float(plan.predicted.step_ms)
    stages = []
    for st in plan.stages:
        ranks = [r for r in meas["ranks"] if r["stage"] == st.index]
        peak = max(r["peak_bytes"] for r in ranks)
        mem_pred = float(st.memory.total)
        got = meas["stages"][st.index]
        stages.append(
            {
                "stage": st.index,
                "blocks": list(st.blocks),
                "memory_predicted_bytes": mem_pred,
                "memory_measured_bytes": peak,
                "memory_error": _err(mem_pred, peak),
                "peak_at": [r["peak_at"] for r in ranks],
                "memory_measured_with_outside_bytes": max(r["peak_total_bytes"] for r in ranks),
                "held_outside_stage_bytes": max(r["held_outside_stage_bytes"] for r in ranks),
                # [Note: frees on other threads] in bench._allocations
                "unrecorded_free_bytes": max(r.get("unrecorded_free_bytes", 0) for r in ranks),
                "unseen_free_in_steps_bytes": max(
                    r.get("unseen_free_in_steps_bytes", 0) for r in ranks
                ),
                "rss_bytes": max(r["rss_bytes"] for r in ranks),
                "memory_breakdown_predicted": st.memory.to_dict(),
                "state_bytes": [r["state_bytes"] for r in ranks],
                "ddp_bucket_bytes": [r["ddp_bucket_bytes"] for r in ranks],
                "minor_faults_per_step": [r["minor_faults_per_step"] for r in ranks],
                "fwd_ms": {"predicted": st.fwd_ms, "measured": got["fwd_ms"]},
                "bwd_ms": {"predicted": st.bwd_ms, "measured": got["bwd_ms"]},
                "sync_ms_predicted": st.sync_ms,
                "optimizer_ms_measured": got["optimizer_ms"],
            }
        )
    corun = meas.get("corun") or {}
    return {
        "name": case["name"],
        "example": case["example"],
        "config": list(case["config"]),
        "schedule": plan.schedule,
        "split_points": plan.split_points,
        "micro_batch_size": plan.micro_batch_size,
        "threads": meas["threads"],
        "step_predicted_ms": step_pred,
        "step_measured_ms": step_meas,
        "step_error": _err(step_pred, step_meas),
        "corun_slowdown_measured": corun.get("slowdown", float("nan")),
        "recorder_step_ms": meas["recorder_step_ms"],
        "plan_load": meas["plan_load"],
        "stages": stages,
        **info,
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(xs: list[float], goal: float) -> dict[str, Any]:
        xs = [x for x in xs if x == x]
        if not xs:
            return {"n": 0}
        return {
            "n": len(xs),
            "median_abs": statistics.median(abs(x) for x in xs),
            "median_signed": statistics.median(xs),
            "worst": max(xs, key=abs),
            "goal": goal,
            "within_goal": sum(abs(x) <= goal for x in xs),
        }

    return {
        "time": stats([r["step_error"] for r in rows], GOALS["time"]),
        "memory": stats([s["memory_error"] for r in rows for s in r["stages"]], GOALS["memory"]),
    }


def print_accuracy(rows: list[dict[str, Any]], title: str) -> dict[str, Any]:
    mib = 2**20
    out = []
    for r in rows:
        worst = max(r["stages"], key=lambda s: abs(s["memory_error"]))
        mem = "/".join(f"{s['memory_measured_bytes'] / mib:.0f}" for s in r["stages"])
        pred = "/".join(f"{s['memory_predicted_bytes'] / mib:.0f}" for s in r["stages"])
        errs = "/".join(_pct(s["memory_error"]) for s in r["stages"])
        out.append(
            [r["example"], "{},{},{}".format(*r["config"]), r["schedule"], r["step_predicted_ms"],
             r["step_measured_ms"], _pct(r["step_error"]), r["corun_slowdown_measured"], pred,
             mem, errs, worst["peak_at"][0],
             f"{r['rounds_used']}/{r['rounds']}", f"{r['foreign_share_median'] * 100:.0f}%"]
        )  # fmt: skip
    table(
        title,
        ["example", "pp,dp,m", "sched", "step pred ms", "meas ms", "err", "co-run x",
         "mem pred MiB", "meas MiB", "err (per stage)", "peak at", "rounds", "others busy"],
        out,
    )  # fmt: skip
    outside = max(st["held_outside_stage_bytes"] for r in rows for st in r["stages"])
    loads = [r["plan_load"]["foreign_share"] for r in rows]
    print(
        f"  left out of the measured peaks: parameters the runtime keeps alive outside the "
        f"stage, up to {outside / mib:.1f} MiB per rank. Load while profiling: other processes "
        f"kept a median {statistics.median(loads) * 100:.0f} % (max {max(loads) * 100:.0f} %) "
        "of the cores busy"
    )
    stages = [st for r in rows for st in r["stages"]]
    dropped = max(st.get("unrecorded_free_bytes", 0) for st in stages)
    unsure = max(st.get("unseen_free_in_steps_bytes", 0) for st in stages)
    print(
        f"  frees the profiler did not record (another thread's): up to {dropped / mib:.1f} MiB "
        f"per rank dropped before the measured steps, {unsure / mib:.1f} MiB found after "
        "them (counted: their time is unknown)"
    )
    s = summarize(rows)
    for what, label in {"time": "time", "memory": "memory"}.items():
        x = s[what]
        if x["n"]:
            print(
                f"  {label}: median |error| {x['median_abs'] * 100:.1f}% (signed "
                f"{x['median_signed'] * 100:+.1f}%), worst {x['worst'] * 100:+.1f}%, "
                f"{x['within_goal']}/{x['n']} within the goal of ±{x['goal'] * 100:.0f}%"
            )
    return s


# --------------------------------------------------------------------------- 2. plan quality


def run_quality(quick: bool) -> list[dict[str, Any]]:
    from bench import _accuracy_workers as aw

    opts = {**settings(quick), "repeats": 7 if quick else 15, "max_rounds": 14 if quick else 30}
    cases = [{"name": k, **v} for k, v in QUALITY.items()]
    rs, load = _world(aw.quality_worker, 2, (cases, opts), 1, quick, True)
    rows, res = [], []
    for c, r in zip(cases, rs, strict=True):
        ms, info = _quiet_ms(r["times"])
        ours, uni = r["plans"]["ours"], r["plans"]["uniform"]
        raw = info["raw_ms"]
        pairs = [u / o for u, o in zip(raw["uniform"], raw["ours"], strict=True)]
        pred = uni.predicted.step_ms / ours.predicted.step_ms
        d = {
            "name": c["name"],
            "env": c["env"],
            "global_batch": c["batch"],
            "m": ours.micro_batches,
            "micro_batch_size": ours.micro_batch_size,
            "schedule": ours.schedule,
            "ours_split": ours.split_points,
            "uniform_split": uni.split_points,
            "ours_blocks": [list(s.blocks) for s in ours.stages],
            "uniform_blocks": [list(s.blocks) for s in uni.stages],
            "ms": ms,
            "predicted_ms": {k: p.predicted.step_ms for k, p in r["plans"].items()},
            "measured_ratio": ms["uniform"] / ms["ours"],
            "median_pair_ratio": statistics.median(pairs),
            "predicted_ratio": pred,
            "plan_load": r["plan_load"],
            "world_load": load,
            **info,
        }
        res.append(d)
        rows.append(
            [c["name"], ours.micro_batches, ",".join(ours.split_points), ",".join(uni.split_points),
             ms["ours"], ms["uniform"], d["measured_ratio"], d["median_pair_ratio"], pred,
             f"{info['rounds_used']}/{info['rounds']}"]
        )  # fmt: skip
    table(
        "plan quality (pp = 2): our split vs the uniform split, same processes, in turn, median ms",
        ["model", "m", "ours split", "uniform split", "ours", "uniform", "uniform/ours",
         "median pair ratio", "predicted ratio", "rounds"],
        rows,
    )  # fmt: skip
    return res


# --------------------------------------------------------------------------- main


def _plan_from(d: dict[str, Any]) -> Any:
    from planner.plan import Plan

    return Plan.from_dict(d)


def repredict(path: str) -> int:
    """Re-price a results file's plans with the current cost model; print both tables."""
    from bench._accuracy_workers import starts_of, with_starts

    data = json.loads(Path(path).read_text())
    stored, fresh = [], []
    for d in data["accuracy"]["cases"]:
        plan = _plan_from(d["plan"])
        case = {k: d[k] for k in ("name", "example", "config")}
        stored.append(assess(case, d["measured"], plan))
        fresh.append(assess(case, d["measured"], with_starts(plan, starts_of(plan))))
    print_accuracy(stored, f"as stored in {path}")
    print_accuracy(fresh, "re-priced with the current cost model")
    return 0


def _cases(
    only: list[str], configs: list[tuple[int, int, int]], zoo: bool = False
) -> list[dict[str, Any]]:
    models = {**EXAMPLES, **(ZOO if zoo else {})}
    return [
        {"name": f"{name} ({pp},{dp},{m})", "example": name, "config": (pp, dp, m), **ex}
        for name, ex in models.items()
        if not only or name in only
        for pp, dp, m in configs
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (~3 minutes)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--only", default="", help="comma-separated examples (default: all)")
    ap.add_argument("--configs", default="", help="semicolon-separated pp,dp,m (default: all)")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument(
        "--memory-only", action="store_true", help="one timed step per case (memory is exact)"
    )
    ap.add_argument("--repredict", default="", help="re-price a results file and exit")
    ap.add_argument("--zoo", action="store_true", help="add the zoo's models (ZOO)")
    args = ap.parse_args(argv)
    if args.repredict:
        return repredict(args.repredict)
    only = [x for x in args.only.split(",") if x]
    configs = [
        (int(p), int(d), int(m)) for p, d, m in (c.split(",") for c in args.configs.split(";") if c)
    ] or CONFIGS
    t0 = time.perf_counter()
    cpu = cpu_figures()  # before the run: it is the machine the cases ran on
    print(f"this CPU now: {cpu}", flush=True)
    result: dict[str, Any] = {}
    saved_cache = os.environ.get("PLANNER_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="bench-acc-cache-") as cache:
        os.environ["PLANNER_CACHE_DIR"] = cache  # fresh profiles, measured now
        import torch

        from bench import _runtime_workers as w

        busy0, wall0 = w.cpu_busy_s(), time.monotonic()
        if not args.skip_accuracy:
            print("accuracy: each case planned (profiled) in its world, then run", flush=True)
            cases = _cases(only, configs, args.zoo)
            measured = run_accuracy(cases, args.quick, args.memory_only)
            rows = [assess(c, m, m["plan"]) for c, m in zip(cases, measured, strict=True)]
            summary = print_accuracy(
                rows,
                "predicted vs measured: step time (median ms) and peak memory per stage "
                "(MiB of live tensors; stages separated by /)",
            )
            result["accuracy"] = {
                "summary": summary,
                "rows": rows,
                "cases": [
                    {
                        "name": c["name"],
                        "example": c["example"],
                        "env": c["env"],
                        "config": list(c["config"]),
                        "plan": m["plan"].to_dict(),
                        "measured": {k: v for k, v in m.items() if k != "plan"},
                    }
                    for c, m in zip(cases, measured, strict=True)
                ],
            }
        if not args.skip_quality:
            print("\nplan quality: ours vs uniform, planned in the world, then run", flush=True)
            result["quality"] = run_quality(args.quick)
        wall = time.monotonic() - wall0
    if saved_cache is None:
        os.environ.pop("PLANNER_CACHE_DIR", None)
    else:
        os.environ["PLANNER_CACHE_DIR"] = saved_cache
    result["meta"] = {
        "command": " ".join(["python -m bench.bench_accuracy", *(argv or sys.argv[1:])]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "wall_s": time.perf_counter() - t0,
        "machine_busy_share": (w.cpu_busy_s() - busy0) / (wall * (os.cpu_count() or 1)),
        "cpu_measured": cpu,
        "examples": EXAMPLES,
        "zoo": ZOO if args.zoo else {},
        "quality_models": QUALITY,
        "settings": settings(args.quick, args.memory_only),
        "note": f"{ERROR_CONVENTION}. Step: median over quiet rounds "
        "(others under 10 % of the cores; all rounds when fewer than 3), barrier to barrier. "
        "Memory: peak live CPU tensor bytes per rank over a step (torch profiler allocator "
        "events), per stage the max over its replicas; parameters the runtime keeps outside "
        "the stage are left out (reported as held_outside_stage_bytes). machine_busy_share: "
        "the whole machine's busy share over the run (ours included). Times in ms unless "
        "named _s.",
    }
    write_json(args.out, result)
    print(f"\nwrote {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
