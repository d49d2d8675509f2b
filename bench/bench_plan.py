"""Plan quality against today's partitioners: python -m bench.bench_plan [--quick].

For every example (mlp, gpt, resnet, unet) on every cluster of ``CLUSTERS``:

* **ours**: ``plan_model`` with nothing pinned (pp, dp, micro-batches, schedule
  and layout searched); its predicted step time.
* **each baseline** — uniform blocks per stage (torchtitan / PiPPy's default),
  parameter-balanced (DeepSpeed's ``partition_method="parameters"``) and
  time-balanced (torchgpipe's ``balance_by_time``) — twice:
  *at ours*: its placement at our pp / dp / m / schedule / layout;
  *at its best*: its placement at every configuration our search considers,
  keeping the fastest that fits in memory (what a user tuning that tool's
  knobs by brute force would get).

All placements are priced by the same cost model (the discrete-event
simulation of the schedule). Ratio = baseline / ours: ≥ 1 means ours is faster.
A baseline that fits nowhere is reported as "does not fit": counted, and left
out of the geometric means.

The local CPU cluster is measured at the examples' default sizes. The GPU
clusters are priced analytically (roofline, bf16-mixed) for larger versions of
the examples (``LARGE``: a 3.8 B-parameter GPT, ...), built on the meta device
so nothing is allocated. (On the meta device ``scaled_dot_product_attention``
takes its math path, so the GPT's attention is priced without flash attention:
the same for every partitioner.) If the planner cannot profile meta-device
models correctly (``meta_profiling_problem``), the GPU rows fall back to the
default sizes on CPU tensors, and the output says so.

Writes bench/results/plan.json.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench._common import config_text, knobs, plan_layout, write_json

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "plan.json"
EXAMPLES = ("mlp", "gpt", "resnet", "unet")
BASELINES = ("uniform", "deepspeed_balanced", "time_balanced")
MODES = ("at_ours", "at_best")

# name -> cluster file under examples/clusters (None: 8 local CPU processes, measured)
CLUSTERS: dict[str, str | None] = {
    "8xcpu": None,
    "8xa100": "8xa100.yaml",
    "2x8xh100": "2x8xh100.yaml",
    "mixed-a100-v100": "mixed-a100-v100.yaml",
    "64xh100": "64xh100.yaml",
}

# The examples' knobs on the GPU clusters, and the global batch per device there:
# sizes where a replica no longer fits one device (gpt: 3.8 B parameters) or
# where the gradient all-reduce rivals the compute (mlp), so pipelining matters.
LARGE: dict[str, tuple[str, int]] = {
    "gpt": ("GPT_LAYERS=32 GPT_DIM=3072 GPT_HEADS=24 GPT_SEQ=1024 GPT_VOCAB=50304", 4),
    "mlp": ("MLP_SCALE=16 MLP_IN=8192", 64),
    "resnet": ("RESNET_WIDTH=128 RESNET_BLOCKS=6 RESNET_RES=224", 32),
    "unet": ("UNET_DEPTH=5 UNET_WIDTH=64 UNET_RES=256", 8),
}


# --------------------------------------------------------------------------- pure: summary


def geomean(values: Sequence[float]) -> float | None:
    """Geometric mean of positive numbers; None for none.

    Example::

        geomean([1.0, 4.0])   # 2.0
    """
    if not values:
        return None
    if any(not v > 0 for v in values):
        raise ValueError(f"geometric mean needs positive numbers, got {list(values)}")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _stats(ratios: Sequence[float | None]) -> dict[str, Any]:
    fit = [r for r in ratios if r is not None]
    return {
        "geomean": geomean(fit),
        "rows": len(fit),
        "does_not_fit": len(ratios) - len(fit),
        "worst": min(fit) if fit else None,
        "best": max(fit) if fit else None,
    }


def summarize(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Geometric means of baseline / ours, per cluster × baseline × mode, per baseline, overall.

    Each row: ``{"cluster": str, "ours": {"pp": int}, "baselines": {name: {mode:
    {"ratio": float | None}}}}`` with ``ratio`` None when the baseline does not
    fit ("does_not_fit" counts those). Rows with an ``"error"`` (the planner
    failed) are left out and listed. "pipelined": the rows where our plan has
    pp > 1 (with pp = 1, pure data parallelism, every partitioner is the same).
    """
    failed = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    clusters = list(dict.fromkeys(r["cluster"] for r in rows))

    def ratios(
        name: str | None, mode: str, cluster: str | None, piped: bool = False
    ) -> list[float | None]:
        return [
            r["baselines"][b][mode]["ratio"]
            for r in rows
            if (cluster is None or r["cluster"] == cluster) and (not piped or r["ours"]["pp"] > 1)
            for b in BASELINES
            if name is None or b == name
        ]

    return {
        "by_cluster": {
            c: {b: {m: _stats(ratios(b, m, c)) for m in MODES} for b in BASELINES} for c in clusters
        },
        "by_baseline": {b: {m: _stats(ratios(b, m, None)) for m in MODES} for b in BASELINES},
        "overall": {m: _stats(ratios(None, m, None)) for m in MODES},
        "pipelined": {m: _stats(ratios(None, m, None, piped=True)) for m in MODES},
        "pure_dp_rows": sum(r["ours"]["pp"] == 1 for r in rows),
        "errors": [f"{r['example']} on {r['cluster']}: {r['error']}" for r in failed],
    }


def _cell(stats: Mapping[str, Any]) -> str:
    g = stats["geomean"]
    text = "does not fit" if g is None else f"{g:.3f}"
    if g is not None and stats["does_not_fit"]:
        text += f" ({stats['does_not_fit']} n/f)"
    return text


def format_summary(summary: Mapping[str, Any]) -> str:
    """The summary as a markdown table: rows per cluster, a column per baseline × mode."""
    head = ["cluster"] + [f"{b} @{m.removeprefix('at_')}" for b in BASELINES for m in MODES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cluster, per in summary["by_cluster"].items():
        cells = [_cell(per[b][m]) for b in BASELINES for m in MODES]
        lines.append(f"| {cluster} | " + " | ".join(cells) + " |")
    cells = [_cell(summary["by_baseline"][b][m]) for b in BASELINES for m in MODES]
    lines.append("| **all** | " + " | ".join(cells) + " |")
    overall = ", ".join(f"{m}: {_cell(summary['overall'][m])}" for m in MODES)
    lines.append(f"\noverall geometric mean baseline/ours (every baseline): {overall}")
    piped = ", ".join(f"{m}: {_cell(summary['pipelined'][m])}" for m in MODES)
    lines.append(
        f"where our plan pipelines (pp > 1; {summary['pure_dp_rows']} rows are pure data "
        f"parallel, ratio 1 at our config): {piped}"
    )
    lines += [f"planner failed: {e}" for e in summary["errors"]]
    return "\n".join(lines)


# --------------------------------------------------------------------------- models


_COMPARED = ("fwd_ms", "bwd_ms", "activation_bytes", "param_bytes", "boundary_bytes")


@functools.cache
def meta_profiling_problem() -> str:
    """What differs between the analytic profiles of a small model on the meta device
    and on CPU tensors ("" when nothing does: meta-device models can be planned)."""
    import torch
    from torch import nn

    from planner.options import ProfileOptions
    from planner.profile import profile_model

    x, y = torch.randn(4, 16), torch.randint(0, 4, (4,))
    profs = []
    for device in ("cpu", "meta"):
        with torch.device(device):
            model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        profs.append(
            profile_model(
                model,
                (x.to(device),),
                targets=y.to(device),
                loss_fn=nn.functional.cross_entropy,
                options=ProfileOptions(device="h100", cache=False),
            )
        )
    for a, b in zip(profs[0].blocks, profs[1].blocks, strict=True):
        diff = [
            f"{f} {getattr(a, f):.6g} vs {getattr(b, f):.6g}"
            for f in _COMPARED
            if getattr(a, f) != getattr(b, f)
        ]
        if diff:
            return f"block {a.name!r} on CPU vs meta: " + ", ".join(diff)
    return ""


def _cluster(name: str) -> Any:
    from planner.devices import from_gpus, load_cluster

    path = CLUSTERS[name]
    return from_gpus(8, "cpu") if path is None else load_cluster(ROOT / "examples/clusters" / path)


def to_device(device: str, tree: Any) -> Any:
    """Every tensor in ``tree`` moved to ``device``."""
    import torch

    return torch.utils._pytree.tree_map(
        lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree
    )


# --------------------------------------------------------------------------- one row


def _baseline_starts(name: str, prof: Any, pp: int) -> tuple[int, ...]:
    from planner.search import baselines as bl

    if name == "uniform":
        return bl.uniform(len(prof.blocks), pp)
    if name == "deepspeed_balanced":
        return bl.deepspeed_balanced([b.param_bytes for b in prof.blocks], pp)
    return bl.time_balanced([b.fwd_ms + b.bwd_ms for b in prof.blocks], pp)


def cost_models(plan: Any, cluster: Any, training: Any) -> Any:
    """layout -> its CostModel, from the profiles the plan keeps (as the search priced it)."""
    from planner.cost import CostModel
    from planner.profile.sizes import at_batch_size

    anchors: dict[str, list[Any]] = {}
    for p in plan.profiles:
        anchors.setdefault(p.device, []).append(p)
    memo: dict[tuple[str, int], Any] = {}

    def profile_for(device: str, b: int) -> Any:
        if (device, b) not in memo:
            memo[device, b] = at_batch_size(anchors[device], b)
        return memo[device, b]

    def cost_model(layout: Any) -> Any:
        b = layout.micro_batch_size(training.global_batch)
        types = sorted({cluster.devices[r].device.key for st in layout.ranks for r in st})
        return CostModel({t: profile_for(t, b) for t in types}, cluster, training, layout)

    return cost_model


def compare(plan: Any, cluster: Any, training: Any, search_options: Any) -> dict[str, Any]:
    """Every baseline at the plan's configuration and at its own best one (see module doc).

    The baselines split by the profile of the first device type by name (on the
    mixed cluster the A100's), as a user profiling on one device would.
    """
    from planner.cost import Layout
    from planner.search import configurations, layouts

    cost_model = cost_models(plan, cluster, training)
    ours_ms = plan.predicted.step_ms
    ours = plan_layout(plan)
    out: dict[str, dict[str, Any]] = {}
    cm = cost_model(ours)
    # A check on this bench: rebuilt from the plan's profiles, the cost model
    # prices our placement as the search did.
    repriced = cm.predict(tuple(s.blocks[0] for s in plan.stages)).step_ms
    if abs(repriced - ours_ms) > 1e-6 * ours_ms:
        print(f"warning: our placement reprices at {repriced} ms, not {ours_ms}", file=sys.stderr)
    for name in BASELINES:
        pred = cm.predict(_baseline_starts(name, cm.profile, ours.pp))
        out[name] = {
            "at_ours": {
                "step_ms": pred.step_ms,
                "fits": pred.fits,
                "ratio": pred.step_ms / ours_ms if pred.fits else None,
            }
        }
    n_blocks = len(plan.profiles[0].blocks)
    best: dict[str, tuple[float, str] | None] = dict.fromkeys(BASELINES)
    tried = 0
    for pp, dp, m, sched, v in configurations(cluster, training, search_options, n_blocks):
        if v > 1:  # the baselines split one stage per rank
            continue
        for _, grid in layouts(cluster, pp, dp):
            lay = Layout(pp=pp, dp=dp, micro_batches=m, schedule=sched, ranks=grid)
            cm = cost_model(lay)
            tried += 1
            for name in BASELINES:
                pred = cm.predict(_baseline_starts(name, cm.profile, pp))
                now = best[name]
                if pred.fits and (now is None or pred.step_ms < now[0]):
                    best[name] = (pred.step_ms, config_text(lay))
    for name in BASELINES:
        found = best[name]
        out[name]["at_best"] = {
            "step_ms": None if found is None else found[0],
            "config": None if found is None else found[1],
            "ratio": None if found is None else found[0] / ours_ms,
        }
    return {"baselines": out, "configurations_priced": tried, "ours_repriced_ms": repriced}


def _target_blocks(analytic: bool) -> int:
    """Chain granularity. 32 on the GPU clusters: the large GPT's chain is then its
    layers (plus embedding and head), so "uniform" is torchtitan's equal layers
    per stage, not equal pieces of layers; and the search stays quick."""
    return 32 if analytic else 64


def row(example: str, cluster_name: str, *, quick: bool, large: bool) -> dict[str, Any]:
    """Plan one example on one cluster and price the baselines against it."""
    import torch

    from planner.options import PlanOptions, ProfileOptions, SearchOptions, Training
    from planner.plan.modelfile import load_model_file
    from planner.planning import plan_model

    cluster = _cluster(cluster_name)
    analytic = CLUSTERS[cluster_name] is not None
    knob_text, per_device = LARGE[example] if analytic and large else ("", 0)
    env = dict(kv.split("=") for kv in knob_text.split())
    device = "meta" if env else "cpu"
    with knobs(env):
        mf = load_model_file(ROOT / "examples" / f"{example}.py")
        with torch.device(device):
            model = mf.build()
        n = cluster.n_devices
        batch = per_device * n if env else max(mf.batch_size // n, 1) * n
        training = Training(
            global_batch=batch, precision="bf16-mixed" if analytic else "fp32", optimizer="adam"
        )
        search = SearchOptions(time_limit_s=20.0 if quick else 60.0)
        options = PlanOptions(
            training=training,
            search=search,
            profile=ProfileOptions(
                repeats=1 if quick else 3, warmup=1, target_blocks=_target_blocks(analytic)
            ),
        )

        def sampler(b: int) -> tuple[Any, Any, Any]:
            s = mf.sample(b)
            return to_device(device, (s.args, s.kwargs, s.targets))

        t0 = time.perf_counter()
        plan = plan_model(model, sampler, cluster=cluster, loss_fn=mf.loss, options=options)
        plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compared = compare(plan, cluster, training, search)
    return {
        "example": example,
        "cluster": cluster_name,
        "devices": n,
        "profile": "analytic" if analytic else "measured",
        "size": f"large: {knob_text}" if env else "default",
        "parameters": plan.model.parameters,
        "blocks": plan.model.blocks,
        "target_blocks": _target_blocks(analytic),
        "global_batch": batch,
        "precision": training.precision,
        "ours": {
            "config": config_text(plan),
            "pp": plan.pp,
            "step_ms": plan.predicted.step_ms,
            "solver": plan.solver.status,
            "plan_s": plan_s,
        },
        **compared,
        "compare_s": time.perf_counter() - t0,
    }


def _print_row(r: Mapping[str, Any]) -> None:
    if "error" in r:
        print(f"{r['example']:6s} {r['cluster']:15s} planner failed: {r['error']}", flush=True)
        return
    parts = []
    for b in BASELINES:
        cells = []
        for m in MODES:
            ratio = r["baselines"][b][m]["ratio"]
            cells.append("n/f" if ratio is None else f"{ratio:.3f}")
        parts.append(f"{b} {'/'.join(cells)}")
    print(
        f"{r['example']:6s} {r['cluster']:15s} {r['parameters'] / 1e6:8.1f} M "
        f"ours {r['ours']['step_ms']:10.2f} ms ({r['ours']['config']}); "
        + "; ".join(parts)
        + f"  [{r['ours']['plan_s']:.0f} s + {r['compare_s']:.0f} s]",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (``argv``: the command-line flags; None: ``sys.argv``)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="1 profiling repeat (the CPU cluster), 20 s ILP limit",
    )
    ap.add_argument("--examples", nargs="+", choices=EXAMPLES, default=list(EXAMPLES))
    ap.add_argument("--clusters", nargs="+", choices=list(CLUSTERS), default=list(CLUSTERS))
    ap.add_argument("--out", default=str(OUT))
    ns = ap.parse_args(argv)
    t_start = time.perf_counter()
    problem = meta_profiling_problem()
    if problem:
        print(
            "warning: the planner does not profile meta-device models like CPU ones "
            f"({problem}); the GPU clusters use the examples' default sizes on CPU tensors",
            file=sys.stderr,
        )
    print("ratios: baseline / ours at our config / at its best config (≥ 1: ours faster)")
    rows = []
    with tempfile.TemporaryDirectory() as cache, knobs({"PLANNER_CACHE_DIR": cache}):
        for cluster in ns.clusters:
            for ex in ns.examples:
                try:
                    rows.append(row(ex, cluster, quick=ns.quick, large=not problem))
                except Exception as exc:  # a planner failure is a result: record it, go on
                    traceback.print_exc()
                    error = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
                    rows.append({"example": ex, "cluster": cluster, "error": error})
                _print_row(rows[-1])
    summary = summarize(rows)
    print(format_summary(summary))
    wall = time.perf_counter() - t_start
    out: dict[str, Any] = {
        "command": "python -m bench.bench_plan" + (" --quick" if ns.quick else ""),
        "meta": {
            "machine": platform.platform(),
            "python": sys.version.split()[0],
            "cpu_count": os.cpu_count(),
            "load_avg": os.getloadavg(),
            "wall_s": wall,
            "large_models": not problem,
            "meta_profiling_problem": problem,
            "note": "ratio = baseline step / our step (same cost model); at_ours: the "
            "baseline's placement at our pp/dp/m/schedule/layout; at_best: at every "
            "configuration our search considers, the fastest that fits. None: does not fit.",
        },
        "rows": rows,
        "summary": summary,
    }
    path = write_json(ns.out, out)
    print(f"wrote {path} ({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
