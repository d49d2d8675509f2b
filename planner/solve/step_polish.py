"""Local search over placements: move split points while the step improves.

The step solver's search for a good placement where proving is costly (shared
cores) or to seed its proofs: from the best placements evaluated so far, and
from seeded random ones, one split point at a time is moved to its best
position between its neighbours, then neighbouring pairs are shifted together,
sweep after sweep while the step improves. Every budget is a count of
evaluations (and a clock), so the same inputs give the same placement.

Pure: numbers and callables in.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

from planner.solve.step_table import StepTable

__all__ = ["POLISH_SEEDS", "polish"]

POLISH_SEEDS = 2
"""The best placements evaluated so far that the descent starts from."""


def polish(
    t: StepTable,
    steps: dict[tuple[int, ...], float],
    offer: Callable[[list[int]], float],
    budget: list[int],
    stop: float,
    restarts: int = 0,
) -> None:
    """From each of the ``POLISH_SEEDS`` best placements of ``steps`` (index form ->
    step, every one evaluated so far), and from ``restarts`` random ones (seeded by the
    problem's size: the same each time), move one split point at a time to its best
    position between its neighbours (every one is tried: the step of a shared-core
    machine has valleys a step of a few blocks does not cross), sweep after sweep while
    the step improves. ``offer`` evaluates a placement (and records it in ``steps``);
    ``budget[0]``, the evaluations left, is spent; the clock stops it at ``stop``."""
    for seed in sorted(steps, key=steps.__getitem__)[:POLISH_SEEDS]:
        _sweep(t, steps, offer, list(seed), budget, stop)
    rng = random.Random(t.K * 1009 + t.S)
    K, S = t.K, t.S
    for _ in range(restarts):
        idx = [0, *sorted(rng.sample(range(1, K), S - 1)), K]
        if t.fits_all(idx) and budget[0] > 0:
            if tuple(idx) not in steps:
                budget[0] -= 1
                offer(idx)
            _sweep(t, steps, offer, idx, budget, stop)


def _sweep(
    t: StepTable,
    steps: dict[tuple[int, ...], float],
    offer: Callable[[list[int]], float],
    cur: list[int],
    budget: list[int],
    stop: float,
) -> None:
    """Line searches of one split point, then shifts of neighbouring pairs (a ridge
    that moving one at a time cannot follow), until neither improves."""
    here = steps[tuple(cur)]
    improved = True
    while improved:
        improved = False
        for idx in _moves(t.S, cur):
            if budget[0] <= 0 or time.perf_counter() > stop:
                return
            step = steps.get(tuple(idx))
            if step is None:
                if not t.fits_all(idx):
                    continue
                budget[0] -= 1
                step = offer(idx)
            if step < here * (1 - 1e-12):
                cur, here, improved = idx, step, True
                break


def _moves(S: int, cur: list[int]) -> Iterator[list[int]]:
    for k in range(1, S):
        for a in range(cur[k - 1] + 1, cur[k + 1]):
            if a != cur[k]:
                yield [*cur[:k], a, *cur[k + 1 :]]
    for k in range(1, S - 1):
        for d in (-2, -1, 1, 2):
            idx = [*cur[:k], cur[k] + d, cur[k + 1] + d, *cur[k + 2 :]]
            if idx[k - 1] < idx[k] < idx[k + 1] < idx[k + 2]:
                yield idx
