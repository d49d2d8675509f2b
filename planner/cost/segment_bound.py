"""Lower bounds on the step of any placement holding a given segment: what the step
solver prunes and proves with (:mod:`planner.solve.step`).

Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

from planner.plan.schedule import SPLIT_BACKWARD

__all__ = ["SegmentBound"]


class SegmentBound:
    """Lower bounds on the step of any placement in which stage s holds blocks [i, j).

    From paths of the step's graph ([Note: the step graph]) that every
    placement has, with the other stages at their least (dynamic programs over
    the placements of the blocks before and after the segment):

    * micro-batch 0's forwards reach stage s, stage s runs its m forwards and
      m backwards, its all-reduce and tail: ``Pf + m·(f + b) + reduce + tail``;
    * … then the last micro-batch's backwards (each with its stage's all-reduce)
      go back to stage 0, whose tail ends the step: ``Pre + m·(f + b) + reduce``
      (+ its tail when s = 0);
    * the wait for stage s's first backward: a forward runs through the later
      stages and micro-batch 0's backward comes back (``link + Suf``). GPipe: after
      stage s's m forwards (``+ link + Suf``), or for its last backward
      ([Note: GPipe's two round trips]); 1F1B: stage s runs
      w = min(S − s, m) forwards before its first backward and the rest after
      it, so only the wait beyond the w − 1 forwards that overlap it,
      ``max(0, link + Suf − (w − 1)·f)``. Both paths above hold it.

    [Note: 1F1B's two round trips] Stage s of 1F1B runs w = min(S − s, m)
    forwards, its first backward, then alternates (F, B) and ends with w
    backwards. Its first backward waits for micro-batch 0's round trip through
    the later stages (``link + Suf``), which overlaps its w − 1 other warm-up
    forwards; its last backward waits for the last micro-batch's round trip,
    in which every later stage's backward is its last and all-reduces
    (``link + Suf_red``), which overlaps its w − 1 other cool-down backwards.
    With w < m the path through both costs ``m·(f + b) + reduce +
    max(0, trip − (w − 1)·f) + max(0, trip_red − (w − 1)·b)``; with w = m
    (every forward first) the second trip starts at the last forward, before
    the first backward: ``max(f + max((m − 1)·f, trip) + m·b, m·f + trip_red + b)
    + reduce``. On 1024 H100s the all-reduces of the later stages are most of a
    Llama 70 B's step: without the second trip the bounds missed them.

    [Note: GPipe's two round trips] GPipe's stage s runs its m forwards, then
    its m backwards in micro-batch order. Its first backward waits for the last
    forward's trip on and micro-batch 0's backward back (``link + Suf``); its
    last backward waits for the last micro-batch's round trip, in which every
    later stage's backward is its last and all-reduces (``link + Suf_red``),
    after which stage s runs one backward, not m. So the backwards end at least
    ``max(trip + m·b, trip_red + b)`` after the forwards: the wait is
    ``max(trip, trip_red − (m − 1)·b)``. With many stages all-reducing across
    nodes the later stages' all-reduces are much of the step (bench scaling's
    512 blocks on 512 H100s, pp 64 × dp 8: 111 ms of a 296 ms step).

    [Note: GPipe's two ends] A GPipe path may hold the m forwards of one stage
    and the m backwards of another: stage s's m forwards, the last micro-batch's
    forwards on to the last stage, its m backwards, then the last micro-batch's
    backwards (each all-reducing) down to stage 0; or stage 0's m forwards, the
    last micro-batch's forwards on to stage s, its wait and its m backwards, and
    down again. So two more bounds per segment: ``Pre + m·f + b + reduce + link +
    Suf_last`` (``Suf_last``: least Σ (f + b + reduce + links) after s, the last
    stage's backward m times) and ``Pre_first + f + wait + m·b + reduce``
    (``Pre_first``: ``Pre`` with stage 0's forward m times). The first bounds,
    one stage's m forwards and m backwards, favour placements that pile work on
    the first stages (bench scaling's 512 blocks on 512 H100s, pp 64 × dp 8,
    m 64: their least placement had stage 0 at 2.1 ms a micro-batch against
    0.8 ms for the last, and simulated 296.5 ms against a bound of 270.3); these
    see it. On that chain the bound rose to 281.2 ms and the best placement
    found fell from 296.3 to 286.7 ms.

    ``Pf``: least Σ (f + link_fwd) of the stages before s; ``Pre``: least
    Σ (f + b + reduce + links) before s, plus stage 0's tail; ``Suf``: least
    Σ (f + b + links) after s, ``Suf_red`` the same with their all-reduces
    (memory is not asked: the bounds stay valid, and
    cheap). ``figures(s, i, j)`` gives (fwd, bwd, reduce, tail) no larger than
    the step's own, ``cuts(s, j)`` (link_fwd, link_bwd).

    [Note: bounds with several stages per rank] With v > 1 (Interleaved 1F1B,
    Looped BFS) a rank runs its stages' actions interleaved: stage s's m
    forwards and backwards still lie on one path (its rank's actions, one after
    another, with others between them), micro-batch 0's forwards still reach it,
    and its last backward (micro-batch m − 1's, each stage's last) still sends
    the last gradient back through the stages before it, each all-reducing. So
    the first two bounds hold; the wait term, which counts 1F1B's or GPipe's
    warm-up forwards, is left out (0).

    [Note: bounds under a split backward] The zero-bubble schedules split each
    backward into its input's part (``I``) and its weights' (``W``); a stage's
    all-reduce follows its last ``W``, off the path the gradients take back, and
    the step graph sends nothing between two consecutive stages on one rank
    (ZB-V, DualPipeV). So only the first bound holds, its wait term left out,
    with such a local link's figures counted as 0 (``step_problem`` passes
    them so).

    [Note: bounds under a limit] Called with a ``limit`` (the best step found),
    the least sums range only over the placements that could still reach it:
    a stage holding [i, j) takes at least ``m·(f + b)`` of the step, so a
    placement at or below the limit has no segment above it, and the dynamic
    programs skip those segments. ``floor(s, i, j)`` gives the figures
    without recompute (cheap: no memory asked): non-decreasing in j, so each stage's
    runs are tried only up to the first that exceeds the limit, and a chain of
    n blocks on S stages costs S·n·(blocks per stage) instead of S·n². The
    bounds then hold for every placement whose step is at most the limit (a
    segment none of them holds gets infinity): all that pruning against it
    needs. The states are trimmed likewise: stage s starts at block i only where the
    s stages before it, and the S − s from it, can hold their blocks' work at m·(f + b)
    each within the limit (one of them holds at least an even share of it). A larger
    limit than the tables were made for rebuilds them; a smaller one keeps them
    (they hold for it too, if less tightly: on bench scaling's 512 blocks on 512
    H100s, GPipe, tables made at 327.2 ms and asked at 286.7 gave the same least
    bottleneck as tables made at 286.7, 281.1 ms, and each rebuild cost 2–4 s).
    ``fits(s, i, j)``, when given, is False for a run that cannot fit its stage however it is
    placed, nor can any longer one from i (a memory floor): those are no placement's.
    """

    def __init__(
        self,
        *,
        n_stages: int,
        micro_batches: int,
        schedule: str,
        positions: Sequence[int],
        figures: Callable[[int, int, int], Sequence[float]],
        cuts: Callable[[int, int], Sequence[float]],
        floor: Callable[[int, int, int], Sequence[float]] | None = None,
        fits: Callable[[int, int, int], bool] | None = None,
        virtual: int = 1,
    ) -> None:
        self.S, self.m, self.gpipe = n_stages, micro_batches, schedule == "gpipe"
        self.several = virtual > 1  # [Note: bounds with several stages per rank]
        self.split = schedule in SPLIT_BACKWARD  # [Note: bounds under a split backward]
        self.pos = list(positions)
        self.index = {q: a for a, q in enumerate(self.pos)}
        self.figures, self.cuts = figures, cuts
        self.floor = floor or figures
        self.fits = fits  # False when no longer run from the same start fits either
        # pf, pre, suf, suf_red; GPipe also pre_first, suf_last ([Note: GPipe's two ends])
        self._tables: tuple[list[dict[int, float]], ...] | None = None
        self._limit = math.inf

    def __call__(self, s: int, i: int, j: int, limit: float = math.inf) -> float:
        if self._tables is None or limit > self._limit:
            self._tables = self._build(limit)
            self._limit = limit
        pf, pre, suf, suf_red = self._tables[:4]
        inf = math.inf
        f, b, red, tail = self.figures(s, i, j)
        own = self.m * (f + b) + red
        link = sum(self.cuts(s, j)) if s < self.S - 1 else 0.0
        trip = link + suf[s + 1].get(j, inf)  # micro-batch 0 on to the last stage and back
        if self.split:
            return pf[s].get(i, inf) + own + tail
        last_trip = link + suf_red[s + 1].get(j, inf)  # the last micro-batch's, all-reducing
        if self.several:
            wait = 0.0
        elif self.gpipe:  # [Note: GPipe's two round trips]
            wait = max(trip, last_trip - (self.m - 1) * b)
        else:  # [Note: 1F1B's two round trips]
            m, w = self.m, min(self.S - s, self.m)
            if w < m:
                wait = max(0.0, trip - (w - 1) * f) + max(0.0, last_trip - (w - 1) * b)
            else:
                wait = max(f + max((m - 1) * f, trip) + m * b, m * f + last_trip + b) - m * (f + b)
        first = pre[s].get(i, inf) + own + (tail if s == 0 else 0) + wait
        out = max(pf[s].get(i, inf) + own + tail + wait, first)
        if self.gpipe:  # [Note: GPipe's two ends]
            pre_first, suf_last = self._tables[4:]
            if s < self.S - 1:  # s's m forwards, the last stage's m backwards
                ahead = self.m * f + b + red + link + suf_last[s + 1].get(j, inf)
                out = max(out, pre[s].get(i, inf) + ahead + (tail if s == 0 else 0))
            if s > 0:  # stage 0's m forwards, s's m backwards
                out = max(out, pre_first[s].get(i, inf) + f + wait + self.m * b + red)
        return out

    def _ends(self, s: int, i: int, limit: float) -> Iterator[int]:
        """Legal ends j of stage s starting at block i (room left for the later stages),
        while the stage's own least share of the step stays within ``limit``."""
        pos, S = self.pos, self.S
        last = [len(pos) - 1] if s == S - 1 else range(self.index[i] + 1, len(pos) - (S - s - 1))
        for b in last:
            j = pos[b]
            f, bw = self.floor(s, i, j)[:2]
            if self.m * (f + bw) > limit or (self.fits is not None and not self.fits(s, i, j)):
                return
            yield j

    def _balanced(self, limit: float) -> Callable[[int, int], bool]:
        """Whether stage s may start at block i in a placement whose step is ≤ ``limit``:
        the s stages before it hold [0, i), so one of them at least 1/s of its work, and
        a stage's m forwards and backwards lie on one path; likewise the S − s from i."""
        if not math.isfinite(limit):
            return lambda s, i: True
        n, m, stages = self.pos[-1], self.m, range(self.S)

        def least(i: int, j: int) -> float:  # Σ (f + b) of [i, j) on the fastest stage
            return min(sum(self.floor(t, i, j)[:2]) for t in stages) if i < j else 0.0

        head = {i: m * least(0, i) for i in self.pos}
        rest = {i: m * least(i, n) for i in self.pos}
        return lambda s, i: head[i] <= limit * s and rest[i] <= limit * (self.S - s)

    def _build(self, limit: float) -> tuple[list[dict[int, float]], ...]:
        S, inf = self.S, math.inf
        ok = self._balanced(limit)
        pf: list[dict[int, float]] = [{0: 0.0}] + [{} for _ in range(S)]
        pre: list[dict[int, float]] = [{0: 0.0}] + [{} for _ in range(S)]
        first: list[dict[int, float]] = [{0: 0.0}] + [{} for _ in range(S)]  # GPipe only
        for s in range(S - 1):
            for i in list(pf[s]):
                if not ok(s, i):
                    continue
                for j in self._ends(s, i, limit):
                    f, b, red, tail = self.figures(s, i, j)
                    lf, lb = self.cuts(s, j)
                    v = pf[s][i] + f + lf
                    if v < pf[s + 1].get(j, inf):
                        pf[s + 1][j] = v
                    x = f + b + red + lf + lb + (tail if s == 0 else 0.0)
                    if pre[s][i] + x < pre[s + 1].get(j, inf):
                        pre[s + 1][j] = pre[s][i] + x
                    if self.gpipe:  # stage 0's forwards all on the path
                        w = first[s][i] + x + ((self.m - 1) * f if s == 0 else 0.0)
                        if w < first[s + 1].get(j, inf):
                            first[s + 1][j] = w
        suf: list[dict[int, float]] = [{} for _ in range(S)] + [{self.pos[-1]: 0.0}]
        suf_red: list[dict[int, float]] = [{} for _ in range(S)] + [{self.pos[-1]: 0.0}]
        last: list[dict[int, float]] = [{} for _ in range(S)] + [{self.pos[-1]: 0.0}]
        for s in range(S - 1, 0, -1):
            for i in self.pos[s:-1]:
                if not ok(s, i):
                    continue
                best = best_red = best_last = inf
                for j in self._ends(s, i, limit):
                    if j not in suf[s + 1]:
                        continue
                    f, b, red, _ = self.figures(s, i, j)
                    link = sum(self.cuts(s, j)) if s < S - 1 else 0.0
                    best = min(best, f + b + link + suf[s + 1][j])
                    best_red = min(best_red, f + b + red + link + suf_red[s + 1][j])
                    if self.gpipe:  # the last stage's backwards all on the path
                        many = (self.m - 1) * b if s == S - 1 else 0.0
                        best_last = min(best_last, f + b + red + link + many + last[s + 1][j])
                if best < inf:
                    suf[s][i], suf_red[s][i], last[s][i] = best, best_red, best_last
        return pf, pre, suf, suf_red, first, last
