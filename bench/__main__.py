"""Run the benchmarks: python -m bench SECTION [--quick] (all, or one of ``SECTIONS``).

``all`` runs every section in turn; each writes its own bench/results/*.json,
and this writes bench/results/summary.json (per section: status, wall time,
budget; ``summary-<section>.json`` for one section). A section whose module is
not there yet is skipped with a message; one that fails is recorded and the
others still run. With ``--quick`` each section has a time budget
(``SECTIONS``; ``all`` within ``QUICK_TOTAL_S``) and an overrun is warned
about. Flags this command does not know go to the one section named, e.g.
``python -m bench plan --quick --clusters 8xa100``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Section:
    """One benchmark: its module(s), and the wall-time budget of its --quick run."""

    modules: tuple[str, ...]
    quick_budget_s: float
    what: str


SECTIONS: dict[str, Section] = {
    "plan": Section(("bench.bench_plan",), 240, "plan quality against today's partitioners"),
    "optimality": Section(
        ("bench.bench_optimality",), 600, "the plan against every placement and the released peers"
    ),
    "scaling": Section(
        ("bench.bench_scaling", "bench.bench_solver"), 180, "planning time; the ILP alone"
    ),
    "runtime": Section(("bench.bench_runtime",), 300, "runtime overhead and efficiency"),
    "accuracy": Section(("bench.bench_accuracy",), 420, "predicted against measured"),
    "calibration": Section(
        ("bench.bench_calibration",), 900, "predicted against measured, calibrated, on the zoo"
    ),
    "soak": Section(("bench.soak",), 90, "long runs, restarts"),
    "published": Section(
        ("bench.bench_published",), 120, "published peers' figures beside the planner's"
    ),
    "schedules": Section(
        ("bench.bench_schedules",), 600, "the schedules' search against GPipe/1F1B and torchtitan"
    ),
}
QUICK_TOTAL_S = 30 * 60


@dataclass
class Outcome:
    """What happened to one module of a section."""

    module: str
    status: str  # "ok", "failed" or "skipped"
    wall_s: float = 0.0
    detail: str = ""


@contextlib.contextmanager
def _argv(argv: Sequence[str], program: str) -> Iterator[None]:
    """sys.argv as ``python -m <program> <argv>`` would set it."""
    saved = sys.argv
    sys.argv = [program, *argv]
    try:
        yield
    finally:
        sys.argv = saved


def _missing(exc: ModuleNotFoundError, module: str) -> bool:
    """The module itself is absent (not something it imports)."""
    return exc.name is not None and (module == exc.name or module.startswith(exc.name + "."))


def run_module(module: str, argv: Sequence[str]) -> Outcome:
    """Import ``module`` and call its ``main``: ``main(argv)`` when it takes an
    argument, else ``main()`` with ``sys.argv`` set to the flags."""
    t0 = time.perf_counter()
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if _missing(exc, module):
            return Outcome(module, "skipped", 0.0, f"{module} is not there yet")
        raise
    main = mod.main
    try:
        with _argv(argv, module):  # for a main that reads sys.argv, and for --help's name
            rc = main(list(argv)) if inspect.signature(main).parameters else main()
    except SystemExit as exc:  # argparse errors, or a main that exits
        rc = exc.code
    except Exception as exc:
        traceback.print_exc()
        return Outcome(module, "failed", time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
    wall = time.perf_counter() - t0
    if rc not in (None, 0):
        return Outcome(module, "failed", wall, f"exit status {rc}")
    return Outcome(module, "ok", wall)


def run_section(name: str, argv: Sequence[str]) -> list[Outcome]:
    """Every module of a section, in order."""
    out = []
    for module in SECTIONS[name].modules:
        print(f"\n=== {name}: {module} {' '.join(argv)}".rstrip(), flush=True)
        try:
            outcome = run_module(module, argv)
        except Exception as exc:  # the module failed to import
            traceback.print_exc()
            outcome = Outcome(module, "failed", 0.0, f"{type(exc).__name__}: {exc}")
        if outcome.status == "skipped":
            print(f"skipped: {outcome.detail}", flush=True)
        out.append(outcome)
    return out


def budget_warnings(walls: dict[str, float], quick: bool) -> list[str]:
    """Sections (and the whole run) over their --quick budgets."""
    if not quick:
        return []
    out = [
        f"{name} took {wall:.0f} s, over its --quick budget of {budget:.0f} s"
        for name, wall in walls.items()
        if wall > (budget := SECTIONS[name].quick_budget_s)
    ]
    total = sum(walls.values())
    if len(walls) > 1 and total > QUICK_TOTAL_S:
        out.append(f"all took {total:.0f} s, over the --quick budget of {QUICK_TOTAL_S} s")
    return out


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(our options, the flags for the section)."""
    ap = argparse.ArgumentParser(
        prog="python -m bench", description=(__doc__ or "").splitlines()[0]
    )
    ap.add_argument("section", choices=["all", *SECTIONS])
    ap.add_argument("--quick", action="store_true", help="each section's short version")
    ap.add_argument(
        "--summary",
        help="where to write the summary (default bench/results/summary.json for all, "
        "summary-<section>.json for one)",
    )
    ns, rest = ap.parse_known_args(list(argv))
    if ns.summary is None:
        ns.summary = str(
            RESULTS / ("summary.json" if ns.section == "all" else f"summary-{ns.section}.json")
        )
    if ns.section == "all" and rest:
        ap.error(f"flags for one section only: {' '.join(rest)} (run that section alone)")
    return ns, rest


def main(argv: Sequence[str] | None = None) -> int:
    """Run the named section(s); 0 when none failed."""
    ns, rest = parse(sys.argv[1:] if argv is None else argv)
    names = list(SECTIONS) if ns.section == "all" else [ns.section]
    flags = (["--quick"] if ns.quick else []) + rest
    t0 = time.perf_counter()
    outcomes: dict[str, list[Outcome]] = {}
    walls: dict[str, float] = {}
    for name in names:
        start = time.perf_counter()
        outcomes[name] = run_section(name, flags)
        walls[name] = time.perf_counter() - start
        print(f"=== {name}: {walls[name]:.0f} s", flush=True)
    warnings = budget_warnings(walls, ns.quick)
    print("\nsummary" + (" (--quick)" if ns.quick else ""))
    for name in names:
        budget = f" (budget {SECTIONS[name].quick_budget_s:.0f} s)" if ns.quick else ""
        for o in outcomes[name]:
            detail = f": {o.detail}" if o.detail else ""
            print(f"  {name:9s} {o.module:22s} {o.status:8s} {o.wall_s:7.0f} s{detail}")
        print(f"  {name:9s} {'(section)':22s} {'':8s} {walls[name]:7.0f} s{budget}")
    total = time.perf_counter() - t0
    print(f"  total {total:.0f} s")
    for w in warnings:
        print(f"budget warning: {w}")
    failed = [o for outs in outcomes.values() for o in outs if o.status == "failed"]
    record: dict[str, Any] = {
        "command": "python -m bench " + " ".join([ns.section, *flags]),
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_avg_after": os.getloadavg(),
        "total_s": total,
        "sections": {
            name: {
                "wall_s": walls[name],
                "quick_budget_s": SECTIONS[name].quick_budget_s,
                "modules": [o.__dict__ for o in outcomes[name]],
            }
            for name in names
        },
        "budget_warnings": warnings,
    }
    path = Path(ns.summary)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
