"""pp = 1 against the hand-written DDP script: python -m bench.bench_pp1 [--quick].

A plan with one stage runs the model itself under DDP with gradient
accumulation (``runtime.accumulate``); the goal is ≤ 1.02× the script a user
would write (DDP, ``no_sync`` for the first m − 1 micro-batches, loss ÷ m,
SGD). Both run alternating in the same two gloo processes on this machine
(``bench_runtime``'s overhead study, its pp = 1 cases only: quiet rounds,
medians, the load recorded). Writes bench/results/pp1.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import write_json
from bench.bench_runtime import GPT, STACK, overhead

OUT = Path(__file__).resolve().parent / "results" / "pp1.json"

CASES: dict[str, tuple[dict[str, Any], int, int]] = {  # name: (model, batch, m)
    "stack-pp1dp2-m2": (STACK, 256, 2),
    "stack-pp1dp2-m1": (STACK, 256, 1),
    "gpt-pp1dp2-m4": (GPT, 16, 4),
}


def _plans() -> dict[str, Any]:
    from bench import _runtime_workers as w
    from planner.devices import from_gpus
    from planner.options import PlanOptions, SearchOptions, Training
    from planner.planning import plan_model

    out = {}
    for name, (spec, batch, m) in CASES.items():
        x, y = w.batch(spec, batch)
        out[name] = plan_model(
            w.build(spec),
            (x, y),
            cluster=from_gpus(2, "h100"),  # analytic: only the layout matters here
            loss_fn=w.loss_fn_for(spec),
            options=PlanOptions(
                training=Training(global_batch=batch, optimizer="sgd"),
                search=SearchOptions(pp=1, dp=2, micro_batches=m, schedule="gpipe"),
            ),
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-pp1-cache-") as cache:
        os.environ["PLANNER_CACHE_DIR"] = cache
        plans = _plans()
        res = overhead(plans, args.quick, names=tuple(CASES))
    goal = {n: res[n]["ratio_of_medians"] <= 1.02 for n in CASES}
    print(
        "goal ≤ 1.02× the hand-written DDP script: "
        + ", ".join(
            f"{n} {res[n]['ratio_of_medians']:.3f} ({'met' if ok else 'missed'})"
            for n, ok in goal.items()
        )
    )
    write_json(
        args.out,
        {
            "command": "python -m bench.bench_pp1" + (" --quick" if args.quick else ""),
            "wall_s": time.perf_counter() - t0,
            "goal_met": goal,
            "overhead": res,
        },
    )
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
