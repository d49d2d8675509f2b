"""The candidates a plan records: every configuration tried, ranked, with why each lost.

Pure: no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from planner.cost.basis import Layout
from planner.plan.sections import Candidate
from planner.search.configurations import Config

__all__ = ["candidate", "ranked"]


def candidate(cfg: Config, step_ms: float | None, status: str, reason: str) -> Candidate:
    """The record of configuration ``cfg``: its step (None when not solved), status, reason."""
    return Candidate(
        pp=cfg.pp,
        dp=cfg.dp,
        micro_batches=cfg.m,
        schedule=cfg.schedule,
        virtual=cfg.virtual,
        dp_mode=cfg.dp_mode,
        step_ms=step_ms,
        status=status,
        reason=(f"{cfg.layout_name}: {reason}" if reason else cfg.layout_name),
    )


def ranked(
    tried: Sequence[Candidate],
    best: Layout,
    best_ms: float,
    keep: int,
    *,
    single: bool = False,
    fastest_ms: float | None = None,
    band_pct: float = 0.0,
    why: str | None = None,
) -> list[Candidate]:
    """The ``keep`` candidates the plan records, the solved ones fastest first.

    The chosen one (``best``, at ``best_ms``) is marked "chosen", the other solved
    ones "slower" or "faster" with how much; room is kept for one that ran out of
    memory and one that was pruned, so the table shows why they lost; then
    whatever is left fills up.

    ``fastest_ms``, ``band_pct``, ``why``: when a sturdier configuration was chosen
    over the fastest ([Note: robust band] in :mod:`planner.search.robust`), the
    fastest step, the band, and the chosen row's reason; the rows within the band
    of the fastest say so.

    ``single`` (local CPU processes, [Note: fewer CPU processes]): the best
    one-process candidate (pp 1 × dp 1) is kept too, and a chosen plan on more
    processes says how much faster than it it is predicted.
    """
    solved = sorted(
        (c for c in tried if c.step_ms is not None), key=lambda c: (c.step_ms, c.pp, c.dp)
    )
    one = _one_process(tried) if single else None
    config = (best.pp, best.dp, best.micro_batches, best.schedule, best.virtual, best.dp_mode)
    ceiling = (best_ms if fastest_ms is None else fastest_ms) * (1 + band_pct / 100)
    out: list[Candidate] = []
    chosen = False
    for c in solved:
        assert c.step_ms is not None
        same = (c.pp, c.dp, c.micro_batches, c.schedule, c.virtual, c.dp_mode) == config
        if not chosen and c.step_ms == best_ms and same:
            text = why or "fastest predicted step"
            if one is not None and c is not one and one.step_ms is not None:
                text += f", {one.step_ms / best_ms:.2f}× one process's {one.step_ms:.1f} ms"
            elif one is not None and c is not one:
                text += f", one process {one.status}: {one.reason}"
            out.append(_with(c, "chosen", f"{c.reason}: {text}"))
            chosen = True
            continue
        d = (c.step_ms - best_ms) / best_ms
        band = ""
        if band_pct > 0 and c.step_ms <= ceiling and not same:
            band = f", within the ±{band_pct:g} % band of the fastest; less sturdy, or slower"
        status = "faster" if d < 0 else "slower"
        out.append(_with(c, status, f"{c.reason}: {c.step_ms:.1f} ms, {d:+.1%}{band}"))
    others = [c for c in tried if c.step_ms is None]
    oom = [c for c in others if c.status == "out_of_memory"]
    rest = [c for c in others if c.status != "out_of_memory"]
    head = out[: max(keep - 2, 1)]
    tail = out[len(head) :] + oom[1:] + rest[1:]
    kept = (head + oom[:1] + rest[:1] + tail)[:keep]
    if one is not None and not any(_same(k, one) for k in kept):
        row = next((k for k in out if _same(k, one)), one)  # its ranked form when solved
        kept = [*kept[: max(keep - 1, 1)], row]
    # Shown ranked: the solved ones fastest first, then the rest in the order kept.
    return [c for c in kept if c.step_ms is not None] + [c for c in kept if c.step_ms is None]


def _one_process(tried: Sequence[Candidate]) -> Candidate | None:
    """The best candidate on one process (pp 1 × dp 1): the fastest solved one, else the
    first tried (the search visits them best bound first)."""
    ones = [c for c in tried if c.pp == 1 and c.dp == 1]
    timed = [c for c in ones if c.step_ms is not None]
    if timed:
        return min(timed, key=lambda c: c.step_ms or 0.0)
    return ones[0] if ones else None


def _same(a: Candidate, b: Candidate) -> bool:
    """The same configuration and layout (``reason`` starts with the layout's name)."""
    return (a.pp, a.dp, a.micro_batches, a.schedule, a.virtual, a.dp_mode, a.step_ms) == (
        b.pp,
        b.dp,
        b.micro_batches,
        b.schedule,
        b.virtual,
        b.dp_mode,
        b.step_ms,
    ) and a.reason.startswith(b.reason.split(":")[0])


def _with(c: Candidate, status: str, reason: str) -> Candidate:
    return dataclasses.replace(c, status=status, reason=reason)
