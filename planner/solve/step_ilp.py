"""The step MILP: the placement's segments as binaries, the step's graph as longest-path rows.

[Note: the step MILP] One binary ``x[s,a,b]`` per surviving segment, chained
as a path from block 0 to block n (the flow rows of :mod:`planner.solve`).
Each figure q of stage s is a continuous ``F[s,q] = Σ x[s,a,b]·fig(s,a,b)_q``,
each link figure ``C[s,q] = Σ x[s,a,b]·cut(s,b)_q``. Every node v of the
step's graph has a start ``t_v ≥ 0`` and an end ``e_v = t_v + Σ terms``::

    minimise    T
    subject to  t_v ≥ e_u                 for every edge u → v
                T ≥ e_v                   for every end node v
                T ≥ Σ row terms           for every further row
                T ≥ Σ_{a,b} x[s,a,b]·bound(s,a,b)    for every stage s

At a fixed placement the smallest feasible T is the graph's longest path:
the MILP minimises the step itself, not a formula for it. (Stages sharing a tied
tensor need no rows of their own: every tail already waits for every stage's last
backward, [Note: the step's agreement] in planner.cost.agreement.)
"""

from __future__ import annotations

from collections.abc import Sequence

import pulp

from planner.solve.ilp import MIP_REL_GAP, Outcome, chosen_path
from planner.solve.step_table import Layers, StepTable

__all__ = ["build_step_ilp", "chosen", "milp_bound"]

_X = dict[tuple[int, int, int], pulp.LpVariable]


def build_step_ilp(
    t: StepTable, layers: Layers, start: Sequence[int] | None, ceiling: float | None = None
) -> tuple[pulp.LpProblem, _X]:
    """The MILP of [Note: the step MILP] over ``layers``, with ``start`` as initial values.

    ``ceiling``: only placements whose step is at most this (the MILP is
    infeasible when there is none: a proof that is cheaper than the optimum's).
    """
    p, S = t.p, t.S
    prob = pulp.LpProblem("step", pulp.LpMinimize)
    new = getattr(prob, "add_variable", pulp.LpVariable)  # PuLP ≥ 3.3 owns its variables
    x: _X = {(s, a, b): new(f"x_{s}_{a}_{b}", cat=pulp.LpBinary) for s, a, b in _segments(layers)}
    _flow(prob, layers, x, t.K)
    used_seg = {(i, q) for node in p.nodes for i, q, _ in node.seg} | {
        (i, q) for row in p.rows for i, q, _ in row.seg
    }
    used_cut = {(i, q) for node in p.nodes for i, q, _ in node.cut} | {
        (i, q) for row in p.rows for i, q, _ in row.cut
    }
    F = {(s, q): new(f"F_{s}_{q}", lowBound=0) for s, q in sorted(used_seg)}
    C = {(s, q): new(f"C_{s}_{q}", lowBound=0) for s, q in sorted(used_cut)}
    by_stage: list[list[tuple[int, int, pulp.LpVariable]]] = [[] for _ in range(S)]
    for (s, a, b), v in x.items():
        by_stage[s].append((a, b, v))
    for (s, q), var in F.items():
        terms = [(v, t.fig(s, a, b)[q]) for a, b, v in by_stage[s]]
        prob += pulp.LpAffineExpression([*terms, (var, -1.0)]) == 0, f"fig_{s}_{q}"
    for (s, q), var in C.items():
        terms = [(v, t.cut(s, b)[q]) for a, b, v in by_stage[s]]
        prob += pulp.LpAffineExpression([*terms, (var, -1.0)]) == 0, f"cut_{s}_{q}"
    T = new("T", lowBound=0)
    starts = [new(f"t_{v}", lowBound=0) if node.preds else None for v, node in enumerate(p.nodes)]

    def end(v: int) -> pulp.LpAffineExpression:
        node = p.nodes[v]
        terms = [(F[i, q], c) for i, q, c in node.seg] + [(C[i, q], c) for i, q, c in node.cut]
        sv = starts[v]
        return pulp.LpAffineExpression(terms + ([(sv, 1.0)] if sv is not None else []))

    ends = [end(v) for v in range(len(p.nodes))]
    for v, node in enumerate(p.nodes):
        sv = starts[v]
        for u in node.preds:
            prob += sv - ends[u] >= 0, f"edge_{u}_{v}"
    for v in p.ends:
        prob += T - ends[v] >= 0, f"end_{v}"
    for k, row in enumerate(p.rows):
        terms = [(F[i, q], c) for i, q, c in row.seg] + [(C[i, q], c) for i, q, c in row.cut]
        prob += T - pulp.LpAffineExpression(terms) >= row.constant, f"row_{k}"
    if p.seg_bound is not None:
        for s in range(S):
            terms = [(v, -t.bound(s, a, b)) for a, b, v in by_stage[s]]
            prob += pulp.LpAffineExpression([(T, 1.0), *terms]) >= 0, f"bound_{s}"
    for k, group in enumerate(p.shared):  # the stages of one device fit it together
        cap = p.capacity[group[0]]  # in units of it: bytes are 1e10, binaries 1
        terms = [(v, t.mem(s, a, b) / cap) for s in group for a, b, v in by_stage[s]]
        prob += pulp.LpAffineExpression(terms) <= 1.0, f"device_{k}"
    if ceiling is not None:
        prob += pulp.LpAffineExpression([(T, 1.0)]) <= ceiling, "ceiling"
    prob.setObjective(pulp.LpAffineExpression([(T, 1.0)]))
    if start is not None:
        _initial(t, start, x, F, C, starts, T)
    return prob, x


def _segments(layers: Layers) -> list[tuple[int, int, int]]:
    return [(s, a, b) for s, layer in enumerate(layers) for a, row in layer.items() for b in row]


def _flow(prob: pulp.LpProblem, layers: Layers, x: _X, K: int) -> None:
    """One segment per stage, each starting where the previous one ends."""
    out: dict[tuple[int, int], list[pulp.LpVariable]] = {}
    into: dict[tuple[int, int], list[pulp.LpVariable]] = {}
    for (s, a, b), v in x.items():
        out.setdefault((s, a), []).append(v)
        into.setdefault((s + 1, b), []).append(v)
    S = len(layers)
    for s, a in sorted(set(out) | set(into)):
        if s == S:
            continue
        flow = [(v, 1.0) for v in out.get((s, a), [])] + [(v, -1.0) for v in into.get((s, a), [])]
        prob += pulp.LpAffineExpression(flow) == (1 if s == 0 else 0), f"flow_{s}_{a}"


def _initial(
    t: StepTable,
    start: Sequence[int],
    x: _X,
    F: dict[tuple[int, int], pulp.LpVariable],
    C: dict[tuple[int, int], pulp.LpVariable],
    starts: list[pulp.LpVariable | None],
    T: pulp.LpVariable,
) -> None:
    """Every variable's value at the placement ``start`` (index form): a feasible start."""
    S = t.S
    for v in x.values():
        v.setInitialValue(0)
    for s in range(S):
        x[s, start[s], start[s + 1]].setInitialValue(1)
    for (s, q), var in F.items():
        var.setInitialValue(t.fig(s, start[s], start[s + 1])[q])
    for (s, q), var in C.items():
        var.setInitialValue(t.cut(s, start[s + 1])[q])
    step, begin, _ = t.graph_times(start)
    for v, var in enumerate(starts):
        if var is not None:
            var.setInitialValue(begin[v])
    T.setInitialValue(step)


def chosen(t: StepTable, x: _X) -> list[int] | None:
    """The placement (index form) the solved MILP's binaries describe, or None."""
    return chosen_path(t.S, t.K, x)


def milp_bound(outcome: Outcome, path: list[int] | None, t: StepTable) -> float:
    """The MILP's proven lower bound on the graph's value: its optimum, or its dual bound."""
    if outcome.proven and path is not None:
        return max(outcome.bound or 0.0, t.graph_times(path)[0] * (1 - MIP_REL_GAP))
    return max(outcome.bound or 0.0, 0.0)
