"""What the benchmarks share: plain-text tables and the results files."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["config_text", "cpu_figures", "knobs", "merged", "plan_layout", "table", "write_json"]


def config_text(layout: Any) -> str:
    """A Layout's or a Plan's configuration in words: "pp 4 × dp 2, m 8, 1f1b", with
    ", v 2" after it when it has several stages per rank, ", ZeRO-1" when its replicas
    share the optimizer state out, ", FSDP" when they shard the weights too."""
    from planner.plan.sections import dp_mode_suffix

    text = f"pp {layout.pp} × dp {layout.dp}, m {layout.micro_batches}, {layout.schedule}"
    text += f", v {layout.virtual}" if layout.virtual > 1 else ""
    return text + dp_mode_suffix(layout.dp_mode)


def plan_layout(plan: Any) -> Any:
    """The Layout (pp, dp, m, schedule, ranks, stages per rank, dp mode) a plan trains with."""
    from planner.cost import Layout

    return Layout(
        pp=plan.pp,
        dp=plan.dp,
        micro_batches=plan.micro_batches,
        schedule=plan.schedule,
        ranks=tuple(tuple(s.ranks) for s in plan.stages),
        virtual=plan.virtual,
        dp_mode=plan.dp_mode,
    )


def cpu_figures() -> dict[str, dict[str, float]]:
    """This machine's CPU as the planner measures it now, at 1 thread and at every core
    (per thread count: memory and in-cache bandwidth GB/s, µs per op, fp32 GFLOP/s), in a
    cache of its own (the planner's may hold another day's figures). A shared host moves
    from day to day (half the memory bandwidth on 2026-12-07 against the day before), so a
    results file says what it ran on."""
    import tempfile

    import torch

    from planner.devices.local import forget_measurements, local_cpu

    before = torch.get_num_threads()
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp, knobs({"PLANNER_CACHE_DIR": tmp}):
        for threads in sorted({1, os.cpu_count() or 1}):
            torch.set_num_threads(threads)
            forget_measurements()
            cpu = local_cpu()
            out[str(threads)] = {
                "memory_gb_s": round(cpu.memory_bandwidth / 1e9, 2),
                "cache_gb_s": round(cpu.cache_bandwidth / 1e9, 2),
                "op_us": round(cpu.op_overhead_s * 1e6, 3),
                "fp32_gflop_s": round(cpu.flops_per_s("fp32") / 1e9, 1),
            }
        forget_measurements()
    torch.set_num_threads(before)
    return out


@contextlib.contextmanager
def knobs(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables (the examples' knobs) for the duration."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def table(title: str, head: list[str], rows: list[list[Any]]) -> None:
    """Print ``rows`` under ``head``, right-aligned, after a blank line and ``title``."""
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(head)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def _fmt(c: Any) -> str:
    if isinstance(c, float):
        if c != c:
            return "—"
        return f"{c:.3g}" if abs(c) < 10 else f"{c:.1f}"
    return str(c)


def write_json(path: str | Path, data: Any) -> Path:
    """Write a results file (its folder made as needed); values JSON lacks become strings."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    """What a record measures: one record per key survives a merge."""
    what = row.get("model", row.get("command", row.get("blocks")))
    return (what, row.get("devices"), row.get("solver"), row.get("cache"))


def merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` over ``old``: rows of "search" and "end_to_end" merged by ``_key``.

    Example::

        merged({"search": [a16]}, {"search": [a16_again, b64]})["search"]  # [a16_again, b64]
    """
    out = {**old, **{k: v for k, v in new.items() if k not in ("search", "end_to_end")}}
    for section in ("search", "end_to_end"):
        rows = {_key(r): r for r in old.get(section, [])}
        rows.update({_key(r): r for r in new.get(section, [])})
        out[section] = list(rows.values())
    return out
