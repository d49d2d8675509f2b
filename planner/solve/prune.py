"""Segment enumeration and pruning: the segments that can beat the incumbent, root bounds.

[Note: segment pruning] Only segments that can appear in a placement better
than an incumbent U (the heuristic's, or a warm start) become variables. Any
stage forces T ≥ m·y, so first y ≤ U/m: the ends of each (s, a) are walked
upward until work exceeds that cap, and memory (monotone too) is bisected.
Then rounds of DP sweeps bound every segment from below. For a *bucket*
(ylo, ycap] × (rlo, rcap], let F[s][a] be the least Σ(w + c) of stages
0..s−1 covering blocks [0, pos[a]) and G[s][b] the least of stages s..S−1
covering [pos[b], n), both using only segments with y ≤ ycap and r ≤ rcap.
A placement through (s, a, b) whose bottleneck Y = max y lies in (ylo, ycap]
and whose A = max r lies in (rlo, rcap] has

    T ≥ F[s][a] + w + c[s,b] + G[s+1][b] + (m − 1)·max(ylo, y, c[s−1,a]) + max(rlo, r)

A *family* of buckets covers every placement that could beat U (Y ≤ Y_top =
(U − Σ_lb − A_lb)/(m − 1), A ≤ U − Σ_lb − (m − 1)·W_lb), so the least bound
over a family's buckets that admit the segment is a valid bound; three
families (a grid on Y, one on A, a coarse 2-D grid) give three, and the
segment goes when the largest exceeds U. Each sweep's least-Σ placement is
also a candidate incumbent, so U falls as the rounds go. Rounds repeat, with
finer grids as the set shrinks, until nothing changes (or the deadline).
With fine enough buckets this is an exact DP by itself; the ILP is what
proves the rest and reports a gap when stopped early.

[Note: root bounds] Over the surviving DAG, W_lb = min over placements of
the largest y (a bottleneck-path DP), A_lb the same for r, Σ_lb = least
Σ(w + c). Each bucket family gives T ≥ min over its buckets of
(G[0][0] + (m − 1)·ylo + rlo); ``root`` is the largest. All hold per stage
index, so they are valid for heterogeneous stages. They are what the LP
relaxation misses (it averages the max terms), and they are our lower bound
when a solver reports none (or a weaker one).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.solve.segments import SegmentCosts

__all__ = ["PRUNE_ROUNDS", "TOL", "Layer", "Segments", "prune"]

log = logging.getLogger(__name__)

TOL = 1e-9  # relative slack when comparing bounds with the incumbent

# per stage: {start index a: [(end index b, w, cut, r), ...]}; r < 0 means "not asked yet"
Layer = dict[int, list[tuple[int, float, float, float]]]
Table = list[dict[int, float]]
PRUNE_ROUNDS = 20  # pruning rounds at most (each only removes segments)
# Buckets per round: a family gets 8·k (2-D: (3·k)²) with k = √(_BUCKET_BUDGET / segments)
# clamped to 1..4, so a shrinking set gets finer buckets for about the same cost.
_BUCKET_BUDGET = 2e5


@dataclass(frozen=True)
class Segments:
    layers: list[Layer]
    w_lb: float
    a_lb: float
    root: float  # a lower bound on every placement's T: see [Note: root bounds]
    incumbent: list[int]  # the best placement seen (index form)

    @property
    def count(self) -> int:
        return sum(len(row) for layer in self.layers for row in layer.values())


def _sweeps(
    c: SegmentCosts, layers: list[Layer], ycap: float, rcap: float
) -> tuple[Table, Table, list[int] | None]:
    """F, G over segments with y ≤ ycap and r ≤ rcap, and the least-Σ placement among them."""
    S = c.S
    F: Table = [{0: 0.0}] + [{} for _ in range(S)]
    back: list[dict[int, int]] = [{} for _ in range(S)]
    for s in range(S):
        Fs, Fn, bk = F[s], F[s + 1], back[s]
        for a, row in layers[s].items():
            fa = Fs.get(a)
            if fa is None:
                continue
            for b, w, cut, r in row:
                if w <= ycap and cut <= ycap and r <= rcap and fa + w + cut < Fn.get(b, math.inf):
                    Fn[b], bk[b] = fa + w + cut, a
    G: Table = [{} for _ in range(S)] + [{c.K: 0.0}]
    for s in range(S - 1, -1, -1):
        Gn, Gs = G[s + 1], G[s]
        for a, row in layers[s].items():
            best = math.inf
            for b, w, cut, r in row:
                if w <= ycap and cut <= ycap and r <= rcap and b in Gn and w + cut + Gn[b] < best:
                    best = w + cut + Gn[b]
            if best < math.inf:
                Gs[a] = best
    if c.K not in F[S]:
        return F, G, None
    idx = [c.K]
    for s in range(S - 1, -1, -1):
        idx.append(back[s][idx[-1]])
    return F, G, idx[::-1]


def _bottleneck(layers: list[Layer], value: Callable[[float, float, float], float]) -> float:
    """min over placements of max over stages of value(w, cut, r) (bottleneck-path DP)."""
    B: dict[int, float] = {0: 0.0}
    for layer in layers:
        nB: dict[int, float] = {}
        for a, row in layer.items():
            if a in B:
                for b, w, cut, r in row:
                    v = max(B[a], value(w, cut, r))
                    if v < nB.get(b, math.inf):
                        nB[b] = v
        B = nB
    return min(B.values())


def _grid(lo: float, top: float, n: int) -> list[tuple[float, float]]:
    """(bucket floor, bucket cap) pairs covering (lo, top]; one open bucket if top is inf."""
    if n == 1 or math.isinf(top) or top <= lo:
        return [(lo, max(top, lo))]
    caps = [lo + (top - lo) * k / n for k in range(1, n)] + [top]
    return list(zip([lo, *caps], caps, strict=False))


def prune(
    c: SegmentCosts,
    U: float,
    incumbent: Sequence[int],
    deadline: float = math.inf,
    rounds: int = PRUNE_ROUNDS,
) -> Segments:
    """The segments that can be in a placement with T ≤ U: see [Note: segment pruning].

    The first round always runs (the ILP needs it); later rounds stop at the deadline,
    and there are at most ``rounds`` of them.
    """
    S, m, inf = c.S, c.m, math.inf
    inc = list(incumbent)
    layers = _first_layers(c, U, inc)
    count, first = -1, True
    for round_ in range(rounds):
        if round_ > 0 and time.perf_counter() > deadline:
            break
        w_lb = _bottleneck(layers, lambda w, cut, r: max(w, cut))
        a_lb = 0.0 if first else _bottleneck(layers, lambda w, cut, r: r)
        sum_lb = _sweeps(c, layers, inf, inf)[1][0][0]
        families = _families(m, U, sum_lb, w_lb, a_lb, count, first)
        tables: list[_Family] = []
        for family in families:
            tables.append([])
            for ylo, ycap, rlo, rcap in family:
                F, G, path = _sweeps(c, layers, ycap, rcap)
                if path is not None and c.objective(path) < U:
                    U, inc = c.objective(path), path
                tables[-1].append((ylo, ycap, rlo, rcap, F, G))
        root = max(
            min(G[0].get(0, inf) + (m - 1) * ylo + rlo for ylo, _, rlo, _, _, G in t)
            for t in tables
        )
        limit = U + TOL * max(1.0, abs(U))
        must = {(s, inc[s], inc[s + 1]) for s in range(S)}
        layers = [_kept(c, s, layers[s], tables, limit, must) for s in range(S)]
        n_now = sum(len(row) for layer in layers for row in layer.values())
        if n_now == count and not first:
            break
        log.debug("prune round: %d segments, U %.6g, root %.6g", n_now, U, root)
        count, first = n_now, False
    return Segments(_trim(c, layers), w_lb, a_lb, min(root, U), inc)


# A family of buckets, swept: (ylo, ycap, rlo, rcap, F, G) per bucket.
_Family = list[tuple[float, float, float, float, Table, Table]]


def _first_layers(c: SegmentCosts, U: float, incumbent: Sequence[int]) -> list[Layer]:
    """Every segment with y ≤ U/m that fits its stage's memory, walked forward so that only
    reachable starts are walked (any stage forces T ≥ m·y), and the incumbent's own.

    The walk takes a stage's memory as monotone in its blocks (``SegmentCosts.ends``);
    where it is not (a shorter run ending at a larger boundary tensor, near the
    device's capacity: a zero-bubble stage holding its activations until W), the
    incumbent, which fits, may lie outside the walk: its segments are added, so
    that the placement ``U`` was measured on is always among the layers.
    """
    layers: list[Layer] = []
    reach, wcap = {0}, U / c.m * (1 + TOL)
    for s in range(c.S):
        layer: Layer = {}
        for a in sorted(reach | {incumbent[s]}):  # ends in s + 1 .. hi(s + 1), the last K
            cuts = [(b, c.cut(s, b)) for b in c.ends(s, a, wcap)]
            row = [(b, c.w(s, a, b), cut, -1.0) for b, cut in cuts if cut <= wcap]
            a_inc, b_inc = incumbent[s], incumbent[s + 1]
            if a == a_inc and all(seg[0] != b_inc for seg in row):
                row.append((b_inc, c.w(s, a, b_inc), c.cut(s, b_inc), -1.0))
            if row:
                layer[a] = row
        layers.append(layer)
        reach = {seg[0] for row in layer.values() for seg in row}
    return layers


def _families(
    m: int, U: float, sum_lb: float, w_lb: float, a_lb: float, count: int, first: bool
) -> list[list[tuple[float, float, float, float]]]:
    """The bucket families of a round.

    Bucket (ylo, ycap, rlo, rcap): placements whose bottleneck Y lies in (ylo, ycap]
    and whose all-reduce A lies in (rlo, rcap]. A family of buckets covers every
    placement that could beat U; each family gives a lower bound, the larger wins.
    """
    inf = math.inf
    slack = TOL * max(1.0, abs(U))
    y_top = (U + slack - sum_lb - a_lb) / (m - 1) if m > 1 and not first else inf
    r_top = U + slack - sum_lb - (m - 1) * w_lb if not first else inf
    scale = min(4.0, max(1.0, (_BUCKET_BUDGET / max(count, 1)) ** 0.5))
    n1, n2 = round(8 * scale), round(3 * scale)  # 8..32 per 1-D family, 3..12 a side in 2-D
    families = [[(lo, cap, a_lb, inf) for lo, cap in _grid(w_lb, y_top, n1)]]
    if not first:
        families.append([(w_lb, inf, lo, cap) for lo, cap in _grid(a_lb, r_top, n1)])
        families.append(
            [
                (ylo, ycap, rlo, rcap)
                for ylo, ycap in _grid(w_lb, y_top, n2)
                for rlo, rcap in _grid(a_lb, r_top, n2)
                if ylo * (m - 1) + rlo + sum_lb <= U + slack
            ]
        )
    return families


def _kept(
    c: SegmentCosts,
    s: int,
    layer: Layer,
    tables: list[_Family],
    limit: float,
    must: set[tuple[int, int, int]],
) -> Layer:
    """Stage s's segments whose lower bound (the largest over the families) is ≤ limit,
    and the incumbent's own (``must``); every kept segment's r is asked for now."""
    inf, m = math.inf, c.m
    out: Layer = {}
    for a, row in layer.items():
        cin, kept = c.cut(s - 1, a), []
        for b, w, cut, r in row:
            y, lb = max(w, cut), -inf
            for t in tables:
                best = inf
                for ylo, ycap, rlo, rcap, F, G in t:
                    fa, g = F[s].get(a), G[s + 1].get(b)
                    if ycap >= y and rcap >= r and fa is not None and g is not None:
                        v = fa + w + cut + g + (m - 1) * max(ylo, y, cin) + max(rlo, r)
                        best = min(best, v)
                lb = max(lb, best)
            if r < 0 and lb <= limit:  # first round: one open bucket with rlo = 0
                r = c.r(s, a, b)
                lb += r  # the bucket added max(0, -1.0) = 0 for it
            if lb > limit and (s, a, b) not in must:
                continue
            kept.append((b, w, cut, r if r >= 0 else c.r(s, a, b)))
        if kept:
            out[a] = kept
    return out


def _trim(c: SegmentCosts, layers: list[Layer]) -> list[Layer]:
    """Drop segments no full placement passes through (dead ends left by a stopped prune)."""
    ends = {0}
    fwd: list[Layer] = []
    for layer in layers:
        fwd.append({a: row for a, row in layer.items() if a in ends})
        ends = {seg[0] for row in fwd[-1].values() for seg in row}
    out: list[Layer] = []
    live = {c.K}
    for layer in reversed(fwd):
        kept = {a: [seg for seg in row if seg[0] in live] for a, row in layer.items()}
        out.append({a: row for a, row in kept.items() if row})
        live = set(out[-1])
    return out[::-1]
