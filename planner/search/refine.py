"""Polishing a solved placement against the simulated step.

[Note: refining by simulation] The ILP minimises the closed form; the
simulated schedule is the prediction. They agree for GPipe up to the
forward/backward bottleneck split and only approximately for 1F1B, so the best
few placements are polished against the simulation: the ILP's placement and
the usual heuristics' placements as seeds, then moves of one split point by
one or two blocks while the simulated step improves and every stage fits.

Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.cost.model import CostModel, Prediction
from planner.search import baselines

__all__ = ["REFINE_BUDGET", "REFINE_TOP", "Refined", "refine"]

REFINE_TOP = 4
"""Configurations polished by simulation."""
REFINE_BUDGET = 120
"""Simulations per configuration."""


@dataclass(frozen=True)
class Refined:
    """A placement after polishing: its starts, its prediction, and what changed (or "")."""

    starts: tuple[int, ...]
    prediction: Prediction
    note: str


def refine(
    cost: CostModel, starts: tuple[int, ...], prediction: Prediction, allowed: frozenset[int] | None
) -> Refined:
    """The best placement found around ``starts`` (see [Note: refining by simulation])."""
    n, pp = cost.n_blocks, cost.layout.pp
    if pp == 1:
        return Refined(starts, prediction, "")
    legal = set(allowed) if allowed is not None else set(range(1, n))
    best_starts, best = starts, prediction
    budget = REFINE_BUDGET
    for seed in _seeds(cost, starts, allowed):
        pred = cost.predict(seed)
        budget -= 1
        if pred.fits and pred.step_ms < best.step_ms:
            best_starts, best = seed, pred
    improved = True
    while improved and budget > 0:
        improved = False
        for k in range(1, pp):
            lo = best_starts[k - 1] + 1
            hi = best_starts[k + 1] - 1 if k + 1 < pp else n - 1
            for delta in (-1, 1, -2, 2):
                j = best_starts[k] + delta
                if not lo <= j <= hi or j not in legal or budget <= 0:
                    continue
                trial = (*best_starts[:k], j, *best_starts[k + 1 :])
                pred = cost.predict(trial)
                budget -= 1
                if pred.fits and pred.step_ms < best.step_ms * (1 - 1e-9):
                    best_starts, best, improved = trial, pred, True
                    break
    if best_starts == starts:
        return Refined(starts, prediction, "")
    gain = 1 - best.step_ms / prediction.step_ms
    note = f"the ILP's placement refined by simulation: −{gain:.2%} step time"
    return Refined(best_starts, best, note)


def _seeds(
    cost: CostModel, starts: tuple[int, ...], allowed: frozenset[int] | None
) -> list[tuple[int, ...]]:
    """The usual heuristics' placements (other than ``starts``), to try first."""
    n, pp = cost.n_blocks, cost.layout.pp
    blocks = cost.profile.blocks
    seeds: list[tuple[int, ...]] = []
    for seed in (
        baselines.uniform(n, pp, allowed),
        baselines.parameter_balanced([b.param_bytes for b in blocks], pp, allowed),
        baselines.time_balanced([b.fwd_ms + b.bwd_ms for b in blocks], pp, allowed),
    ):
        if len(seed) == pp and seed != starts and seed not in seeds:
            seeds.append(tuple(seed))
    return seeds
