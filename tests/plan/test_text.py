"""The short forms shared by messages and tables, and the one error convention."""

from __future__ import annotations

import math

import pytest

from planner.plan.text import ERROR_CONVENTION, few, first_line, fmt_error, fmt_ranks, rel_error


def test_errors_are_predicted_minus_measured_over_measured() -> None:
    assert ERROR_CONVENTION == "error = (predicted − measured) / measured"
    assert rel_error(110.0, 100.0) == pytest.approx(0.10)  # predicted slower than it ran
    assert rel_error(80.0, 100.0) == pytest.approx(-0.20)  # it ran slower than predicted
    assert fmt_error(80.0, 100.0) == "-20%" and fmt_error(110.0, 100.0, 1) == "+10.0%"
    for predicted, measured in ((1.0, 0.0), (1.0, -1.0), (1.0, math.nan), (math.nan, 1.0)):
        assert math.isnan(rel_error(predicted, measured))
        assert fmt_error(predicted, measured) == "—"


def test_short_forms() -> None:
    assert first_line("\n  what went wrong\n  why\n") == "what went wrong"
    assert few(["a", "b", "c"], 2) == "a, b (+1 more)"
    assert fmt_ranks(range(8)) == "0–7" and fmt_ranks([0, 4]) == "0,4"
    assert fmt_ranks(range(0, 16, 2)) == "0,2,…,14"
