"""A step problem's figures, memoised by position; the segments that survive; the graph's value.

Positions ``pos[0] = 0 < pos[1] < … < pos[K] = n`` are the legal stage starts
followed by the chain's end; a segment ``(s, a, b)`` is "stage s holds blocks
[pos[a], pos[b])". A segment survives when it fits its stage's memory and its
bound (``seg_bound``) does not exceed the best step found; the survivors form
a layered DAG from (0, 0) to (S, K), one path per placement.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from planner.solve.problem import (
    block_label,
    placement_indices,
    unfit_block,
    unfit_last,
    unfit_stage,
    unfit_whole,
)
from planner.solve.step_problem import StepProblem, Term

__all__ = ["TOL", "Layers", "StepTable"]

TOL = 1e-9  # relative slack when comparing a bound with the best step found

Layers = list[dict[int, list[int]]]
"""Per stage: start index a -> the end indices b of its surviving segments."""


class StepTable:
    """Memoised figures, memory and bounds of a :class:`StepProblem`, by position index."""

    def __init__(self, p: StepProblem) -> None:
        n, S = p.n_blocks, p.n_stages
        allowed = range(1, n) if p.allowed_starts is None else p.allowed_starts
        self.p, self.n, self.S = p, n, S
        self.pos = [0, *sorted(set(allowed) - {0}), n]
        self.K = len(self.pos) - 1
        labels = p.stage_class if p.stage_class is not None else range(S)
        dense: dict[int, int] = {}
        self.cls = [dense.setdefault(c, len(dense)) for c in labels]
        self._fig: dict[tuple[int, int, int], tuple[float, ...]] = {}
        self._cut: dict[tuple[int, int], tuple[float, ...]] = {}
        self._mem: dict[tuple[int, int, int], float] = {}
        self._bound: dict[tuple[int, int, int], float] = {}
        self.limit = math.inf  # the bounds hold for placements at or below it (inf: none yet)

    # ----------------------------------------------------------------- memoised figures

    def fig(self, s: int, a: int, b: int) -> tuple[float, ...]:
        key = (self.cls[s], a, b)
        v = self._fig.get(key)
        if v is None:
            v = self._fig[key] = _checked(
                self.p.seg_figures(s, self.pos[a], self.pos[b]), f"seg_figures({s}, …)"
            )
        return v

    def cut(self, s: int, b: int) -> tuple[float, ...]:
        key = (s, b)
        v = self._cut.get(key)
        if v is None:
            v = self._cut[key] = _checked(
                self.p.cut_figures(s, self.pos[b]), f"cut_figures({s}, …)"
            )
        return v

    def mem(self, s: int, a: int, b: int) -> float:
        key = (s, a, b)
        v = self._mem.get(key)
        if v is None:
            v = self._mem[key] = float(self.p.seg_memory(s, self.pos[a], self.pos[b]))
        return v

    def bound(self, s: int, a: int, b: int) -> float:
        """The segment's bound, for placements at or below the last ``layers`` limit."""
        fn = self.p.seg_bound
        if fn is None:
            return 0.0
        key = (s, a, b)
        v = self._bound.get(key)
        if v is None:
            v = self._bound[key] = float(fn(s, self.pos[a], self.pos[b], self.limit))
        return v

    def fits(self, s: int, a: int, b: int) -> bool:
        return self.mem(s, a, b) <= self.p.capacity[s]

    # ----------------------------------------------------------------- placements

    def indices(self, starts: Sequence[int]) -> list[int]:
        """Position indices of a placement (with K appended); ValueError if malformed."""
        return placement_indices(self.pos, self.S, starts)

    def starts(self, idx: Sequence[int]) -> tuple[int, ...]:
        return tuple(self.pos[a] for a in idx[:-1])

    def fits_all(self, idx: Sequence[int]) -> bool:
        """Every stage fits its device, and every device its stages together (``shared``)."""
        if not all(self.fits(s, idx[s], idx[s + 1]) for s in range(self.S)):
            return False
        return all(total <= cap for _, total, cap in self.shared_memory(idx))

    def shared_memory(self, idx: Sequence[int]) -> list[tuple[tuple[int, ...], float, float]]:
        """Per group of stages on one device (``shared``): (its stages, their summed peak
        bytes in the placement ``idx``, the device's capacity)."""
        return [
            (g, sum(self.mem(s, idx[s], idx[s + 1]) for s in g), self.p.capacity[g[0]])
            for g in self.p.shared
        ]

    def why_shared(self, idx: Sequence[int] | None) -> str:
        """Why no placement fits when each stage fits alone but a device's stages together
        do not (``idx``: a placement tried, for its numbers)."""
        head = (
            "no placement fits memory: each stage fits alone, but the stages sharing a "
            "device do not fit it together"
        )
        fix = (
            "fix: fewer stages per rank (--virtual-stages 1 or 2), more pipeline ranks, "
            "recompute, or devices with more memory"
        )
        over = [x for x in (self.shared_memory(idx) if idx is not None else []) if x[1] > x[2]]
        if not over:
            return f"{head}; {fix}"
        g, total, cap = max(over, key=lambda x: x[1] - x[2])
        return (
            f"{head}: e.g. stages {', '.join(map(str, g))} on one device need "
            f"{total / 2**30:.2f} GiB together, {cap / 2**30:.2f} GiB usable; {fix}"
        )

    def too_big(self, s: int, a: int, b: int, limit: float) -> bool:
        """Whether the segment, and so every longer one from its start, is beyond the
        limit by the problem's floors (``seg_floor``, ``seg_memory_floor``)."""
        p, i, j = self.p, self.pos[a], self.pos[b]
        if p.seg_memory_floor is not None and p.seg_memory_floor(s, i, j) > p.capacity[s]:
            return True
        return p.seg_floor is not None and p.seg_floor(s, i, j) > limit

    def layers(self, U: float, keep: Sequence[Sequence[int]] = ()) -> Layers:
        """The segments that fit memory and lie on a placement whose every segment bound
        is ≤ U (those of ``keep`` always): a bottleneck path through them.

        Forward, each (stage, start) keeps the least largest bound of a path reaching
        it, and a segment survives when that and its own bound are ≤ U; backward, the
        same from the chain's end. A stage's runs from one start are tried only until
        their ``seg_floor`` exceeds U or their ``seg_memory_floor`` the stage's capacity
        (both non-decreasing in the end).
        """
        S, K, limit = self.S, self.K, U + TOL * max(1.0, abs(U))
        bounded = math.isfinite(limit)  # no limit: nothing to prune by bound
        if bounded and (limit > self.limit or not math.isfinite(self.limit)):
            # [Note: bounds under a limit]: kept for lower limits, which they hold for too
            self.limit = limit
            self._bound.clear()
        must = {(s, idx[s], idx[s + 1]) for idx in keep for s in range(S)}
        out: Layers = []
        reach = {0: 0.0}  # start -> the least largest bound of a path reaching it
        for s in range(S):
            layer: dict[int, list[int]] = {}
            nxt: dict[int, float] = {}
            for a in sorted(reach):
                ends = [K] if s == S - 1 else range(a + 1, K - S + s + 2)
                row = []
                for b in ends:
                    kept = (s, a, b) in must
                    if not kept and self.too_big(s, a, b, limit if bounded else math.inf):
                        break
                    v = max(reach[a], self.bound(s, a, b)) if bounded else 0.0
                    if kept or (v <= limit and self.fits(s, a, b)):
                        row.append(b)
                        nxt[b] = min(nxt.get(b, math.inf), v)
                if row:
                    layer[a] = row
            out.append(layer)
            reach = nxt
        return self._back(_trim(out, K), limit if bounded else math.inf, must)

    def _back(self, layers: Layers, limit: float, must: set[tuple[int, int, int]]) -> Layers:
        """Drop the segments no bottleneck path ≤ ``limit`` reaches the chain's end from."""
        if not math.isfinite(limit):
            return layers
        ahead = {self.K: 0.0}  # start of stage s + 1 -> least largest bound to the end
        out: Layers = []
        for s in range(self.S - 1, -1, -1):
            kept: dict[int, list[int]] = {}
            here: dict[int, float] = {}
            for a, row in layers[s].items():
                for b in row:
                    if b not in ahead:
                        continue
                    v = max(ahead[b], self.bound(s, a, b))
                    if v <= limit or (s, a, b) in must:
                        kept.setdefault(a, []).append(b)
                        here[a] = min(here.get(a, math.inf), v)
            out.append(kept)
            ahead = here
        out.reverse()
        return _trim(out, self.K)

    def why_infeasible(self) -> str:
        """Why no placement fits memory (when none does), in the closed-form solver's words:
        a run between split points no stage can hold, or the stage that cannot take what
        the stages before it leave."""
        p, S, K = self.p, self.S, self.K
        names = p.block_names
        for a in range(K):  # each run between legal split points must fit some stage
            stages = range(max(0, a - (K - S)), min(a, S - 1) + 1)
            if any(self.fits(s, a, a + 1) for s in stages):
                continue
            need, s = min((self.mem(s, a, a + 1), s) for s in stages)
            what = block_label(names, self.pos[a], self.pos[a + 1])
            if self.pos[a + 1] - self.pos[a] > 1:
                what += " (no legal split point between them)"
            room = max(p.capacity[t] for t in stages)
            return unfit_block(what, room, need, s, p.capacity[s])
        if S == 1:
            return unfit_whole(block_label(names, 0, p.n_blocks), self.mem(0, 0, K), p.capacity[0])
        reach = {0}
        for s in range(S - 1):
            nxt = set()
            for a in reach:
                for b in range(a + 1, K - S + s + 2):
                    if self.too_big(s, a, b, math.inf):
                        break
                    if self.fits(s, a, b):
                        nxt.add(b)
            if not nxt:
                need = min(self.mem(s, a, a + 1) for a in reach)
                return unfit_stage(S, s, p.capacity[s], need)
            reach = nxt
        a = max(reach)
        left = block_label(names, self.pos[a], p.n_blocks)
        return unfit_last(S, left, self.mem(S - 1, a, K), p.capacity[S - 1])

    def count(self, layers: Layers) -> int:
        """Placements through the layers (paths from (0, 0) to (S, K))."""
        ways = {0: 1}
        for layer in layers:
            nxt: dict[int, int] = {}
            for a, row in layer.items():
                for b in row:
                    nxt[b] = nxt.get(b, 0) + ways.get(a, 0)
            ways = nxt
        return ways.get(self.K, 0)

    def bottleneck(self, layers: Layers) -> tuple[float, list[int] | None]:
        """The least, over the placements through the layers, of their largest segment
        bound (every one of them has a step at least this; inf when there is none), and a
        placement that reaches it (index form): often a good one to evaluate."""
        best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, (0,))}
        for s, layer in enumerate(layers):
            nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
            for a, row in layer.items():
                here = best.get(a)
                if here is None:
                    continue
                for b in row:
                    v = max(here[0], self.bound(s, a, b))
                    if v < nxt.get(b, (math.inf,))[0]:
                        nxt[b] = (v, (*here[1], b))
            best = nxt
        v, path = best.get(self.K, (math.inf, ()))
        return v, list(path) if path else None

    def paths(self, layers: Layers, together: bool = False) -> Iterator[list[int]]:
        """Every placement through the layers, in index form (depth first); ``together``:
        only those whose devices hold their stages together (``shared``)."""
        idx = [0]
        check = together and bool(self.p.shared)

        def walk(s: int) -> Iterator[list[int]]:
            if s == self.S:
                if not check or self.fits_all(idx):
                    yield list(idx)
                return
            for b in layers[s].get(idx[-1], []):
                idx.append(b)
                yield from walk(s + 1)
                idx.pop()

        yield from walk(0)

    # ----------------------------------------------------------------- the graph

    def graph_times(self, idx: Sequence[int]) -> tuple[float, list[float], list[float]]:
        """(the graph's longest path and rows, each node's start, each node's end)."""
        S, p = self.S, self.p
        figs = [self.fig(s, idx[s], idx[s + 1]) for s in range(S)]
        cuts = [self.cut(s, idx[s + 1]) for s in range(S - 1)]
        starts: list[float] = []
        ends: list[float] = []
        for node in p.nodes:
            t = 0.0
            for u in node.preds:
                t = max(t, ends[u])
            starts.append(t)
            ends.append(t + value(node.seg, figs) + value(node.cut, cuts))
        T = max(ends[v] for v in p.ends)
        for row in p.rows:
            T = max(T, value(row.seg, figs) + value(row.cut, cuts) + row.constant)
        return T, starts, ends


def value(terms: Sequence[Term], figures: Sequence[Sequence[float]]) -> float:
    """Σ coefficient · figure over ``terms``."""
    return sum(c * figures[i][q] for i, q, c in terms)


def _checked(values: Sequence[float], what: str) -> tuple[float, ...]:
    out = tuple(float(v) for v in values)
    if not all(v >= 0 and math.isfinite(v) for v in out):
        raise ValueError(f"{what} returned {values!r}: figures must be finite numbers ≥ 0")
    return out


def _trim(layers: Layers, K: int) -> Layers:
    """Drop segments no full placement passes through."""
    out: Layers = []
    live = {K}
    for layer in reversed(layers):
        kept = {a: [b for b in row if b in live] for a, row in layer.items()}
        out.append({a: row for a, row in kept.items() if row})
        live = set(out[-1])
    out.reverse()
    if 0 not in out[0]:
        return [{} for _ in layers]
    return out
