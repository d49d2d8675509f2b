"""The timed rounds' summary: medians of kept rounds, and the split check taken like with like."""

from __future__ import annotations

import statistics

import pytest

from planner.plan.records import BlockCost, ModelProfile, SplitCheck
from planner.profile.rounds import RoundTimes, kept_rounds, summarise
from planner.report.profile_table import check_line

NO_HARNESS = (0.0, 0.0)


def _loaded_rounds() -> RoundTimes:
    """Three 1 ms blocks (forward; backward 2 ms) and a whole model of the same work.

    Another process doubles some readings: each block in 3 of the 10 rounds (its
    median never sees it), the whole model in 7 of them (its median does).
    """
    rounds, blocks = 10, 3
    times = RoundTimes.empty(blocks)
    for r in range(rounds):
        for k in range(blocks):
            slow = 2.0 if (r + k) % 10 < 3 else 1.0
            times.fwd[k].append(1.0 * slow)
            times.bwd[k].append(2.0 * slow)
        slow = 2.0 if r < 7 else 1.0
        times.whole_f.append(3.0 * slow)
        times.whole_b.append(6.0 * slow)
    return times


def test_the_check_sets_like_against_like_where_medians_disagree() -> None:
    times = _loaded_rounds()
    got = summarise(times, [0.0] * 10, NO_HARNESS)
    # Per block, the medians are the undisturbed figures...
    assert got.fwd_ms == [1.0, 1.0, 1.0] and got.bwd_ms == [2.0, 2.0, 2.0]
    # ...and Σ of them against the whole model's median would say −50 %.
    assert sum(got.fwd_ms) + sum(got.bwd_ms) == pytest.approx(0.5 * sum(got.whole_ms))
    # The check takes each total's least disturbed round: the same work, 0 %.
    assert got.check.blocks_ms == pytest.approx(9.0)
    assert got.check.whole_ms == pytest.approx(9.0)
    assert got.check.error == pytest.approx(0.0)
    assert got.check.judged and got.check.kept == 10 and got.check.quiet == 10


def test_a_real_split_distortion_is_still_seen() -> None:
    times = _loaded_rounds()
    times.whole_f = [x * 0.8 for x in times.whole_f]  # unsplit forward 20 % faster
    times.whole_b = [x * 0.8 for x in times.whole_b]
    check = summarise(times, [0.0] * 10, NO_HARNESS).check
    assert check.error == pytest.approx(1 / 0.8 - 1)


def test_the_harness_cost_comes_off_the_blocks_in_the_check_too() -> None:
    times = _loaded_rounds()
    times.fwd = [[x + 0.1 for x in xs] for xs in times.fwd]
    check = summarise(times, [0.0] * 10, (0.1, 0.0)).check
    assert check.error == pytest.approx(0.0)


def test_the_loss_counts_on_both_sides() -> None:
    times = _loaded_rounds()
    times.loss_f, times.loss_b = [0.5] * 10, [0.25] * 10
    got = summarise(times, [0.0] * 10, NO_HARNESS)
    assert got.loss_ms == (0.5, 0.25)
    assert got.check.blocks_ms == pytest.approx(9.75)
    assert got.check.whole_ms == pytest.approx(9.75)


def test_a_busy_machine_keeps_the_least_loaded_half_and_is_not_judged() -> None:
    shares = [0.5, 0.3, 0.9, 0.4, 0.6, 0.2, 0.7, 0.8, 0.35, 0.45]
    assert kept_rounds(shares) == [1, 3, 5, 8, 9]
    got = summarise(_loaded_rounds(), shares, NO_HARNESS)
    assert got.repeats == 5 and got.check.kept == 5 and got.check.quiet == 0
    assert not got.check.judged
    assert got.check.load_share == pytest.approx(statistics.median(shares))
    assert got.load_note and "0 of 10 timed rounds were quiet" in got.load_note
    assert "the times are medians of 5" in got.load_note


def test_quiet_rounds_alone_are_kept_when_there_are_enough() -> None:
    shares = [0.5, 0.0, 0.02, 0.0, 0.6, 0.0, 0.0, 0.0, 0.0, 0.0]
    got = summarise(_loaded_rounds(), shares, NO_HARNESS)
    assert got.repeats == 8 and got.check.quiet == 8 and got.check.judged
    assert got.load_note and "8 of 10" in got.load_note


def _profile(check: SplitCheck | None, fwd_extra: float = 0.0) -> ModelProfile:
    block = BlockCost(
        index=0,
        name="",
        modules=(),
        fwd_ms=3.0 + fwd_extra,
        bwd_ms=6.0,
        param_bytes=0,
        activation_bytes=0,
        output_bytes=0,
        boundary_bytes=0,
    )
    return ModelProfile(
        fingerprint="f",
        source="measured",
        device="cpu",
        batch_size=1,
        dtype="fp32",
        threads=1,
        capture="export",
        blocks=(block,),
        whole_fwd_ms=3.0,
        whole_bwd_ms=6.0,
        split_check=check,
    )


def test_the_check_line_compares_the_rounds_totals_not_the_blocks_times() -> None:
    # The blocks' forward times (5 ms) are not what the check compares: the rounds' are.
    check = SplitCheck(blocks_ms=9.0, whole_ms=9.3, rounds=10, kept=10, quiet=10)
    line = check_line(_profile(check, fwd_extra=2.0))
    assert "-3.2%" in line and "within ±10%" in line and "fastest of 10 quiet rounds" in line


def test_the_check_line_says_when_the_machine_was_too_busy_to_judge() -> None:
    check = SplitCheck(blocks_ms=6.0, whole_ms=9.0, rounds=20, kept=10, quiet=1, load_share=0.4)
    line = check_line(_profile(check))
    assert line.startswith("check: not judged: machine busy (1 of 20 timed rounds quiet")
    assert "40% of the cores" in line and "-33.3%" in line and "OUTSIDE" not in line


def test_an_older_profile_without_the_record_is_checked_as_before() -> None:
    line = check_line(_profile(None, fwd_extra=2.0))
    assert "+22.2%" in line and "OUTSIDE ±10%" in line


def test_the_record_round_trips() -> None:
    prof = _profile(SplitCheck(blocks_ms=9.0, whole_ms=9.3, rounds=10, kept=10, quiet=10))
    again = ModelProfile.from_dict(prof.to_dict())
    assert again == prof
    older = prof.to_dict()
    del older["split_check"]
    assert ModelProfile.from_dict(older).split_check is None


def _with_block_charge(times: RoundTimes, f: float, b: float) -> RoundTimes:
    times.fwd = [[x + f for x in xs] for xs in times.fwd]
    times.bwd = [[x + b for x in xs] for xs in times.bwd]
    return times


def test_what_a_block_alone_pays_beyond_the_whole_graph_is_taken_off() -> None:
    times = _with_block_charge(_loaded_rounds(), 0.1, 0.2)  # 3 blocks: Σ +0.9 ms
    got = summarise(times, [0.0] * 10, NO_HARNESS)
    assert got.fwd_ms == pytest.approx([1.0] * 3) and got.bwd_ms == pytest.approx([2.0] * 3)
    assert got.check.error == pytest.approx(0.9 / 9.0)  # the check reports the raw readings
    assert got.check.charge_ms == pytest.approx(0.3)
    line = check_line(_profile(got.check))
    assert "300 µs a block that a stage does not pay taken off every block" in line


def test_no_charge_when_blocks_are_faster_or_the_machine_was_busy() -> None:
    faster = _with_block_charge(_loaded_rounds(), -0.1, 0.0)
    got = summarise(faster, [0.0] * 10, NO_HARNESS)
    assert got.check.charge_ms == 0.0 and got.fwd_ms == pytest.approx([0.9] * 3)
    busy = summarise(_with_block_charge(_loaded_rounds(), 0.1, 0.2), [0.5] * 10, NO_HARNESS)
    assert busy.check.charge_ms == 0.0 and busy.fwd_ms[1:] == pytest.approx([1.1] * 2)
    assert "taken off" not in check_line(_profile(busy.check))


def test_a_block_is_never_priced_below_a_tenth_of_its_reading() -> None:
    times = _loaded_rounds()
    times.whole_f = [0.0] * 10  # an absurd whole: every block's forward would vanish
    got = summarise(times, [0.0] * 10, NO_HARNESS)
    assert got.fwd_ms == pytest.approx([0.1] * 3)
