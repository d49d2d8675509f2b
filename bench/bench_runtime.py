"""Runtime benchmarks on local CPU processes (gloo): python -m bench.bench_runtime [--quick].

1. **Overhead**: ``ParallelModel.step`` against the hand-written script (pipeline() +
   build_stage + ScheduleGPipe + optimizer; DDP with no_sync for pp = 1) at the same
   split points and micro-batches, alternating in the same two processes; variants
   that isolate one cost each (the tied-weight all-reduce skipped, the stage's
   torch.export submodules run as generated code instead of through
   torch.fx.Interpreter, the hand-written DDP loop on our stage module); then each
   one's step by part (which costs what).
2. **Pipeline efficiency**: a 2-stage plan of 8 × Linear(1024) against the whole
   model in one process on the same global batch, for m in 1, 2, 4, 8; with 1 and
   2 torch threads per process; and one stage's compute with no communication,
   alone and with the other stage computing (what the machine itself costs);
   minor page faults per step; then again with glibc's malloc told to keep freed
   memory (``MALLOC_TUNED``). A co-run test of bare matmul kernels says whether
   the cores themselves slow each other down, and what one page fault costs.
3. **Fixed costs**: gloo send/recv and all-reduce over loopback, 1 KB … 64 MB
   (latency and bandwidth), and the per-action cost of the pipelining runtime (a
   near-empty 2-stage model: step time against m; the slope beyond the stage's
   compute, and beyond what the cost model predicts from the measured profile).
4. **Predicted vs measured**: plans from ``plan_model`` on ``from_gpus(2)``
   (measured profile, pp = 2, m ∈ {2, 4}) run with ``ParallelModel``; also
   re-predicted with the constants measured in 3, the co-run slowdown of 2 and the
   optimizer step.

The machine is shared and noisy: every comparison alternates its implementations
inside one launch (warm-up first) and takes medians over *quiet* rounds (other
processes under 10 % of the cores, from /proc/stat); the load is recorded.
Quiet, --quick takes ~3 minutes (at most ~8 under load); the full run ~6.
Writes bench/results/runtime.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import plan_layout, table, write_json
from planner.plan.text import rel_error

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "runtime.json"

STACK = {"kind": "stack", "n": 8, "width": 1024}
TINY = {"kind": "stack", "n": 4, "width": 16}
GPT = {
    "kind": "gpt",
    "kw": {
        "n_layers": 4,
        "dim": 256,
        "n_heads": 4,
        "seq_len": 64,
        "vocab_size": 8192,
        "dropout": 0.0,
        "bias": True,
    },
}
P2P_SIZES = [1 << k for k in range(10, 27, 2)]  # 1 KB … 64 MB


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def ms(xs: list[float]) -> float:
    return med(xs) * 1e3


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + s·x: (a, s)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    s = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - s * mx, s


# --------------------------------------------------------------------------- plans


def make_plans(quick: bool) -> dict[str, Any]:
    """Every plan the worlds run, made here (one process, the machine otherwise idle)."""
    import torch

    from bench import _runtime_workers as w
    from planner.devices import from_gpus
    from planner.options import PlanOptions, SearchOptions, Training
    from planner.planning import plan_model

    def plan(spec: dict, B: int, m: int, cluster: Any, pp: int = 2, dp: int = 1) -> Any:
        model = w.build(spec)
        x, y = w.batch(spec, B)
        return plan_model(
            model,
            (x, y),
            cluster=cluster,
            loss_fn=w.loss_fn_for(spec),
            options=PlanOptions(
                training=Training(global_batch=B, optimizer="sgd"),
                search=SearchOptions(pp=pp, dp=dp, micro_batches=m, schedule="gpipe"),
            ),
        )

    def at(p: Any, B: int, m: int) -> Any:
        training = dataclasses.replace(
            p.training, global_batch=B, micro_batches=m, micro_batch_size=B // m
        )
        return dataclasses.replace(p, training=training, step=None)  # re-timed: no replay

    threads = torch.get_num_threads()
    t0, b0 = time.perf_counter(), w.cpu_busy_s()
    own0 = time.process_time()
    local = from_gpus(2)
    out: dict[str, Any] = {
        "stack-m2": plan(STACK, 256, 2, local),
        "stack-m4": plan(STACK, 256, 4, local),
        "gpt-m4": plan(GPT, 16, 4, local),
    }
    # Layout-only plans (analytic: nothing to measure, the split is all that matters).
    h100 = from_gpus(2, "h100")
    out["stack-pp1dp2-m2"] = plan(STACK, 256, 2, h100, pp=1, dp=2)
    tiny = plan(TINY, 4, 1, local)  # measured: its profile is what the overhead is beyond
    out["tiny"] = [at(tiny, 4 * m, m) for m in (1, 2, 4, 8, 16, 32)]
    # The efficiency study pins the even split (4 + 4 layers), whatever the profile said.
    base = _with_split(out["stack-m4"], "layers.4")
    eff = [at(base, 256, m) for m in (1, 2, 4, 8)]
    eff += [at(base, 1024, 8)]  # the DESIGN note's 128-sample micro-batches
    out["efficiency"] = eff
    out["plan_s"] = wall = time.perf_counter() - t0
    foreign = (w.cpu_busy_s() - b0) - (time.process_time() - own0)
    out["plan_foreign_share"] = max(0.0, foreign) / (wall * (os.cpu_count() or 1))
    torch.set_num_threads(threads)
    return out


def _with_split(plan: Any, fqn: str) -> Any:
    """``plan`` with its one split point moved to ``fqn`` (the runtime reads only that)."""
    stages = list(plan.stages)
    stages[1] = dataclasses.replace(stages[1], split_point=fqn)
    return dataclasses.replace(plan, stages=tuple(stages))


# --------------------------------------------------------------------------- studies


def run_world(fn: Any, args: tuple, quick: bool, **kw: Any) -> tuple[list[Any], dict]:
    """A 2-rank world, started once the machine is quiet (or after a bounded wait)."""
    from bench import _runtime_workers as w

    quiet = w.wait_quiet(20 if quick else 60)
    # Each alternation gives up waiting for quiet rounds after this long (--quick: 8 minutes).
    kw["env"] = {**(kw.get("env") or {}), "BENCH_RT_BUDGET_S": "25" if quick else "90"}
    rs, load = w.spawn(fn, 2, args=args, **kw)
    load.update(quiet)
    print(
        f"\n[{fn.__name__}: {load['wall_s']:.0f} s; other processes kept "
        f"{load['foreign_share'] * 100:.0f} % of the machine busy meanwhile]"
    )
    return rs, load


def quiet(rec: dict[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """Median ms per implementation over the quiet rounds (all rounds if fewer than 3)."""
    from bench._runtime_workers import QUIET_SHARE

    fo = rec["foreign"]
    idx = [i for i, f in enumerate(fo) if f < QUIET_SHARE]
    used = idx if len(idx) >= 3 else list(range(len(fo)))
    t = {k: med([v[i] for i in used]) * 1e3 for k, v in rec["times"].items()}
    info = {
        "rounds": len(fo),
        "quiet_rounds": len(idx),
        "rounds_used": len(used),
        "foreign_share": fo,
        "raw_ms": {k: [x * 1e3 for x in v] for k, v in rec["times"].items()},
        "used": used,
    }
    return t, info


def _rounds(info: dict[str, Any]) -> str:
    return f"{info['rounds_used']}/{info['rounds']}"


def p2p(quick: bool) -> dict[str, Any]:
    from bench import _runtime_workers as w

    rs, load = run_world(w.p2p_worker, (P2P_SIZES, 0.2 if quick else 0.6), quick)
    r = rs[0]
    rows, res = [], {"load": load, "sizes": {}}
    for n in P2P_SIZES:
        t = ms(r["send_recv"][n])
        tb = ms(r["batch_isend_irecv"][n]) if n in r["batch_isend_irecv"] else None
        ta = ms(r["all_reduce"][n])
        res["sizes"][n] = {"send_recv_ms": t, "batch_isend_irecv_ms": tb, "all_reduce_ms": ta}
        rows.append(
            [_size(n), t * 1e3, (tb or float("nan")) * 1e3, n / (t / 1e3) / 1e9, ta * 1e3,
             n / (ta / 1e3) / 1e9]
        )  # fmt: skip
    big = [n for n in P2P_SIZES if n >= 1 << 20]
    a, s = fit_line([float(n) for n in big], [res["sizes"][n]["send_recv_ms"] / 1e3 for n in big])
    ar = [res["sizes"][n]["all_reduce_ms"] / 1e3 for n in big]
    # Ring all-reduce over n = 2 ranks moves 2(n−1)/n · bytes = bytes per rank: the cost
    # model's allreduce_time prices it so, with the link's bandwidth.
    _, s_ar = fit_line([float(n) for n in big], ar)
    # Latency: the median over the small sizes (≤ 16 KB), robust to one noisy size.
    small = [n for n in P2P_SIZES if n <= 16 << 10]

    def latency(kind: str) -> float:
        return med([res["sizes"][n][f"{kind}_ms"] for n in small]) / 1e3

    lat, latb = latency("send_recv"), latency("batch_isend_irecv")
    res.update(
        latency_s=lat,
        latency_batch_isend_irecv_s=latb,
        bandwidth_Bps=1 / s,
        all_reduce_bandwidth_Bps=1 / s_ar,
        all_reduce_latency_s=latency("all_reduce"),
        fit_intercept_s=a,
        barrier_cpu_share=r["barrier_cpu"],
    )
    table(
        "gloo p2p over loopback, one way (ping-pong / 2), median",
        [
            "size",
            "send/recv µs",
            "batch_isend_irecv µs",
            "GB/s",
            "all_reduce µs",
            "all_reduce GB/s",
        ],
        rows,
    )
    print(
        f"  latency {lat * 1e6:.0f} µs (≤ 16 KB; {latb * 1e6:.0f} µs via batch_isend_irecv, the "
        f"pipelining path); bandwidth {1 / s / 1e9:.2f} GB/s (fit over sizes ≥ 1 MB). A rank "
        f"waiting in a gloo barrier used {r['barrier_cpu'] * 100:.1f} % of a core.\n"
        f"  all-reduce (2 ranks): {res['all_reduce_latency_s'] * 1e6:.0f} µs (≤ 16 KB), "
        f"{1 / s_ar / 1e9:.2f} GB/s of buffer (fit ≥ 1 MB): the cost model prices it at "
        "the p2p bandwidth"
    )
    return res


def corun(quick: bool) -> dict[str, Any]:
    from bench import _runtime_workers as w

    rs, load = run_world(w.corun_worker, (5 if quick else 11,), quick)
    t, info = quiet(rs[0]["times"])
    flops = rs[0]["flops"]
    rows, res = [], {"load": load, **info, "ms": t}
    for name in flops:
        alone, both = t[f"{name} alone"], t[f"{name} both"]
        rate = flops[name] / alone / 1e6 if flops[name] else "-"
        res[name] = {"alone_gflops": rate, "slowdown": both / alone}
        rows.append([name, alone, both, both / alone, rate, _rounds(info)])
    res["fault_us"] = t["page faults alone"] / rs[0]["pages"] * 1e3
    res["fault_us_both"] = t["page faults both"] / rs[0]["pages"] * 1e3
    table(
        "co-run: one kernel on rank 0 alone vs the same on both ranks at once (1 thread each), "
        "median ms",
        ["kernel", "alone", "both", "slowdown", "GFLOP/s alone", "rounds"],
        rows,
    )
    print(
        f"  one minor page fault (fresh 4 KB page, zeroed): {res['fault_us']:.2f} µs alone, "
        f"{res['fault_us_both']:.2f} µs with the other rank faulting too"
    )
    return res


def actions(plans: list[Any], quick: bool) -> dict[str, Any]:
    from bench import _runtime_workers as w

    rs, load = run_world(w.action_worker, (TINY, plans, 9 if quick else 21), quick)
    rows, series = [], {"ours": [], "torch": [], "compute": [], "ours, fx codegen": []}
    mm = [float(row["m"]) for row in rs[0]["rows"]]
    out_rows = []
    for row in rs[0]["rows"]:
        t, info = quiet(row["times"])
        for k in series:
            series[k].append(t[k])
        inside = med(
            [
                (p.get("  forward actions", 0) + p.get("  backward actions", 0)) * 1e3
                for p in (row["times"]["parts"]["ours"][i] for i in info["used"])
            ]
        ) / (2 * row["m"])
        out_rows.append({"m": row["m"], "b": row["b"], "ms": t, "in_chunk_ms": inside, **info})
        rows.append(
            [row["m"], t["ours"], t["torch"], t["ours, fx codegen"], t["compute"], inside,
             _rounds(info)]
        )  # fmt: skip
    # What the cost model predicts with no per-action term, from the plan's measured profile.
    series["predicted, no overhead"] = [_predict(p, overhead_ms=0.0) for p in plans]
    fits = {k: fit_line(mm, v) for k, v in series.items()}
    per_action = {
        k: (fits[k][1] - fits["compute"][1]) / 2 for k in ("ours", "torch", "ours, fx codegen")
    }
    vs_profile = (fits["ours"][1] - fits["predicted, no overhead"][1]) / 2
    vs_profile_cg = (fits["ours, fx codegen"][1] - fits["predicted, no overhead"][1]) / 2
    for row, pred in zip(rows, series["predicted, no overhead"], strict=True):
        row.insert(5, pred)
    table(
        f"per-action cost: near-empty 2-stage model ({TINY['n']} × Linear({TINY['width']})), "
        "micro-batch 4, median ms per step",
        [
            "m",
            "ours",
            "torch",
            "ours, fx codegen",
            "compute only (both stages)",
            "predicted, 0 overhead",
            "ms per *_one_chunk call",
            "rounds",
        ],
        rows,
    )
    print(
        "  fit step = a + s·m: "
        + ", ".join(f"{k}: a {a:.2f} ms, s {s:.3f} ms" for k, (a, s) in fits.items())
        + "\n  per action beyond the stage module's own compute, (s − s_compute)/2: "
        + ", ".join(f"{k} {v:.3f} ms" for k, v in per_action.items())
        + "\n  per action beyond the profile (what ACTION_OVERHEAD_MS is), (s − s_predicted)/2: "
        f"ours {vs_profile:.3f} ms, ours with fx codegen {vs_profile_cg:.3f} ms"
    )
    return {
        "load": load,
        "rows": out_rows,
        "fits_ms": fits,
        "per_action_ms": per_action,
        "per_action_vs_profile_ms": vs_profile,
        "per_action_vs_profile_fx_codegen_ms": vs_profile_cg,
        "split_points": plans[0].split_points,
    }


def _parts(rec: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Median ms of each wrapped part per implementation, over the quiet rounds."""
    _, info = quiet(rec)
    out = {}
    for impl, rounds in rec["parts"].items():
        keys = list(dict.fromkeys(k for r in rounds for k in r))
        out[impl] = {k: med([rounds[i].get(k, 0.0) for i in info["used"]]) * 1e3 for k in keys}
        out[impl]["step (barrier to barrier)"] = (
            med([rec["times"][impl][i] for i in info["used"]]) * 1e3
        )
    return out


OVERHEAD_CASES = ("stack-m4", "stack-m2", "gpt-m4", "stack-pp1dp2-m2")


def overhead(
    plans: dict[str, Any], quick: bool, names: tuple[str, ...] = OVERHEAD_CASES
) -> dict[str, Any]:
    from bench import _runtime_workers as w

    nan = float("nan")
    cases = [
        {"name": n, "spec": GPT if n.startswith("gpt") else STACK, "plan": plans[n]} for n in names
    ]
    rs, load = run_world(
        w.overhead_worker, (cases, 11 if quick else 21, 5 if quick else 11), quick, timeout_s=900
    )
    rows, res = [], {"load": load}
    for n in names:
        c0, c1 = rs[0]["cases"][n], rs[1]["cases"][n]
        t, info = quiet(c0["times"])
        o, h = t["ours"], t["torch"]
        raw = info["raw_ms"]
        ratios = [raw["ours"][i] / raw["torch"][i] for i in info["used"]]
        plan = plans[n]
        variants = {k: v / h for k, v in t.items() if k not in ("ours", "torch")}
        res[n] = {
            "ms": t,
            "ours_ms": o,
            "torch_ms": h,
            "ratio_of_medians": o / h,
            "median_pair_ratio": med(ratios),
            "variants_over_torch": variants,
            "parts_ms": {"rank0": _parts(c0["parts"]), "rank1": _parts(c1["parts"])},
            "pp": plan.pp,
            "dp": plan.dp,
            "m": plan.micro_batches,
            "b": plan.micro_batch_size,
            "split_points": plan.split_points,
            "split_method": c0["split_method"],
            "tied_allreduce_alone_ms": c0["tied_alone_ms"],
            **info,
        }
        extra = "; ".join(f"{k}: {v:.3f}" for k, v in variants.items()) or "-"
        rows.append(
            [n, f"{plan.pp}×{plan.dp}", plan.micro_batches, h, o, o / h, med(ratios),
             c0["tied_alone_ms"] or "-", extra, _rounds(info)]
        )  # fmt: skip
    table(
        "overhead: ParallelModel.step vs the hand-written script (same processes, alternating), "
        "median ms",
        ["case", "pp×dp", "m", "torch", "ours", "ours/torch", "median pair ratio",
         "tied all-reduce alone", "other variants / torch", "rounds"],
        rows,
    )  # fmt: skip
    for n in names:
        for rank in (0, 1):
            p = res[n]["parts_ms"][f"rank{rank}"]
            keys = list(dict.fromkeys([*p["ours"], *p["torch"]]))
            table(
                f"  {n}, rank {rank}: ms per step by part (instrumented pass, alternating)",
                ["part", "ours", "torch"],
                [[k, p["ours"].get(k, nan), p["torch"].get(k, nan)] for k in keys],
            )
    return res


MALLOC_TUNED = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
"""glibc keeps freed memory for reuse: no mmap per large tensor, no trim (see the report)."""


def efficiency(plans: list[Any], quick: bool, *, tuned: bool = False) -> dict[str, Any]:
    from bench import _runtime_workers as w

    if tuned:  # fewer rows: the comparison with the default allocator is the point
        plans = [p for p in plans if p.global_batch == 256 or p.micro_batches == 8]
    two = [not tuned and p.global_batch == 256 and p.micro_batches in (2, 8) for p in plans]
    # OMP_NUM_THREADS unset: what a plainly spawned worker gets (reported), then set explicitly.
    rs, load = run_world(
        w.efficiency_worker, (STACK, plans, two, 5 if quick else 11), quick, omp_threads=None,
        env=MALLOC_TUNED if tuned else None, timeout_s=900,
    )  # fmt: skip
    r = rs[0]
    rows, out = [], []
    for row, row1 in zip(r["rows"], rs[1]["rows"], strict=True):
        m, b, B = row["m"], row["b"], row["B"]
        t, info = quiet(row["times"])
        pipe, single = t["pipelined 1 thread/proc"], t["one process 1 thread"]
        ideal = 2 * m / (m + 1)
        speed = single / pipe
        # What the machine allows with no communication and no schedule: GPipe on 2 stages
        # has 2 one-stage slots (fill, drain) and m − 1 slots with both stages computing.
        alone, both = t["stage compute alone"] / m, t["stage compute, both stages"] / m
        bound = 2 * alone + (m - 1) * both
        two_t = t.get("pipelined 2 threads/proc")
        faults = {
            "pipelined (both ranks)": row["faults"]["pipelined 1 thread/proc"]
            + row1["faults"]["pipelined 1 thread/proc"],
            "one process": row["faults"]["one process 1 thread"],
        }
        d = {
            "m": m, "b": b, "B": B, "ms": t, "speedup": speed, "ideal": ideal,
            "efficiency": speed / ideal,
            "speedup_vs_one_process_2_threads": t["one process 2 threads"] / pipe,
            "pipelined_2_threads_per_proc_ms": two_t,
            "micro_batch_cost": t["stage compute alone"] * 2 / single,
            "corun_slowdown": both / alone,
            "compute_bound_ms": bound,
            "machine_speedup_bound": single / bound,
            "rest_ms": pipe - bound,
            "rest_per_action_ms": (pipe - bound) / (2 * (m + 1)),
            "minor_faults_per_step": faults,
            **info,
        }  # fmt: skip
        out.append(d)
        rows.append(
            [m, b, B, single, pipe, speed, ideal, speed / ideal, t["one process 2 threads"],
             two_t if two_t is not None else "-", d["micro_batch_cost"], d["corun_slowdown"],
             bound, single / bound, pipe - bound, faults["one process"],
             faults["pipelined (both ranks)"], _rounds(info)]
        )  # fmt: skip
    table(
        "pipeline efficiency: 2 stages × 1 torch thread vs one process × 1 thread on the same "
        "global batch, 8 × Linear(1024), median ms"
        + (f" — glibc malloc tuned ({' '.join(f'{k}={v}' for k, v in MALLOC_TUNED.items())})"
           if tuned else " — default allocator"),
        ["m", "b", "B", "1 proc", "pipelined", "speedup", "ideal", "efficiency", "1 proc 2thr",
         "pipe 2thr/proc", "2·m·stage(b)/1proc(B)", "co-run ×", "compute bound",
         "bound speedup", "rest", "faults 1 proc", "faults pipe", "rounds"],
        rows,
    )  # fmt: skip
    if not tuned:
        print(
            f"  a spawned worker with OMP_NUM_THREADS unset starts with {r['default_threads']} "
            f"torch threads (this machine: {os.cpu_count()} cores). compute bound = 2·stage "
            "alone + (m−1)·stage with both computing (per micro-batch); rest = pipelined − bound: "
            "p2p, schedule, loss broadcast, optimizer. faults: minor page faults per step."
        )
    return {
        "load": load,
        "env": MALLOC_TUNED if tuned else {},
        "default_threads_unset_omp": r["default_threads"],
        "rows": out,
    }


def allocator_table(default: dict[str, Any], tuned: dict[str, Any]) -> dict[str, Any]:
    """Tuned ÷ default per implementation (two launches: a cross-launch ratio, said so)."""
    base = {(r["m"], r["B"]): r for r in default["rows"]}
    rows, out = [], []
    for r in tuned["rows"]:
        d = base.get((r["m"], r["B"]))
        if d is None:
            continue
        ratio = {k: r["ms"][k] / d["ms"][k] for k in r["ms"] if k in d["ms"]}
        out.append({"m": r["m"], "B": r["B"], "tuned_over_default": ratio,
                    "speedup_default": d["speedup"], "speedup_tuned": r["speedup"]})  # fmt: skip
        rows.append(
            [r["m"], r["b"], r["B"], ratio["one process 1 thread"],
             ratio["pipelined 1 thread/proc"], ratio["one process 2 threads"],
             d["speedup"], r["speedup"], r["efficiency"]]
        )  # fmt: skip
    table(
        "allocator: time with glibc malloc tuned ÷ default (two launches, each alternating "
        "inside; cross-launch ratios)",
        ["m", "b", "B", "1 proc 1thr", "pipelined", "1 proc 2thr", "speedup default",
         "speedup tuned", "efficiency tuned"],
        rows,
    )  # fmt: skip
    return {"rows": out}


def _scaled(prof: Any, k: float) -> Any:
    blocks = tuple(
        dataclasses.replace(b, fwd_ms=b.fwd_ms * k, bwd_ms=b.bwd_ms * k) for b in prof.blocks
    )
    return dataclasses.replace(
        prof, blocks=blocks, loss_fwd_ms=prof.loss_fwd_ms * k, loss_bwd_ms=prof.loss_bwd_ms * k
    )


def _predict(
    plan: Any, *, overhead_ms: float, link: dict[str, Any] | None = None, corun: float = 1.0
) -> float:
    """The cost model's step time for ``plan``'s own placement, with the per-action overhead,
    the loopback link (``link``: the measured p2p figures) and a compute factor replaced."""
    from planner.cost import CostModel
    from planner.cost import stage_time as cost_mod
    from planner.devices import from_record
    from planner.options import Training

    cluster = from_record(plan.cluster)
    if link is not None:
        bw, lat = link["bandwidth_Bps"], link["latency_batch_isend_irecv_s"]
        cluster = dataclasses.replace(
            cluster, intra_node_bandwidth=bw, inter_node_bandwidth=bw,
            intra_node_latency_s=lat, inter_node_latency_s=lat,
        )  # fmt: skip
    layout = plan_layout(plan)
    profs = {
        q.device: _scaled(q, corun) for q in plan.profiles if q.batch_size == plan.micro_batch_size
    }
    training = Training(global_batch=plan.global_batch, optimizer=plan.optimizer)
    saved = dict(cost_mod.ACTION_OVERHEAD_MS)
    try:
        cost_mod.ACTION_OVERHEAD_MS["gloo"] = overhead_ms
        model = CostModel(profs, cluster, training, layout)
        return model.predict([s.blocks[0] for s in plan.stages]).step_ms
    finally:
        cost_mod.ACTION_OVERHEAD_MS.clear()
        cost_mod.ACTION_OVERHEAD_MS.update(saved)


def predicted(
    plans: dict[str, Any], over: dict[str, Any], p2p_res: dict[str, Any], act: dict[str, Any],
    eff: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """The plans' predictions against ``over``'s measured medians; then re-predicted with the
    measured per-action cost and loopback link, the co-run slowdown, and the optimizer."""
    action = max(act["per_action_vs_profile_ms"], 0.0)
    corun = med([r["corun_slowdown"] for r in eff["rows"] if r["m"] > 1])
    rows, res = [], {"action_overhead_ms": action, "corun_slowdown": corun}
    for n in ("stack-m2", "stack-m4", "gpt-m4"):
        p = plans[n]
        meas = over[n]["ours_ms"]
        pred = float(p.predicted.step_ms)
        bare = _predict(p, overhead_ms=0.0)
        new = _predict(p, overhead_ms=action, link=p2p_res)
        new_co = _predict(p, overhead_ms=action, link=p2p_res, corun=corun)
        opt = max(
            over[n]["parts_ms"][f"rank{r}"]["ours"].get("optimizer.step", 0.0) for r in (0, 1)
        )
        full = new_co + opt

        def err(x: float, meas: float = meas) -> float:
            return rel_error(x, meas)

        res[n] = {
            "measured_ms": meas, "predicted_ms": pred, "no_overhead_ms": bare,
            "recalibrated_ms": new, "recalibrated_corun_ms": new_co,
            "recalibrated_corun_optimizer_ms": full, "optimizer_step_ms": opt,
            "error": err(pred), "recalibrated_error": err(new),
            "recalibrated_corun_error": err(new_co),
            "recalibrated_corun_optimizer_error": err(full),
            "split_points": p.split_points, "m": p.micro_batches, "b": p.micro_batch_size,
        }  # fmt: skip
        rows.append(
            [n, p.split_points[0], p.micro_batches, p.micro_batch_size, meas, pred, err(pred),
             bare, new, err(new), new_co, err(new_co), full, err(full)]
        )  # fmt: skip
    table(
        "predicted vs measured step (plan_model on from_gpus(2), measured profile; "
        "ParallelModel, median ms)",
        ["plan", "split", "m", "b", "measured", "predicted", "error", "pred. 0 overhead",
         "recalibrated", "error", f"+ co-run ×{corun:.2f}", "error", "+ optimizer.step",
         "error"],
        rows,
    )  # fmt: skip
    print(
        f"  recalibrated: ACTION_OVERHEAD_MS['gloo'] = {action:.2f} (per action beyond the "
        f"profile), loopback {p2p_res['bandwidth_Bps'] / 1e9:.1f} GB/s and "
        f"{p2p_res['latency_batch_isend_irecv_s'] * 1e6:.0f} µs (measured above); co-run: the "
        "median stage-compute slowdown of the efficiency study (m > 1)"
    )
    return res


def _size(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (~8 minutes)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-rt-cache-") as cache:
        os.environ["PLANNER_CACHE_DIR"] = cache
        import torch

        from bench import _runtime_workers as w

        plan_quiet = w.wait_quiet(20 if args.quick else 60)
        plans = make_plans(args.quick)
        print(
            f"plans made in {plans['plan_s']:.1f} s (other processes kept "
            f"{plans['plan_foreign_share'] * 100:.0f} % of the machine busy meanwhile: the "
            "measured profiles, and so the predictions, are only as clean as that)"
        )
        p2p_res = p2p(args.quick)
        co = corun(args.quick)
        act = actions(plans["tiny"], args.quick)
        over = overhead(plans, args.quick)
        eff = efficiency(plans["efficiency"], args.quick)
        eff_tuned = efficiency(plans["efficiency"], args.quick, tuned=True)
        alloc = allocator_table(eff, eff_tuned)
        pred = predicted(plans, over, p2p_res, act, eff)
    result = {
        "command": "python -m bench.bench_runtime" + (" --quick" if args.quick else ""),
        "meta": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "wall_s": time.perf_counter() - t0,
            "note": "medians over the quiet rounds (other processes under 10 % of the "
            "machine; all rounds when fewer than 3 were quiet); implementations alternate "
            "inside one launch; each time is barrier to barrier (the slowest rank). Times in "
            "ms unless named _s.",
            "plan_foreign_share_before": plan_quiet["foreign_share_before"],
            "plan_foreign_share": plans["plan_foreign_share"],
        },
        "p2p": p2p_res,
        "corun": co,
        "per_action": act,
        "overhead": over,
        "efficiency": eff,
        "efficiency_malloc_tuned": eff_tuned,
        "allocator": alloc,
        "predicted_vs_measured": pred,
    }
    write_json(args.out, result)
    print(f"\nwrote {args.out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
