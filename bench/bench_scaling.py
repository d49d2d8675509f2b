"""Planning time as the model and the cluster grow: python -m bench.bench_scaling [--quick].

1. **Search** (``planner.search.search``, everything unpinned) on synthetic
   LM-like chains of ``BLOCKS`` blocks (an embedding and an LM head 6× a
   layer, log-normal layers) on ``DEVICES`` H100s in nodes of 8, global batch
   512, with HiGHS and with CBC (PuLP's ``PULP_CBC_CMD``; the planner's default
   is HiGHS, "auto" takes CBC only when highspy is missing). Per search: wall
   time, time inside the ILP solves, configurations (pp × dp × m × schedule ×
   rank layout) considered / solved / pruned by their bound / out of memory,
   and whether every solve was proven optimal (else the worst gap and how many
   hit the per-solve time limit).
2. **End to end** on a real model: ``plan_model`` of a GPT on 64 H100s
   (analytic profile on the meta device when the planner supports it, see
   ``bench_plan.meta_profiling_problem``), split into profiling (capture
   included) and search; and ``planner plan examples/gpt.py --gpus 8`` on this
   machine (measured profile, profile cache off), the command's wall time.

``--llama70b``: only Llama 70B (meta, 80 layers) on 1024 H100s end to end, a
process per solver (profile_s, search_s, total_s, peak RSS, chosen); ``--point
BLOCKS DEVICES``: only that search point; ``--nodes N``: only ``planner plan
examples/gpt.py`` on N single-device H100 nodes, nothing pinned, a process per
solver; each merges into the results file by key.
``--quick``: two sweeps (blocks at 16 devices, devices at 64 blocks), 10 s per
solve, the end-to-end GPT once (no ``planner plan``). Writes bench/results/scaling.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

from bench._common import knobs, merged, write_json
from bench._llama import llama_end_to_end
from bench.bench_plan import meta_profiling_problem, to_device

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "scaling.json"
BLOCKS = (32, 64, 128, 256, 512)
DEVICES = (8, 16, 64, 128, 512)
SOLVERS = ("highs", "cbc")
GLOBAL_BATCH = 512


def grid(quick: bool) -> list[tuple[int, int]]:
    """(blocks, devices) points: the full grid, or --quick's two sweeps.

    Example::

        grid(True)   # [(32, 16), (128, 16), (512, 16), (64, 8), (64, 64), (64, 512)]
    """
    if not quick:
        return [(n, d) for n in BLOCKS for d in DEVICES]
    return [(n, 16) for n in (32, 128, 512)] + [(64, d) for d in (8, 64, 512)]


# --------------------------------------------------------------------------- instrumentation


class _Timer:
    """Wraps a function: every call's wall time and result (for the solver's records)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.calls: list[tuple[float, Any]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        result = None
        try:
            result = self.fn(*args, **kwargs)
            return result
        finally:  # a call that raised (e.g. nothing fits) still took its time
            self.calls.append((time.perf_counter() - t0, result))

    @property
    def seconds(self) -> float:
        return sum(t for t, _ in self.calls)


@contextlib.contextmanager
def timed(module: Any, name: str) -> Iterator[_Timer]:
    """Time every call of ``module.name`` (as the module itself looks it up) meanwhile."""
    timer = _Timer(getattr(module, name))
    with mock.patch.object(module, name, timer):
        yield timer


def solve_record(solutions: Sequence[Any], best_ms: float | None = None) -> dict[str, Any]:
    """What the search proved, over every step solve of one search (what the plan prints).

    A solve is *optimal* (its configuration's best placement, proven), *proven slower*
    (status "bounded" with a bound at or above ``best_ms``, the chosen plan's step: the
    search's ceiling ruled it out, which is a proof too), or *not proven* (a time limit,
    or a bound below the chosen step). ``proven``: no solve of the last kind, so the
    chosen plan is the fastest over every configuration.
    """
    top = math.inf if best_ms is None else best_ms * (1 + 1e-9)

    def slower(s: Any) -> bool:
        return s.status == "bounded" and s.bound is not None and s.bound * (1 + 1e-9) >= top

    unproven = [s for s in solutions if s.status != "optimal" and not slower(s)]
    gaps = [s.gap for s in unproven if s.gap is not None]
    return {
        "solves": len(solutions),
        "optimal": sum(s.status == "optimal" for s in solutions),
        "proven_slower": sum(map(slower, solutions)),
        "not_proven": len(unproven),
        "proven": not unproven,
        "time_limit_hit": sum(s.status == "time_limit" for s in solutions),
        "worst_gap": max(gaps) if gaps else (None if unproven else 0.0),
        "max_segments": max((s.n_segments for s in solutions), default=0),
    }


# --------------------------------------------------------------------------- synthetic chains


def synthetic_profile(n_blocks: int, device: str, b: int, seed: int = 0) -> Any:
    """An LM-like chain at micro-batch ``b``: log-normal layers, heavy first and last blocks."""
    from planner.plan.records import BlockCost, ModelProfile

    rnd = random.Random(seed)
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
        fingerprint=f"synthetic-{n_blocks}",
        source="analytic",
        device=device,
        batch_size=b,
        dtype="float32",
        threads=0,
        capture="export",
        blocks=tuple(blocks),
    )


def search_point(n_blocks: int, devices: int, solver: str, limit_s: float) -> dict[str, Any]:
    """One search on a synthetic chain; timings, configurations and the solver's proof."""
    import planner.search as ps
    from planner.devices import from_gpus
    from planner.options import SearchOptions, Training
    from planner.search import loop

    cluster = from_gpus(devices, "h100")
    training = Training(global_batch=GLOBAL_BATCH)
    options = SearchOptions(solver=solver, time_limit_s=limit_s, keep=10**9)
    memo: dict[tuple[str, int], Any] = {}

    def profile_for(device: str, b: int) -> Any:
        if (device, b) not in memo:
            memo[device, b] = synthetic_profile(n_blocks, device, b)
        return memo[device, b]

    configs = ps.configurations(cluster, training, options, n_blocks)
    considered = sum(len(ps.layouts(cluster, pp, dp)) for pp, dp, _, _, _ in configs)
    out: dict[str, Any] = {"blocks": n_blocks, "devices": devices, "solver": solver}
    with timed(loop, "solve_partition") as ilp, timed(loop, "solve_step") as steps:
        t0 = time.perf_counter()
        try:
            res = ps.search(profile_for, cluster, training, options, n_blocks=n_blocks)
        except ValueError as exc:  # nothing fits: a result too
            res = None
            out["error"] = str(exc).splitlines()[0]
        out["search_s"] = time.perf_counter() - t0
    out["ilp_s"] = ilp.seconds
    out["step_s"] = steps.seconds
    calls = [r for _, r in ilp.calls + steps.calls if r is not None]
    out["solver_s"] = sum(r.solver_s for r in calls)
    out["configurations"] = considered
    if res is not None:
        status: dict[str, int] = {}
        for c in res.candidates:
            key = "solved" if c.status in ("chosen", "slower", "faster") else c.status
            status[key] = status.get(key, 0) + 1
        out["candidates"] = status
        lay = res.layout
        out["chosen"] = f"pp {lay.pp} × dp {lay.dp}, m {lay.micro_batches}, {lay.schedule}"
        out["step_ms"] = res.prediction.step_ms
    best = out.get("step_ms")
    out.update(solve_record([r for _, r in steps.calls if r is not None], best))
    return out


# --------------------------------------------------------------------------- end to end


def gpt_end_to_end(
    layers: int, target_blocks: int, devices: int, solver: str, limit_s: float, warm: bool
) -> dict[str, Any]:
    """plan_model of a GPT on H100s: profiling (capture included) and search timed apart.

    ``warm``: the profiles are in the profile cache already (only the capture and
    the cache look-up are left of profiling).
    """
    import torch

    import planner.planning as api
    import planner.profile.sizes as sizes
    from planner.devices import from_gpus
    from planner.options import ProfileOptions, SearchOptions, Training
    from planner.plan.modelfile import load_model_file

    meta = not meta_profiling_problem()
    if meta:  # a 2.7 B-class width, nothing allocated
        env = {"GPT_LAYERS": str(layers), "GPT_DIM": "2560", "GPT_HEADS": "32"}
        env.update(GPT_SEQ="1024", GPT_VOCAB="50304")
        batch = 4 * devices
    else:  # real CPU tensors: the default GPT, one sample per device (memory stays small)
        env, layers, batch = {}, 6, devices
    device = "meta" if meta else "cpu"
    with knobs(env):
        mf = load_model_file(ROOT / "examples" / "gpt.py")
        with torch.device(device):
            model = mf.build()

        def sampler(b: int) -> Any:
            s = mf.sample(b)
            return to_device(device, (s.args, s.kwargs, s.targets))

        options = api.PlanOptions(
            training=Training(global_batch=batch, precision="bf16-mixed"),
            search=SearchOptions(solver=solver, time_limit_s=limit_s),
            profile=ProfileOptions(target_blocks=target_blocks),
        )
        cluster = from_gpus(devices, "h100")
        with timed(sizes, "profile_model") as prof, timed(api, "search") as srch:
            t0 = time.perf_counter()
            plan = api.plan_model(model, sampler, cluster=cluster, loss_fn=mf.loss, options=options)
            total = time.perf_counter() - t0
    return {
        "model": f"gpt {layers} layers"
        + (", dim 2560, seq 1024, meta device" if meta else ", default width, CPU tensors"),
        "global_batch": batch,
        "parameters": plan.model.parameters,
        "blocks": plan.model.blocks,
        "devices": devices,
        "solver": solver,
        "profiles": len(prof.calls),
        "profile_s": prof.seconds,
        "search_s": srch.seconds,
        "cache": "warm" if warm else "cold",
        "total_s": total,
        "chosen": f"pp {plan.pp} × dp {plan.dp}, m {plan.micro_batches}, {plan.schedule}",
        "solver_status": plan.solver.status,
    }


def cli_end_to_end(example: str = "gpt", gpus: int = 8) -> dict[str, Any]:
    """Wall time of ``planner plan examples/<example>.py --gpus N`` here, cache off."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PLANNER_CACHE_DIR=tmp)
        cmd = [sys.executable, "-m", "planner", "plan", str(ROOT / "examples" / f"{example}.py")]
        cmd += ["--gpus", str(gpus), "--out", str(Path(tmp) / "plan.yaml")]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"planner plan failed:\n{proc.stderr[-2000:]}")
    return {"command": f"planner plan examples/{example}.py --gpus {gpus}", "wall_s": wall}


def nodes_end_to_end(nodes: int, solver: str, limit_s: float) -> dict[str, Any]:
    """``planner plan examples/gpt.py`` on ``nodes`` single-device H100 nodes (a cluster
    file, ``--batch-size nodes``: one sample per device at dp = nodes), nothing pinned, in
    a process of its own: wall time, peak RSS, the configurations and the plan."""
    from planner.plan.files import load_plan

    rss = (
        "import resource, sys; from planner.cli import main; rc = main(sys.argv[1:]); "
        "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
        "file=sys.stderr); sys.exit(rc)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        cluster, plan_file = Path(tmp) / "cluster.yaml", Path(tmp) / "plan.yaml"
        cluster.write_text(f"nodes:\n  - {{type: h100, count: 1, repeat: {nodes}}}\n")
        args = ["plan", str(ROOT / "examples" / "gpt.py"), "--cluster", str(cluster)]
        args += ["--batch-size", str(nodes), "--solver", solver, "--time-limit", str(limit_s)]
        env = dict(os.environ, PLANNER_CACHE_DIR=tmp)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", rss, *args, "--out", str(plan_file)],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800,
        )  # fmt: skip
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(f"planner {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
        plan = load_plan(plan_file)
    peak = next(ln for ln in proc.stderr.splitlines() if ln.startswith("peak_rss_kib"))
    status: dict[str, int] = {}
    for c in plan.candidates:
        status[c.status] = status.get(c.status, 0) + 1
    return {
        "model": f"examples/gpt.py on {nodes} single-device h100 nodes",
        "devices": nodes,
        "solver": solver,
        "command": f"planner plan examples/gpt.py --cluster <{nodes} × 1 h100> "
        f"--batch-size {nodes} --solver {solver}",
        "total_s": wall,
        "peak_rss_mib": int(peak.split()[1]) / 1024,
        "candidates_recorded": status,
        "chosen": f"pp {plan.pp} × dp {plan.dp}, m {plan.micro_batches}, {plan.schedule}",
        "step_ms": plan.predicted.step_ms,
        "solver_status": plan.solver.status,
        "load_avg": os.getloadavg(),
    }


# --------------------------------------------------------------------------- report


def _proof(r: dict[str, Any]) -> str:
    if r.get("error"):
        return "no plan"
    if r["proven"]:
        return "optimal"
    hit = f", {r['time_limit_hit']} hit the limit" if r["time_limit_hit"] else ""
    gap = "?" if r["worst_gap"] is None else f"{r['worst_gap']:.2%}"
    return f"{r['not_proven']}/{r['solves']} not proven (gap ≤ {gap}{hit})"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """blocks × devices → per solver: search s, ILP s, configurations, proof (markdown)."""
    head = "| blocks | devices | solver | search s | closed-form ILP s | step solver s | solver s "
    head += "| configs (solved / pruned / OOM) | chosen | proof |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.get("candidates", {})
        counts = f"{r['configurations']} ({c.get('solved', 0)} / {c.get('pruned', 0)} / "
        counts += f"{c.get('out_of_memory', 0)})"
        lines.append(
            f"| {r['blocks']} | {r['devices']} | {r['solver']} | {r['search_s']:.1f} | "
            f"{r['ilp_s']:.1f} | {r['step_s']:.1f} | {r['solver_s']:.1f} | {counts} | "
            f"{r.get('chosen', r.get('error', ''))} | {_proof(r)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (``argv``: the command-line flags; None: ``sys.argv``)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two sweeps, 10 s per-solve limit")
    ap.add_argument("--limit", type=float, help="per-solve time limit, s (default 60; quick 10)")
    ap.add_argument("--solvers", nargs="+", choices=SOLVERS, default=list(SOLVERS))
    ap.add_argument("--skip-e2e", action="store_true", help="the synthetic grid only")
    ap.add_argument("--llama70b", action="store_true", help="only Llama 70B on 1024 H100s")
    ap.add_argument("--point", nargs=2, type=int, metavar=("BLOCKS", "DEVICES"),
                    help="only this synthetic search point")  # fmt: skip
    ap.add_argument(
        "--nodes",
        type=int,
        metavar="N",
        help="only examples/gpt.py on N single-device H100 nodes, end to end",
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="per --llama70b case, s")
    ap.add_argument("--out", default=str(OUT))
    ns = ap.parse_args(argv)
    limit = ns.limit or (10.0 if ns.quick else 60.0)
    t_start = time.perf_counter()
    if ns.llama70b or ns.point or ns.nodes:
        return _one_case(ns, limit, t_start)
    rows = []
    for n, d in grid(ns.quick):
        for solver in ns.solvers:
            rows.append(search_point(n, d, solver, limit))
            _say(rows[-1])
    print(format_table(rows))
    e2e: list[dict[str, Any]] = []
    if not ns.skip_e2e:
        # (GPT layers, profile granularity, devices): about 130, 450 and 130 blocks
        sizes = [(32, 64, 64)] if ns.quick else [(32, 64, 64), (64, 512, 64), (32, 64, 512)]
        with tempfile.TemporaryDirectory() as cache, knobs({"PLANNER_CACHE_DIR": cache}):
            for layers, target, devices in sizes:
                for k, solver in enumerate(ns.solvers):
                    e2e.append(gpt_end_to_end(layers, target, devices, solver, limit, k > 0))
                    print(f"end to end: {e2e[-1]}", flush=True)
        if not ns.quick:
            e2e.append(cli_end_to_end())
            print(f"end to end: {e2e[-1]}", flush=True)
    wall = time.perf_counter() - t_start
    out: dict[str, Any] = {
        "command": "python -m bench.bench_scaling" + (" --quick" if ns.quick else ""),
        "meta": {
            "machine": platform.platform(),
            "python": sys.version.split()[0],
            "cpu_count": os.cpu_count(),
            "load_avg": os.getloadavg(),
            "time_limit_s": limit,
            "global_batch": GLOBAL_BATCH,
            "wall_s": wall,
            "note": "search_s: the whole search (bounds, both solvers, simulation); "
            "ilp_s: inside solve_partition (the closed-form seed: heuristic, pruning, "
            "solver); step_s: inside solve_step (pruning, the step MILP, enumeration, "
            "polish); solver_s: inside HiGHS / CBC for both (through PuLP, model transfer "
            "included); the proof columns are the step solver's; configurations: "
            "pp × dp × m × schedule × rank layouts considered.",
        },
        "search": rows,
        "end_to_end": e2e,
    }
    return _write(ns.out, out, wall)


def _say(r: dict[str, Any]) -> None:
    print(
        f"{r['blocks']:4d} blocks {r['devices']:4d} devices {r['solver']:5s}: search "
        f"{r['search_s']:6.1f} s, closed form {r['ilp_s']:6.1f} s, step {r['step_s']:6.1f} s "
        f"(MILP solvers {r['solver_s']:.1f} s), {r['configurations']} configs "
        f"{r.get('candidates')}, {r.get('chosen', r.get('error'))}, {_proof(r)}",
        flush=True,
    )


def _one_case(ns: argparse.Namespace, limit: float, t_start: float) -> int:
    """--llama70b, --point or --nodes: run it, merge its records into the results file."""
    rows, e2e = [], []
    for solver in ns.solvers:
        if ns.point:
            rows.append(search_point(ns.point[0], ns.point[1], solver, limit))
            rows[-1]["load_avg"] = os.getloadavg()
            _say(rows[-1])
        if ns.llama70b:
            e2e.append(llama_end_to_end(solver, limit, ns.timeout))
            print(f"end to end: {e2e[-1]}", flush=True)
        if ns.nodes:
            e2e.append(nodes_end_to_end(ns.nodes, solver, limit))
            print(f"end to end: {e2e[-1]}", flush=True)
    path = Path(ns.out)
    old = json.loads(path.read_text()) if path.exists() else {}
    return _write(
        path, merged(old, {"search": rows, "end_to_end": e2e}), time.perf_counter() - t_start
    )


def _write(path: str | Path, out: dict[str, Any], wall: float) -> int:
    written = write_json(path, out)
    print(f"wrote {written} ({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
