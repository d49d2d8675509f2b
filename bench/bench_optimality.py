"""Is the plan's placement the fastest there is? python -m bench.bench_optimality [--quick]

For every example (gpt, a 24-layer gpt, mlp, resnet, unet) × cluster (8 local
CPU processes, measured; 8 × H100; 2 × 8 H100; 4 A100 + 4 V100) × ``--pp``
2, 4, 8: ``planner plan`` (the rest searched, default sizes and batch), then,
at the plan's own configuration (pp, dp, m, schedule, ranks) and priced by the
plan's own cost model (``CostModel.predict``, the number the plan prints):

* **best found**: every contiguous placement when there are at most
  ``EXHAUSTIVE`` of them; else the best of an independent search (descent
  over split-point moves of 1, 2, 4 and 8 blocks from random placements and
  from the peers' placements);
* **each peer**, its released code where the package is installed
  (``pip install -e '.[peers]'``), else the in-tree replica, marked so:
  DeepSpeed 0.19.8 ``partition_balanced`` on the blocks' parameter counts
  (``partition_method="parameters"``); torchgpipe 0.0.7's balance by time
  (``blockpartition.solve`` on each block's forward + backward); torchtitan
  0.3.0's default LLM split (GPT only: equal layers per stage, embedding and
  head weighing one layer each).

Ratio = other / ours: ≥ 1 means ours is at least as fast. Also recorded: the
plan's solver status, bound and gap, and per peer whether its placement came
from the released package or the replica (``source``). Writes
bench/results/optimality.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import math
import platform
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench._common import knobs, plan_layout, table, write_json
from bench.bench_plan import cost_models

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "optimality.json"
EXAMPLES: dict[str, tuple[str, dict[str, str]]] = {
    "gpt": ("gpt", {}),
    "gpt24": ("gpt", {"GPT_LAYERS": "24"}),
    "mlp": ("mlp", {}),
    "resnet": ("resnet", {}),
    "unet": ("unet", {}),
}
CLUSTERS = ("8xcpu", "8xh100", "2x8xh100", "mixed-a100-v100")
PEERS = ("deepspeed", "torchgpipe", "torchtitan")
EXHAUSTIVE = 20_000
"""Placements at most priced one by one for "best found"; above, the independent search."""
STARTS = 24
"""Random starting placements of the independent search."""


def cluster_flags(name: str) -> list[str]:
    """``planner plan``'s flags for the cluster."""
    if name == "8xcpu":
        return ["--gpus", "8"]
    if name == "8xh100":
        return ["--gpus", "8", "--device-type", "h100"]
    return ["--cluster", str(ROOT / "examples" / "clusters" / f"{name}.yaml")]


def planned(example: str, cluster_name: str, pp: int, out: Path) -> tuple[Any, float]:
    """``planner plan examples/<file>.py <cluster> --pp <pp>``, as a user runs it."""
    from planner.cli import main as planner
    from planner.plan import load_plan

    file, env = EXAMPLES[example]
    argv = ["plan", str(ROOT / "examples" / f"{file}.py"), *cluster_flags(cluster_name)]
    argv += ["--pp", str(pp), "--out", str(out)]
    t0 = time.perf_counter()
    with knobs(env), contextlib.redirect_stdout(io.StringIO()):
        code = planner(argv)
    if code != 0:
        raise RuntimeError(f"planner {' '.join(argv)} exited {code}")
    return load_plan(out), time.perf_counter() - t0


# --------------------------------------------------------------------------- the peers


def _deepspeed(params: list[float], pp: int) -> tuple[tuple[int, ...], str]:
    try:
        from deepspeed.runtime.utils import partition_balanced
    except ImportError:
        from planner.search.baselines import deepspeed_balanced

        return deepspeed_balanced(params, pp), "replica"
    parts = [int(x) for x in partition_balanced(params, pp)]
    return tuple(parts[:-1]), "released"


def _torchgpipe(times: list[float], pp: int) -> tuple[tuple[int, ...], str]:
    try:
        from torchgpipe.balance.blockpartition import solve
    except ImportError:
        from planner.search.baselines import time_balanced

        return time_balanced(times, pp), "replica"
    starts, at = [0], 0
    for part in solve(times, partitions=pp)[:-1]:
        at += len(part)
        starts.append(at)
    return tuple(starts), "released"


def _torchtitan(modules: list[tuple[str, ...]], pp: int) -> tuple[tuple[int, ...] | None, str]:
    """torchtitan's stages of layers mapped to the chain: stage k starts at the first block
    of its first layer (``blocks.L``). None: not a GPT chain, or too few layers."""
    layer_of = []
    for mods in modules:
        names = [m.split(".") for m in mods]
        layer_of.append(next((int(p[1]) for p in names if p[0] == "blocks" and len(p) > 1), None))
    layers = sorted({x for x in layer_of if x is not None})
    if not layers:
        return None, "n/a (no transformer layers)"
    try:
        from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

        per_stage, source = _generate_llm_fqn_per_model_part(pp, len(layers), 1, 1), "released"
    except ImportError:
        return None, "n/a (torchtitan not installed)"
    except ValueError as exc:
        return None, f"n/a ({exc})"
    starts = [0]
    for stage in per_stage[1:]:
        first = next((int(n.split(".")[1]) for n in stage if n.startswith("layers.")), None)
        if first is None:
            return None, "n/a (a stage without layers)"
        starts.append(layer_of.index(first))
    if any(a >= b for a, b in itertools.pairwise(starts)):
        return None, "n/a (stages collapse on this chain)"
    return tuple(starts), source


# --------------------------------------------------------------------------- best found


def _priced(cost: Any) -> Callable[[tuple[int, ...]], float]:
    memo: dict[tuple[int, ...], float] = {}

    def price(starts: tuple[int, ...]) -> float:
        if starts not in memo:
            pred = cost.predict(starts)
            memo[starts] = pred.step_ms if pred.fits else math.inf
        return memo[starts]

    price.memo = memo  # type: ignore[attr-defined]
    return price


def best_found(cost: Any, seeds: Sequence[tuple[int, ...]], quick: bool) -> dict[str, Any]:
    """The fastest placement found independently of the planner's solver."""
    n, pp = cost.n_blocks, cost.layout.pp
    price = _priced(cost)
    count = math.comb(n - 1, pp - 1)
    limit = EXHAUSTIVE // (4 if quick else 1)
    if count <= limit:
        best = min(((0, *c) for c in itertools.combinations(range(1, n), pp - 1)), key=price)
        return {"method": f"exhaustive ({count})", "starts": best, "step_ms": price(best)}
    rng = random.Random(0)
    starts = [tuple(s) for s in seeds] + [
        (0, *sorted(rng.sample(range(1, n), pp - 1))) for _ in range(STARTS // (3 if quick else 1))
    ]
    best = min(starts, key=price)
    for s in starts:
        got = _descend(s, price, n)
        if price(got) < price(best):
            best = got
    evals = len(price.memo)  # type: ignore[attr-defined]
    return {"method": f"search ({evals} placements)", "starts": best, "step_ms": price(best)}


def _descend(
    starts: tuple[int, ...], price: Callable[[tuple[int, ...]], float], n: int
) -> tuple[int, ...]:
    """Move one split point by ±1, 2, 4 or 8 blocks while the step improves."""
    cur, pp = starts, len(starts)
    improved = True
    while improved:
        improved = False
        for k in range(1, pp):
            hi = cur[k + 1] if k + 1 < pp else n
            for d in (-8, -4, -2, -1, 1, 2, 4, 8):
                j = cur[k] + d
                if cur[k - 1] < j < hi:
                    trial = (*cur[:k], j, *cur[k + 1 :])
                    if price(trial) < price(cur):
                        cur, improved = trial, True
    return cur


# --------------------------------------------------------------------------- one row


def row(example: str, cluster_name: str, pp: int, quick: bool, workdir: Path) -> dict[str, Any]:
    from planner.devices.cluster_file import from_record
    from planner.options import Training

    plan, plan_s = planned(
        example, cluster_name, pp, workdir / f"{example}-{cluster_name}-{pp}.yaml"
    )
    cluster = from_record(plan.cluster)
    training = Training(
        global_batch=plan.global_batch, optimizer=plan.optimizer, precision=plan.precision
    )
    cost = cost_models(plan, cluster, training)(plan_layout(plan))
    ours_ms = plan.predicted.step_ms
    ours = tuple(s.blocks[0] for s in plan.stages)
    repriced = cost.predict(ours).step_ms  # this bench's own check: the plan's cost model
    if abs(repriced - ours_ms) > 1e-9 * ours_ms:
        raise RuntimeError(f"the plan's placement reprices at {repriced} ms, not {ours_ms}")
    blocks = cost.profile.blocks
    peers: dict[str, Any] = {}
    seeds = []
    for name, (starts, source) in (
        ("deepspeed", _deepspeed([float(b.param_bytes) for b in blocks], pp)),
        ("torchgpipe", _torchgpipe([b.fwd_ms + b.bwd_ms for b in blocks], pp)),
        ("torchtitan", _torchtitan([b.modules for b in blocks], pp)),
    ):
        if starts is None:
            peers[name] = {"source": source, "starts": None, "step_ms": None, "ratio": None}
            continue
        pred = cost.predict(starts)
        step = pred.step_ms if pred.fits else None
        peers[name] = {
            "source": source,
            "starts": list(starts),
            "step_ms": step,
            "ratio": None if step is None else step / ours_ms,
        }
        seeds.append(starts)
    t0 = time.perf_counter()
    found = best_found(cost, seeds, quick)
    sv = plan.solver
    return {
        "example": example,
        "cluster": cluster_name,
        "pp": pp,
        "blocks": len(blocks),
        "config": f"pp {plan.pp} × dp {plan.dp}, m {plan.micro_batches}, {plan.schedule}",
        "ours": {"starts": list(ours), "step_ms": ours_ms, "plan_s": plan_s},
        "solver": {
            "status": sv.status,
            "method": sv.method,
            "bound_ms": sv.bound_ms,
            "gap": sv.gap,
        },
        "best_found": {
            **found,
            "starts": list(found["starts"]),
            "ratio": found["step_ms"] / ours_ms,
        },
        "peers": peers,
        "search_s": time.perf_counter() - t0,
    }


def _cell(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.4f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="gpt and mlp only, a smaller independent search"
    )
    ap.add_argument("--examples", nargs="+", choices=list(EXAMPLES), default=None)
    ap.add_argument("--clusters", nargs="+", choices=CLUSTERS, default=list(CLUSTERS))
    ap.add_argument("--pp", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--out", default=str(OUT))
    ns = ap.parse_args(argv)
    if ns.examples is None:
        ns.examples = ["gpt", "mlp"] if ns.quick else list(EXAMPLES)
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    workdir = Path(tempfile.mkdtemp(prefix="bench-optimality-"))
    for cluster in ns.clusters:
        for example in ns.examples:
            for pp in ns.pp:
                try:
                    r = row(example, cluster, pp, ns.quick, workdir)
                except Exception as exc:  # a row that fails is recorded, the rest still run
                    traceback.print_exc()
                    r = {"example": example, "cluster": cluster, "pp": pp, "error": repr(exc)}
                rows.append(r)
                if "error" not in r:
                    peers = " ".join(f"{k} {_cell(v['ratio'])}" for k, v in r["peers"].items())
                    print(
                        f"{cluster:16s} {example:6s} pp {pp}: ours {r['ours']['step_ms']:.4f} ms "
                        f"({r['config']}, {r['solver']['status']}); best found "
                        f"{_cell(r['best_found']['ratio'])} [{r['best_found']['method']}]; {peers}",
                        flush=True,
                    )
    ok = [r for r in rows if "error" not in r]
    beaten = [r for r in ok if r["best_found"]["ratio"] < 1 - 1e-9]
    peer_wins = [
        (r, k)
        for r in ok
        for k, v in r["peers"].items()
        if v["ratio"] is not None and v["ratio"] < 1 - 1e-9
    ]
    table(
        "ours vs best found vs the peers (other / ours; ≥ 1: ours at least as fast)",
        ["cluster", "example", "pp", "config", "solver", "best found", *PEERS],
        [
            [
                r["cluster"],
                r["example"],
                r["pp"],
                r["config"],
                f"{r['solver']['status']} (gap {r['solver']['gap']:.1%})",
                _cell(r["best_found"]["ratio"]),
                *(_cell(r["peers"][k]["ratio"]) for k in PEERS),
            ]
            for r in ok
        ],
    )
    print(
        f"{len(ok)} rows ({len(rows) - len(ok)} failed): beaten by the independent search in "
        f"{len(beaten)}, by a peer in {len(peer_wins)}"
    )
    record = {
        "command": " ".join(
            ["python -m bench.bench_optimality", *(sys.argv[1:] if argv is None else argv)]
        ),
        "machine": {"python": platform.python_version(), "processor": platform.processor()},
        "rows": rows,
        "beaten_by_search": len(beaten),
        "beaten_by_peers": len(peer_wins),
        "wall_s": time.perf_counter() - t_start,
    }
    write_json(ns.out, record)
    print(f"wrote {ns.out} in {record['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
