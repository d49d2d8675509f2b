"""The partitioners people use today, as baselines for the planner's ILP.

Each returns stage starts (``starts[0] == 0``; stage s holds blocks
``[starts[s], starts[s + 1])``), the form of ``PartitionSolution.starts``, so
``planner.solve.evaluate`` prices every baseline on the same cost model.

None of these tools knows about illegal split points. When ``allowed`` is
given, each split is moved to the nearest allowed start, in order, as a user
would do by hand (``_snap``). Pure: no torch.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Collection, Iterator, Sequence

__all__ = [
    "DEEPSPEED_SEED_WORK",
    "deepspeed_balanced",
    "parameter_minmax",
    "time_balanced",
    "uniform",
    "warm_starts",
]

DEEPSPEED_SEED_WORK = 4_000_000
"""blocks² × stages at most for DeepSpeed's split among the warm starts: its dynamic program
costs that many steps (30 s for 512 blocks on 64 stages), and parameter_minmax already
balances the same weights."""


def _legal(n: int, n_stages: int, allowed: Collection[int] | None) -> list[int]:
    """Sorted legal starts after block 0; ValueError when too few for the stages."""
    if n_stages < 1:
        raise ValueError(f"n_stages must be ≥ 1 (got {n_stages})")
    legal = sorted(set(range(1, n)) if allowed is None else {j for j in allowed if 0 < j < n})
    if n_stages - 1 > len(legal):
        raise ValueError(
            f"{n_stages} stages need {n_stages - 1} split points but only {len(legal)} are "
            f"allowed among {n} blocks: use at most {len(legal) + 1} stages"
        )
    return legal


def _snap(targets: Sequence[float], n: int, allowed: Collection[int] | None) -> tuple[int, ...]:
    """Move each target split (S − 1 of them) to the nearest legal start, keeping order.

    Split k may use legal positions k−1 .. len(legal) − (S − 1 − k) (0-based), so
    every later split still finds one; ties go to the earlier position.
    """
    S = len(targets) + 1
    legal = _legal(n, S, allowed)
    starts, lo = [0], 0
    for k, t in enumerate(targets):
        hi = len(legal) - (S - 1 - k)  # last usable index for split k
        i = min(max(bisect.bisect_left(legal, t), lo), hi)
        if i > lo and abs(legal[i - 1] - t) <= abs(legal[i] - t):
            i -= 1
        starts.append(legal[i])
        lo = i + 1
    return tuple(starts)


def uniform(
    n_blocks: int, n_stages: int, allowed: Collection[int] | None = None
) -> tuple[int, ...]:
    """Equal block counts: the default split of torchtitan and PiPPy-style tools.

    The first ``n_blocks % n_stages`` stages take one extra block.

    Example::

        uniform(10, 4)   # (0, 3, 6, 8): 3, 3, 2, 2 blocks

    Raises:
        ValueError: more stages than blocks or allowed split points.
    """
    _legal(n_blocks, n_stages, allowed)
    base, extra = divmod(n_blocks, n_stages)
    targets = [k * base + min(k, extra) for k in range(1, n_stages)]
    return _snap(targets, n_blocks, allowed)


def _covers(prefix: list[float], pos: list[int], limit: float) -> list[float]:
    """need[a]: fewest stages covering positions pos[a]..pos[-1] with sums ≤ limit."""
    K = len(pos) - 1
    need = [0.0] * (K + 1)
    b = K
    for a in range(K - 1, -1, -1):  # farthest reach from a: non-decreasing in a
        while prefix[pos[b]] - prefix[pos[a]] > limit:
            b -= 1
        need[a] = math.inf if b == a else 1 + need[b]
    return need


def parameter_minmax(
    param_counts: Sequence[float], n_stages: int, allowed: Collection[int] | None = None
) -> tuple[int, ...]:
    """The least possible largest per-stage parameter count.

    Exact: binary search over the candidate stage sums with a greedy cover
    test; among the optimal splits it fills earlier stages first. (Not what
    DeepSpeed's released partitioner computes: see :func:`deepspeed_balanced`.)

    Example::

        parameter_minmax([4, 1, 1, 1, 1, 4], 3)   # (0, 1, 5): stages hold 4, 4, 4

    Raises:
        ValueError: more stages than blocks or allowed split points.
    """
    n = len(param_counts)
    if any(not x >= 0 for x in param_counts):
        raise ValueError("param_counts must be numbers ≥ 0")
    legal = _legal(n, n_stages, allowed)
    pos = [0, *legal, n]
    prefix = [0.0]
    for x in param_counts:
        prefix.append(prefix[-1] + float(x))
    K = len(pos) - 1
    sums = sorted({prefix[pos[b]] - prefix[pos[a]] for a in range(K) for b in range(a + 1, K + 1)})
    lo, hi = 0, len(sums) - 1  # sums[hi] (everything on one stage) always covers
    while lo < hi:
        mid = (lo + hi) // 2
        if _covers(prefix, pos, sums[mid])[0] <= n_stages:
            hi = mid
        else:
            lo = mid + 1
    limit = sums[lo]
    need = _covers(prefix, pos, limit)
    idx = [0]
    for t in range(n_stages - 1):  # take the farthest end that leaves the rest coverable
        left = n_stages - 1 - t
        b = K - left
        while prefix[pos[b]] - prefix[pos[idx[-1]]] > limit or need[b] > left:
            b -= 1
        assert b > idx[-1], "the cover test guarantees room for the remaining stages"
        idx.append(b)
    return tuple(pos[a] for a in idx)


def deepspeed_balanced(
    weights: Sequence[float], n_stages: int, allowed: Collection[int] | None = None
) -> tuple[int, ...]:
    """DeepSpeed's ``PipelineModule(partition_method="parameters")`` split.

    DeepSpeed (0.19.8) weighs each layer by its trainable parameter count and
    runs ``runtime.utils.partition_balanced``: a dynamic program over "the
    first i blocks on j stages" that keeps, per state, the one split with the
    least (largest − smallest stage sum), ties to the later split. That is its
    objective (the spread of the stages, not the largest one), and the DP is
    greedy in it (one split per state), so it need not find the least spread.
    Reproduced here with its tie-breaks; splits at illegal points are moved to
    the nearest legal starts. With fewer blocks than stages DeepSpeed gives
    empty stages; this raises instead.

    Example::

        deepspeed_balanced([1, 2, 3, 4, 5, 6], 3)   # (0, 3, 5): 6, 9, 6 (DeepSpeed: [0, 3, 5, 6])

    Raises:
        ValueError: more stages than blocks or allowed split points, a negative weight.
    """
    n, m = len(weights), n_stages
    if any(not x >= 0 for x in weights):
        raise ValueError("weights must be numbers ≥ 0")
    _legal(n, m, allowed)
    inf = math.inf
    prefix = [0.0, *itertools.accumulate(float(x) for x in weights)]
    top = [[inf] * (m + 1) for _ in range(n + 1)]
    low = [[inf] * (m + 1) for _ in range(n + 1)]
    spread = [[inf] * (m + 1) for _ in range(n + 1)]
    cut = [[0] * (m + 1) for _ in range(n + 1)]
    top[0][0] = spread[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi, lo = max(top[k][j - 1], part), min(low[k][j - 1], part)
                if spread[i][j] >= hi - lo:  # ">=": the later split wins a tie, as released
                    spread[i][j], top[i][j], low[i][j], cut[i][j] = hi - lo, hi, lo, k
    ends = [n]
    for j in range(m, 0, -1):
        ends.append(cut[ends[-1]][j])
    starts = tuple(reversed(ends[1:]))
    legal = set(range(1, n)) if allowed is None else set(allowed)
    if (
        starts[0] == 0
        and all(x < y for x, y in itertools.pairwise(starts))
        and set(starts[1:]) <= legal
    ):
        return starts
    return _snap(list(starts[1:]), n, allowed)


def _torchgpipe_blockpartition(sequence: Sequence[float], partitions: int) -> list[int]:
    """torchgpipe's ``balance.blockpartition.solve``, returning block counts.

    The "Block partitions of sequences" heuristic (Bárány & Grinberg): start
    from equal counts, then repeatedly move one element from the block next
    to the lightest block towards the heaviest, until heaviest ≤ lightest + 1
    in units where the largest element is 1. Reproduced with torchgpipe's
    tie-breaks (heaviest: last index; lightest: first index). One guard it
    lacks: it stops instead of moving an element out of an empty block.
    """
    n = len(sequence)
    lo = min(sequence)
    span = max(sequence) - lo
    normal = [0.0 if span == 0 else (x - lo) / span for x in sequence]
    splits = [n // partitions * (x + 1) for x in range(partitions - 1)] + [n]

    def size(i: int) -> float:
        return sum(normal[splits[i - 1] if i > 0 else 0 : splits[i]])

    def board() -> list[tuple[float, int]]:
        return [(size(i), i) for i in range(partitions)]

    for _ in range(10 * n * n * partitions + 10):  # the paper proves termination
        max_size, p = max(board())
        while True:
            min_size, q = min(board())
            if max_size <= min_size + 1:
                return _counts(splits)
            h = q - 1 if p < q else q + 1
            if splits[h] == (splits[h - 1] if h > 0 else 0):
                return _counts(splits)
            if p < q:
                splits[h] -= 1
            else:
                splits[q] += 1
            if p == h:
                break
    return _counts(splits)


def _counts(splits: list[int]) -> list[int]:
    return [b - a for a, b in itertools.pairwise([0, *splits])]


def time_balanced(
    times: Sequence[float], n_stages: int, allowed: Collection[int] | None = None
) -> tuple[int, ...]:
    """torchgpipe's ``balance_by_time`` split of per-block times.

    Runs torchgpipe's block-partition heuristic on the times (not guaranteed
    to minimise the slowest stage). Empty stages it may leave, and splits at
    illegal points, are moved to the nearest legal distinct starts.

    Example::

        time_balanced([1, 1, 1, 1, 1, 1, 1, 1], 4)   # (0, 2, 4, 6)

    Raises:
        ValueError: more stages than blocks or allowed split points.
    """
    n = len(times)
    _legal(n, n_stages, allowed)
    counts = _torchgpipe_blockpartition(times, n_stages)
    targets, at = [], 0
    for k in counts[:-1]:
        at += k
        targets.append(at)
    starts = (0, *targets)
    legal = set(range(1, n)) if allowed is None else set(allowed)
    if all(x < y for x, y in itertools.pairwise(starts)) and set(targets) <= legal:
        return starts
    return _snap(targets, n, allowed)


def warm_starts(
    params: Sequence[float], works: Sequence[float], n_stages: int, allowed: Collection[int] | None
) -> Iterator[tuple[int, ...]]:
    """The partitioners' placements of ``n_stages`` stages (those with a stage each, each
    once), each made when asked for: uniform, parameter-balanced, DeepSpeed's (where
    cheap: ``DEEPSPEED_SEED_WORK``), time-balanced. The step solver's warm starts."""
    n = len(params)
    makers: list[Callable[[], Sequence[int]]] = [
        lambda: uniform(n, n_stages, allowed),
        lambda: parameter_minmax(params, n_stages, allowed),
    ]
    if n * n * n_stages <= DEEPSPEED_SEED_WORK:
        makers.append(lambda: deepspeed_balanced(params, n_stages, allowed))
    makers.append(lambda: time_balanced(works, n_stages, allowed))
    seen: set[tuple[int, ...]] = set()
    for make in makers:
        seed = tuple(make())
        if len(seed) == n_stages and seed not in seen:
            seen.add(seed)
            yield seed
