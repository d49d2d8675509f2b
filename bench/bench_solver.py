"""Time the partition ILP to proven optimality: python -m bench.bench_solver.

Cases (see CASES):
- "lm": a decoder-only LM cut into fine blocks: log-normal block times, an
  embedding block first and a heavy LM head last, a per-micro-batch fixed
  cost per stage, hidden-state transfers (slower across nodes of 8), 1F1B
  memory (stage s keeps S − s micro-batches in flight) on 80 GB devices, and
  an exposed data-parallel all-reduce; m = 8.
- "lm/ilp": the same with one pruning round only, so the ILP does the work
  (the formulation of DESIGN's measured note, plus root bounds).
- "sync": parameters unrelated to time (m = 2), so the all-reduce term fights
  the bottleneck: the hard case for the bounds.
``--quick``: the cases of QUICK_CASES, one seed, a 10 s limit (seconds, not minutes).
Prints a table and writes bench/results/solver.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

import pulp

from planner.search import baselines
from planner.solve.feasible import heuristic
from planner.solve.partition import solve_partition
from planner.solve.problem import PartitionProblem
from planner.solve.prune import PRUNE_ROUNDS, prune
from planner.solve.segments import SegmentCosts, evaluate

GB = 1e9


def make_instance(n: int, stages: int, m: int = 8, seed: int = 0) -> PartitionProblem:
    """A realistic random chain of n blocks on `stages` homogeneous stages."""
    rng = random.Random(seed)
    ms = [rng.lognormvariate(0.0, 0.35) for _ in range(n)]  # fwd+bwd ms per micro-batch
    ms[0] = 1.5  # embedding
    ms[-1] = 6.0  # LM head + loss over a large vocabulary
    params = [t * rng.uniform(0.8, 1.2) * 0.4 * GB for t in ms]  # bytes (bf16 weights)
    params[0] = params[-1] = 1.6 * GB
    acts = [t * 0.35 * GB for t in ms]  # saved activations per micro-batch
    hidden = [0.0] + [rng.choice((16, 16, 16, 24)) * 2**20 for _ in range(n - 1)]
    prefix_t = [0.0]
    prefix_p = [0.0]
    prefix_a = [0.0]
    for t, p, a in zip(ms, params, acts, strict=True):
        prefix_t.append(prefix_t[-1] + t)
        prefix_p.append(prefix_p[-1] + p)
        prefix_a.append(prefix_a[-1] + a)
    overhead = 0.4  # ms per micro-batch per stage (see DESIGN's measured notes)
    intra, inter = 150e6, 25e6  # bytes per ms: NVLink-ish inside a node, IB across

    def work(s: int, i: int, j: int) -> float:
        return prefix_t[j] - prefix_t[i] + overhead

    def memory(s: int, i: int, j: int) -> float:
        in_flight = min(m, stages - s)
        return 8 * (prefix_p[j] - prefix_p[i]) + in_flight * (prefix_a[j] - prefix_a[i])

    def cut(s: int, j: int) -> float:
        return hidden[j] / (inter if (s + 1) % 8 == 0 else intra)

    def sync(s: int, i: int, j: int) -> float:
        return 0.25 * (prefix_p[j] - prefix_p[i]) / inter  # the non-overlapped share

    need = sum(memory(s, 0, n) for s in range(stages)) / stages / stages
    return PartitionProblem(
        n_blocks=n,
        n_stages=stages,
        micro_batches=m,
        seg_work=work,
        seg_memory=memory,
        capacity=[max(80 * GB, 1.4 * need)] * stages,
        cut_time=cut,
        seg_sync=sync,
        stage_class=[0] * stages,
    )


def make_sync_heavy(n: int, stages: int, m: int = 2, seed: int = 0) -> PartitionProblem:
    """A hard case: parameters unrelated to time, so the all-reduce fights the bottleneck."""
    rng = random.Random(seed)
    ms = [rng.lognormvariate(0.0, 1.0) for _ in range(n)]
    params = [rng.lognormvariate(0.0, 1.5) for _ in range(n)]
    link = [rng.uniform(0.0, 3.0) for _ in range(n)]
    pt, pp = [0.0], [0.0]
    for t, q in zip(ms, params, strict=True):
        pt.append(pt[-1] + t)
        pp.append(pp[-1] + q)
    return PartitionProblem(
        n_blocks=n,
        n_stages=stages,
        micro_batches=m,
        seg_work=lambda s, i, j: pt[j] - pt[i] + 0.3,
        seg_memory=lambda s, i, j: 0.0,
        capacity=[1.0] * stages,
        cut_time=lambda s, j: link[j],
        seg_sync=lambda s, i, j: pp[j] - pp[i],
        stage_class=[0] * stages,
    )


CASES = (
    # (label, blocks, stages, maker, pruning rounds: 0 = until stable, 1 = first round only)
    ("lm", 200, 16, make_instance, 0),
    ("lm", 400, 32, make_instance, 0),
    ("lm/ilp", 200, 16, make_instance, 1),
    ("lm/ilp", 400, 32, make_instance, 1),
    ("sync", 300, 24, make_sync_heavy, 0),
)
QUICK_CASES = CASES[:3]


def _baselines(problem: PartitionProblem) -> dict[str, float | None]:
    """Step time of today's partitioners on the same cost model (None: does not fit)."""
    n, S = problem.n_blocks, problem.n_stages
    times = [problem.seg_work(0, i, i + 1) for i in range(n)]
    params = [problem.seg_sync(0, i, i + 1) for i in range(n)]
    out: dict[str, float | None] = {}
    for name, starts in (
        ("uniform", baselines.uniform(n, S)),
        ("deepspeed_balanced", baselines.deepspeed_balanced(params, S)),
        ("time_balanced", baselines.time_balanced(times, S)),
    ):
        b = [*starts, n]
        fits = all(problem.seg_memory(s, b[s], b[s + 1]) <= problem.capacity[s] for s in range(S))
        out[name] = evaluate(problem, starts) if fits else None
    return out


def run(
    label: str, n: int, stages: int, maker: Any, rounds: int, solver: str, seed: int, limit: float
) -> dict[str, object]:
    problem = maker(n, stages, seed=seed)
    rounds = rounds or PRUNE_ROUNDS
    t0 = time.perf_counter()
    c = SegmentCosts(problem)
    inc = heuristic(c)
    assert inc is not None
    t_heur = time.perf_counter() - t0
    segs = prune(c, c.objective(inc), inc, rounds=rounds)
    t_prune = time.perf_counter() - t0 - t_heur
    sol = solve_partition(problem, solver=solver, time_limit_s=limit, prune_rounds=rounds)
    return {
        "case": label,
        "blocks": n,
        "stages": stages,
        "seed": seed,
        "solver": solver,
        "status": sol.status,
        "gap": sol.gap,
        "solve_s": round(sol.solve_s, 3),
        "heuristic_s": round(t_heur, 3),
        "prune_s": round(t_prune, 3),
        "solver_s": round(sol.solver_s, 3),
        "segments": sol.n_segments,
        "rows": 2 * stages + sum(len(layer) for layer in segs.layers),
        "objective": sol.objective,
        "heuristic_objective": c.objective(inc),
        "root_bound": segs.root,
        "baselines": _baselines(problem),
        "solver_status": sol.solver_status,
    }


def _pick(row: dict[str, object], *names: str) -> list[object]:
    found = row["baselines"]
    assert isinstance(found, dict)
    return [found[name] for name in names]


def _gain(ours: object, other: object) -> str:
    if not isinstance(other, float) or not isinstance(ours, float):
        return "n/a"
    return f"{1 - ours / other:.2%}"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (``argv``: the command-line flags; None: ``sys.argv``)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 cases, 1 seed, 10 s limit")
    ap.add_argument("--seeds", type=int, help="seeds per case (default 3; quick 1)")
    ap.add_argument("--limit", type=float, help="time limit per solve, s (default 60; quick 10)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "solver.json"))
    args = ap.parse_args(argv)
    seeds = args.seeds or (1 if args.quick else 3)
    limit = args.limit or (10.0 if args.quick else 60.0)
    rows = []
    header = f"{'case':>7} {'n×S':>7} {'seed':>4} {'solver':>6} {'status':>10} {'gap':>8} "
    header += f"{'total s':>7} {'heur s':>6} {'prune s':>7} {'solver s':>8} {'segments':>8} "
    header += f"{'rows':>6} {'vs heur':>7} {'vs unif':>7} {'vs time':>7}"
    print(header)
    for label, n, stages, maker, rounds in QUICK_CASES if args.quick else CASES:
        for seed in range(seeds):
            for solver in ("highs", "cbc"):
                r = run(label, n, stages, maker, rounds, solver, seed, limit)
                rows.append(r)
                gains = [
                    _gain(r["objective"], other)
                    for other in (r["heuristic_objective"], *_pick(r, "uniform", "time_balanced"))
                ]
                print(
                    f"{label:>7} {f'{n}×{stages}':>7} {seed:>4} {solver:>6} {r['status']:>10} "
                    f"{r['gap']:>8.1e} {r['solve_s']:>7.2f} {r['heuristic_s']:>6.2f} "
                    f"{r['prune_s']:>7.2f} {r['solver_s']:>8.2f} {r['segments']:>8} "
                    f"{r['rows']:>6} " + " ".join(f"{g:>7}" for g in gains),
                    flush=True,
                )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "python": platform.python_version(),
        "pulp": pulp.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "command": "python -m bench.bench_solver" + (" --quick" if args.quick else ""),
        "time_limit_s": limit,
        "note": "solve_s: the whole solve_partition call; heuristic_s and prune_s are the "
        "same phases timed separately; solver_s: HiGHS/CBC through PuLP (model transfer "
        "included). vs X: how much lower the optimum's step time is than X's.",
    }
    out.write_text(json.dumps({"meta": meta, "runs": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
