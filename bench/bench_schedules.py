"""The schedules' search against the one-stage search and torchtitan's default:
python -m bench.bench_schedules [--quick] [--max-virtual V] [--rows NAME ...].

For every row (a model on a GPU cluster, priced analytically from shapes,
bf16-mixed, Adam), all priced by the same cost model (the simulation of each
rank's action order as torch runs it):

* **one-stage**: ``plan_model`` searching GPipe and 1F1B only (``max_virtual``
  1, the planner's default), robust band 0: its fastest predicted step;
* **schedules**: the same search with Interleaved 1F1B and Looped BFS at
  v = 2 … ``--max-virtual`` stages per rank added, robust band 0; with
  ``--dp-mode auto`` each configuration with dp ≥ 2 also with ZeRO-1 and FSDP;
* **torchtitan**: its default pipeline, set by hand the way its config does:
  the chain's blocks split evenly over pp · 2 stages (its even split of
  layers: the examples' chains are about a block per layer; the Llama chains
  about four per layer, so there it is an even split of blocks, not of layers,
  and the embedding and head are not weighted as torchtitan weights them),
  Interleaved 1F1B with 2 stages per rank, micro-batches = pp, FSDP over the
  rest of the devices (its ``data_parallel_shard_degree`` −1, with
  ``reshard_after_forward`` off under pipelining: the planner's ``fsdp``
  dp mode, one unit per stage); every pp ≥ 2
  that the cluster and batch allow is priced and the fastest that fits kept (a
  user choosing pp by hand), and also the pp the schedules' search chose.

Ratio = other / schedules: ≥ 1 means the schedules' search predicts a faster
step. Rows: bench_plan's GPU clusters with its large examples, and Llama 3 8B
and 70B shapes (meta device) on 64 and 512 H100s (8 per node). The search
status of each plan is recorded: a configuration with several stages per rank
whose step MILP ran out of time is the best found, with its proven gap.

Writes bench/results/schedules.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from bench._common import config_text, knobs, write_json

__all__ = [
    "EXAMPLES",
    "GPU_CLUSTERS",
    "LLAMA_BATCH_PER_DEVICE",
    "OUT",
    "ROWS",
    "TITAN_DP",
    "TITAN_V",
    "Row",
    "Workload",
    "format_rows",
    "main",
    "run_row",
    "summarize",
    "titan_default",
]

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "schedules.json"
TITAN_V = 2  # torchtitan's Interleaved 1F1B default: 2 stages per rank
TITAN_DP = "fsdp"  # its data parallelism by default: FSDP (data_parallel_shard_degree -1)


@dataclass(frozen=True)
class Row:
    """A model on a cluster: ``example`` is a bundled example (bench_plan's large size) or
    ``llama-8b`` / ``llama-70b``; ``cluster`` a file of examples/clusters or ``Nxh100``."""

    example: str
    cluster: str

    @property
    def name(self) -> str:
        return f"{self.example}@{self.cluster}"


EXAMPLES = ("mlp", "gpt", "resnet", "unet")
GPU_CLUSTERS = ("8xa100", "2x8xh100", "mixed-a100-v100", "64xh100")
ROWS = [Row(e, c) for c in GPU_CLUSTERS for e in EXAMPLES] + [
    Row(m, c) for m in ("llama-8b", "llama-70b") for c in ("64xh100", "512xh100")
]
LLAMA_BATCH_PER_DEVICE = 1  # sequences per device in the global batch (torchtitan: 1 to 2)


def _llama_config(name: str) -> Any:
    from bench._llama import LLAMA_70B, LlamaConfig

    if name == "llama-70b":
        return LLAMA_70B
    return LlamaConfig(  # Llama 3 8B, at torchtitan's sequence length
        layers=32, dim=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=8192
    )


def _cluster(name: str) -> Any:
    from bench.bench_plan import CLUSTERS
    from planner.devices import from_gpus, load_cluster

    if name in CLUSTERS and CLUSTERS[name] is not None:
        return load_cluster(ROOT / "examples" / "clusters" / str(CLUSTERS[name]))
    count, kind = name.split("x", 1)
    return from_gpus(int(count), kind)


class Workload(NamedTuple):
    """A row's model on the meta device and what planning it takes: ``size`` its size in
    words (bench_plan's large knobs, or the Llama's shape), ``batch`` the global batch,
    ``target`` the chain's target blocks."""

    model: Any
    sampler: Callable[[int], Any]
    loss: Any
    batch: int
    target: int
    size: str


def _model(row: Row, n_devices: int) -> Workload:
    """The row's model on meta, with its sampler, loss, global batch and size (``Workload``)."""
    import torch

    from bench.bench_plan import LARGE, to_device
    from planner.plan.modelfile import load_model_file

    if row.example.startswith("llama"):
        from bench._llama import Llama, loss_fn, token_batch

        c = _llama_config(row.example)
        with torch.device("meta"):
            llama: Any = Llama(c)

        def tokens(b: int) -> Any:
            with torch.device("meta"):
                ids, targets = token_batch(c, b)
            return (ids,), {}, targets

        size = f"{c.layers} layers, dim {c.dim}, ffn {c.ffn}, seq {c.seq}"
        return Workload(
            llama, tokens, loss_fn, LLAMA_BATCH_PER_DEVICE * n_devices, c.layers + 2, size
        )
    knob_text, per_device = LARGE[row.example]
    env = dict(kv.split("=") for kv in knob_text.split())
    with knobs(env):
        mf = load_model_file(ROOT / "examples" / f"{row.example}.py")
        with torch.device("meta"):
            model = mf.build()

    def sampler(b: int) -> Any:
        with knobs(env):
            s = mf.sample(b)
        return to_device("meta", (s.args, s.kwargs, s.targets))

    return Workload(model, sampler, mf.loss, per_device * n_devices, 32, knob_text)


def _plan(
    work: Workload,
    cluster: Any,
    training: Any,
    max_virtual: int,
    limit_s: float,
    dp_mode: str = "ddp",
) -> tuple[Any, float]:
    """(plan, planning seconds) of one search of ``work`` on ``cluster``."""
    from planner.options import PlanOptions, ProfileOptions, SearchOptions
    from planner.planning import plan_model

    options = PlanOptions(
        training=training,
        search=SearchOptions(
            time_limit_s=limit_s, robust_band_pct=0.0, max_virtual=max_virtual, dp_mode=dp_mode
        ),
        profile=ProfileOptions(target_blocks=work.target),
    )
    t0 = time.perf_counter()
    plan = plan_model(work.model, work.sampler, cluster=cluster, loss_fn=work.loss, options=options)
    return plan, time.perf_counter() - t0


def _described(plan: Any, seconds: float) -> dict[str, Any]:
    return {
        "config": config_text(plan),
        "pp": plan.pp,
        "virtual": plan.virtual,
        "step_ms": plan.predicted.step_ms,
        "status": plan.solver.status,
        "gap": plan.solver.gap,
        "plan_s": seconds,
    }


def titan_default(
    cost_model: Callable[[Any], Any], cluster: Any, batch: int, n_blocks: int, pps: Sequence[int]
) -> dict[int, tuple[float, bool, str]]:
    """pp -> (step ms, fits, layout in words) of torchtitan's default pipeline at that pp
    (module doc), the fastest of its ways to lay the ranks; pps it cannot run are left out."""
    from planner.cost import Layout
    from planner.plan.schedule import schedule_problem, stage_ranks
    from planner.search import layouts
    from planner.search.baselines import uniform

    sched = "interleaved-1f1b"
    out: dict[int, tuple[float, bool, str]] = {}
    for pp in pps:
        dp = cluster.n_devices // pp
        if batch % (dp * pp) or pp * TITAN_V > n_blocks or schedule_problem(sched, pp, pp, TITAN_V):
            continue
        starts = uniform(n_blocks, pp * TITAN_V)
        for how, grid in layouts(cluster, pp, dp):
            ranks = tuple(grid[k] for k in stage_ranks(sched, pp, TITAN_V))
            lay = Layout(pp=pp, dp=dp, micro_batches=pp, schedule=sched, ranks=ranks,
                         virtual=TITAN_V, dp_mode=TITAN_DP if dp > 1 else "ddp")  # fmt: skip
            pred = cost_model(lay).predict(starts)
            now = out.get(pp)
            key = (not pred.fits, pred.step_ms)
            if now is None or key < (not now[1], now[0]):
                text = f"pp {pp} × dp {dp}, m {pp}, v {TITAN_V}, {how}"
                out[pp] = (pred.step_ms, pred.fits, text)
    return out


def run_row(row: Row, max_virtual: int, limit_s: float, dp_mode: str = "ddp") -> dict[str, Any]:
    """Both searches and torchtitan's default on one row."""
    from bench.bench_plan import cost_models
    from planner.options import Training

    cluster = _cluster(row.cluster)
    work = _model(row, cluster.n_devices)  # built once: both searches plan the same model
    training = Training(global_batch=work.batch, precision="bf16-mixed", optimizer="adam")
    one, one_s = _plan(work, cluster, training, 1, limit_s)
    new, new_s = _plan(work, cluster, training, max_virtual, limit_s, dp_mode)
    n = cluster.n_devices
    cm = cost_models(new, cluster, training)
    pps = [p for p in range(2, n + 1) if n % p == 0]
    titan = titan_default(cm, cluster, training.global_batch, new.model.blocks, pps)
    fitting = {p: t for p, t in titan.items() if t[1]}
    best = min(fitting.values()) if fitting else None
    at_ours = titan.get(new.pp)
    ours = new.predicted.step_ms
    return {
        "row": row.name,
        "example": row.example,
        "cluster": row.cluster,
        "devices": n,
        "size": work.size,
        "parameters": new.model.parameters,
        "blocks": new.model.blocks,
        "global_batch": training.global_batch,
        "one_stage": _described(one, one_s),
        "schedules": _described(new, new_s),
        "torchtitan": {
            "best": None if best is None else {"step_ms": best[0], "config": best[2]},
            "at_ours": None
            if at_ours is None
            else {"step_ms": at_ours[0], "fits": at_ours[1], "config": at_ours[2]},
            "priced": {str(p): {"step_ms": t[0], "fits": t[1]} for p, t in titan.items()},
        },
        "ratio_one_stage": one.predicted.step_ms / ours,
        "ratio_torchtitan": None if best is None else best[0] / ours,
        "ratio_torchtitan_at_ours": at_ours[0] / ours if at_ours and at_ours[1] else None,
    }


def summarize(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Geometric mean, worst and best of each ratio, over every row and over the pipelined
    rows (either search chose pp > 1); rows whose planning failed are listed apart."""
    from bench.bench_plan import geomean

    ok = [r for r in rows if "error" not in r]
    piped = [r for r in ok if r["one_stage"]["pp"] > 1 or r["schedules"]["pp"] > 1]

    def stats(key: str, among: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        vals = [r[key] for r in among if r.get(key) is not None]
        return {
            "geomean": geomean(vals),
            "worst": min(vals, default=None),
            "best": max(vals, default=None),
            "rows": len(vals),
            "missing": len(among) - len(vals),
        }

    keys = ("ratio_one_stage", "ratio_torchtitan", "ratio_torchtitan_at_ours")
    return {
        "all": {k: stats(k, ok) for k in keys},
        "pipelined": {k: stats(k, piped) for k in keys},
        "rows_with_several_stages_per_rank": sum(r["schedules"]["virtual"] > 1 for r in ok),
        "not_proven": [r["row"] for r in ok if r["schedules"]["status"] != "optimal"],
        "errors": [f"{r['row']}: {r['error']}" for r in rows if "error" in r],
    }


def format_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table: one line per row."""
    head = "| row | one-stage search | schedules' search | status | ÷ one-stage | ÷ torchtitan |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | failed: {r['error']} | | | | |")
            continue
        o, s, t = r["one_stage"], r["schedules"], r["ratio_torchtitan"]
        lines.append(
            f"| {r['row']} | {o['step_ms']:.1f} ms ({o['config']}) | {s['step_ms']:.1f} ms "
            f"({s['config']}) | {s['status']} | {r['ratio_one_stage']:.3f} | "
            + ("does not fit" if t is None else f"{t:.3f}")
            + " |"
        )
    return "\n".join(lines)


def _say_stats(name: str, st: Mapping[str, Any]) -> str:
    g = st["geomean"]
    if g is None:
        return f"{name}: none"
    w, b, n = st["worst"], st["best"], st["rows"]
    return f"{name}: geomean {g:.3f}, worst {w:.3f}, best {b:.3f} ({n} rows)"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (``argv``: the command-line flags; None: ``sys.argv``)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--max-virtual", type=int, default=2, help="v up to it (default 2)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per ILP solve")
    ap.add_argument(
        "--dp-mode", default="ddp", choices=("ddp", "auto"), help="the schedules' search's"
    )
    ap.add_argument("--quick", action="store_true", help="the 8xa100 and 64xh100 GPT rows only")
    ap.add_argument("--rows", nargs="+", choices=[r.name for r in ROWS])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument(
        "--merge", action="store_true", help="keep the rows of --out that this run does not redo"
    )
    ns = ap.parse_args(argv)
    chosen = [r for r in ROWS if ns.rows is None or r.name in ns.rows]
    if ns.quick:
        chosen = [r for r in chosen if r.name in ("gpt@8xa100", "gpt@64xh100")]
    t_start, load = time.perf_counter(), os.getloadavg()
    flags = sys.argv[1:] if argv is None else argv
    argv_text = " ".join(["python -m bench.bench_schedules", *flags])
    rows: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    if ns.merge and Path(ns.out).exists():
        redo = {r.name for r in chosen}
        old = json.loads(Path(ns.out).read_text())
        kept = [r for r in old["rows"] if r["row"] not in redo]
        argv_text = f"{old['command']}; then {argv_text}"

    def save() -> dict[str, Any]:  # after every row: a long run stopped keeps what it did
        out = {
            "command": argv_text,
            "meta": {
                "machine": platform.platform(),
                "cpu_count": os.cpu_count(),
                "load_avg_before": load,
                "load_avg_after": os.getloadavg(),
                "wall_s": time.perf_counter() - t_start,
                "max_virtual": ns.max_virtual,
                "dp_mode": ns.dp_mode,
                "time_limit_s": ns.time_limit,
                "rows_done": f"{len(rows)} of {len(chosen)}",
            },
            "rows": [*kept, *rows],
            "summary": summarize([*kept, *rows]),
        }
        write_json(ns.out, out)
        return out

    with tempfile.TemporaryDirectory() as cache, knobs({"PLANNER_CACHE_DIR": cache}):
        for row in chosen:
            try:
                rows.append(run_row(row, ns.max_virtual, ns.time_limit, ns.dp_mode))
            except Exception as exc:  # a planner failure is a result: record it, go on
                traceback.print_exc()
                error = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
                rows.append({"row": row.name, "error": error})
            print(format_rows(rows[-1:]).splitlines()[-1], flush=True)
            save()
    done = save()
    summary = done["summary"]
    print(format_rows(done["rows"]))
    for part in ("all", "pipelined"):
        print(f"{part}: " + "; ".join(_say_stats(k, v) for k, v in summary[part].items()))
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
