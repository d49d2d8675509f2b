"""The step solver's budgets (:func:`planner.solve.step.solve_step`): counted work, so the
same inputs give the same plan, the time limit aside; and how large a MILP is worth building.
"""

from __future__ import annotations

__all__ = [
    "BOUND_NODES",
    "ENUMERATE_MAX",
    "ENUMERATE_WORK",
    "GAP_ROUNDS",
    "MILP_SIZE_PER_S",
    "POLISH_BUDGET",
    "PROVE_POLISH",
    "PROVE_WORK",
    "RESTARTS",
    "ROUND_SEGMENTS",
    "TIGHTEN_ROUNDS",
]

ENUMERATE_MAX = 48
"""Placements at most that are evaluated one by one instead of solving the MILP (exact problems)."""
ENUMERATE_WORK = 100_000
"""Work at most spent on enumerating a bounded problem's placements, counted as each
placement's graph nodes + 16 (a simulation costs about 0.3 ms + 20 µs a node on a shared
2-core machine: about 2 s). Counted, not timed: the same inputs give the same plan."""
POLISH_BUDGET = 400
"""Evaluations at most spent on moving split points (bounded problems; 6 per block if more)."""
PROVE_WORK = 1_000_000
"""``ENUMERATE_WORK`` of a bounded problem solved with ``prove=True`` (the configuration a
plan keeps): about 10 to 20 s, which proves a 50-block chain on 4 stages optimal outright.
Its graph bounds rank its placements too poorly to stop early (a ResNet's best was the
15 200th of 18 834)."""
PROVE_POLISH = 4
"""How many times the budget the configuration a plan keeps is polished with."""
TIGHTEN_ROUNDS = 4  # placements at the segment bounds' bottleneck evaluated, at most
RESTARTS = 8
"""Random placements the kept configuration is also polished from."""
BOUND_NODES = 400
"""Branch-and-bound nodes at most of a bounded problem's MILP: its job is a bound (valid
wherever the search stops) and a placement to polish, not a proof (HiGHS; a count, so
the same inputs stop at the same place). A 24-layer GPT on 4 stages of shared cores took
6 s per solve without it."""
MILP_SIZE_PER_S = 1_000_000
"""Candidate stages × graph nodes of an exact problem's step MILP that a second of the
time left must cover for it to be built; otherwise the segment bounds' gap stands
(status "bounded", method "bounds"). HiGHS on bench scaling's synthetic chains, 60 s per
solve: Llama 70B's step MILPs on 1024 H100s (307 × 16 320 = 5.0·10⁶) proven in a search of
22 s; 256 blocks on 256 H100s, 1F1B (1 559 × 8 096 = 1.3·10⁷) moved its gap from 1.2 to
0.6 % in 59 s; GPipe (7 572 × 8 096 = 6.1·10⁷) and 512 on 512 (up to 1.2·10⁵ × 16 320 =
2.0·10⁹) found no bound above the segment bounds' in 59 s, the largest not even a root
bound. So a MILP is built up to about the size that a minute of HiGHS moved."""
GAP_ROUNDS = 3
"""MILP solves at most spent raising a bounded problem's bound (no-good rows), after the first."""
ROUND_SEGMENTS = 10_000
"""Candidate stages at most of a MILP that gets no-good rounds: each round excludes one
placement, and one of a 148-block chain on 8 stages (49 319 candidate stages, 10^11
placements) cost about 10 s."""
