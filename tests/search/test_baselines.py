"""The baseline partitioners on literal inputs (DeepSpeed's and torchgpipe's as their releases
split them), and parameter_minmax against brute force."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.search.baselines import deepspeed_balanced, parameter_minmax, time_balanced, uniform


def test_uniform_gives_extra_blocks_to_the_first_stages() -> None:
    assert uniform(10, 4) == (0, 3, 6, 8)
    assert uniform(8, 4) == (0, 2, 4, 6)
    assert uniform(5, 1) == (0,)
    assert uniform(3, 3) == (0, 1, 2)


def test_uniform_snaps_to_allowed_starts() -> None:
    assert uniform(10, 4, allowed={2, 5, 9}) == (0, 2, 5, 9)
    assert uniform(12, 3, allowed={1, 5, 7, 11}) == (0, 5, 7)  # targets 4 and 8
    assert uniform(10, 3, allowed={8, 9}) == (0, 8, 9)  # both pushed to the only two


def test_parameter_minmax_literals() -> None:
    assert parameter_minmax([4, 1, 1, 1, 1, 4], 3) == (0, 1, 5)
    assert parameter_minmax([1, 1, 1, 1], 2) == (0, 2)
    assert parameter_minmax([10, 1, 1, 1], 2) == (0, 1)
    assert parameter_minmax([1, 2, 3, 4, 5], 2, allowed={1, 4}) == (0, 4)  # 10 | 5


def test_deepspeed_balanced_reproduces_deepspeed() -> None:
    # What deepspeed 0.19.8's runtime.utils.partition_balanced returned for these weights
    # (its last entry, the end, dropped). It minimises largest − smallest, greedily:
    assert deepspeed_balanced([1, 2, 3, 4, 5, 6], 3) == (0, 3, 5)  # 6 | 9 | 6, spread 3
    assert deepspeed_balanced([4, 1, 1, 1, 1, 4], 3) == (0, 1, 5)
    assert deepspeed_balanced([10, 1, 1, 1], 2) == (0, 1)
    assert deepspeed_balanced([0, 5, 0, 5, 0, 5, 0], 3) == (0, 3, 5)
    assert deepspeed_balanced([3, 3, 3, 3, 3, 3, 3, 3, 100], 4) == (0, 3, 6, 8)
    assert deepspeed_balanced([1, 2, 3, 4, 5], 2, allowed={1, 4}) == (0, 4)
    # ... which need not be the least largest stage: 8 | 8 | 14 (spread 6) against
    # 13 | 12 | 5 (spread 8).
    weights = [8, 1, 4, 3, 9, 3, 2]
    assert deepspeed_balanced(weights, 3) == (0, 1, 4)
    assert parameter_minmax(weights, 3) == (0, 3, 5)


def test_time_balanced_reproduces_torchgpipe() -> None:
    # Worked through torchgpipe's blockpartition.solve by hand: see its docstring.
    assert time_balanced([1] * 8, 4) == (0, 2, 4, 6)
    assert time_balanced([1, 2, 3, 4, 5, 6, 7, 8], 3) == (0, 4, 6)
    # Times are normalised to [0, 1] first, so the seven equal blocks weigh nothing
    # and it stops at once: not optimal (0, 7) for the slowest stage.
    assert time_balanced([1, 1, 1, 1, 1, 1, 1, 10], 2) == (0, 4)


def test_too_many_stages_quotes_both_numbers() -> None:
    with pytest.raises(ValueError, match="5 stages need 4 split points but only 2 are allowed"):
        uniform(10, 5, allowed={3, 6})
    with pytest.raises(ValueError, match="4 stages need 3 split points but only 2"):
        time_balanced([1.0, 2.0, 3.0], 4)
    with pytest.raises(ValueError, match="≥ 0"):
        parameter_minmax([1.0, -1.0], 2)
    with pytest.raises(ValueError, match="≥ 0"):
        deepspeed_balanced([1.0, -1.0], 2)


def _brute_max_sum(weights: list[int], stages: int, allowed: set[int] | None) -> int:
    n = len(weights)
    legal = sorted(set(range(1, n)) if allowed is None else allowed)
    best = None
    for split in itertools.combinations(legal, stages - 1):
        b = [0, *split, n]
        worst = max(sum(weights[b[s] : b[s + 1]]) for s in range(stages))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


@st.composite
def weights_stages_allowed(draw: st.DrawFn) -> tuple[list[int], int, set[int] | None]:
    n = draw(st.integers(1, 11))
    stages = draw(st.integers(1, n))
    weights = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    allowed = None
    if draw(st.booleans()) and n > 1:
        allowed = draw(st.sets(st.integers(1, n - 1), min_size=stages - 1))
    return weights, stages, allowed


def _valid(starts: tuple[int, ...], n: int, stages: int, allowed: set[int] | None) -> bool:
    legal = set(range(1, n)) if allowed is None else allowed
    increasing = all(a < b for a, b in itertools.pairwise((*starts, n)))
    return len(starts) == stages and starts[0] == 0 and set(starts[1:]) <= legal and increasing


@settings(max_examples=300, deadline=None)
@given(weights_stages_allowed())
def test_parameter_minmax_is_optimal_for_its_objective(
    case: tuple[list[int], int, set[int] | None],
) -> None:
    weights, stages, allowed = case
    starts = parameter_minmax(weights, stages, allowed)
    assert _valid(starts, len(weights), stages, allowed)
    b = [*starts, len(weights)]
    worst = max(sum(weights[b[s] : b[s + 1]]) for s in range(stages))
    assert worst == _brute_max_sum(weights, stages, allowed)


@settings(max_examples=300, deadline=None)
@given(weights_stages_allowed())
def test_every_baseline_returns_a_valid_placement(
    case: tuple[list[int], int, set[int] | None],
) -> None:
    weights, stages, allowed = case
    n = len(weights)
    assert _valid(uniform(n, stages, allowed), n, stages, allowed)
    assert _valid(time_balanced(weights, stages, allowed), n, stages, allowed)
    assert _valid(time_balanced([w + 1 for w in weights], stages, allowed), n, stages, allowed)
