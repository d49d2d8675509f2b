"""Robust choices (planner.search.robust): the sturdiest configuration near the fastest."""

from __future__ import annotations

import pytest
from models import chain_profiles

from planner.devices import from_gpus
from planner.devices.cluster_file import parse_cluster
from planner.options import SearchOptions, Training
from planner.search import SearchResult, search
from planner.search.robust import Sturdiness, choose, explain, outranked, record
from planner.solve.step_problem import StepSolution


def _s(pp: int, dp: int, step: float, **kw: object) -> Sturdiness:
    m = kw.pop("m", 8)
    schedule = kw.pop("schedule", "1f1b")
    return Sturdiness(pp=pp, dp=dp, micro_batches=m, schedule=schedule, step_ms=step, **kw)


# The README's case: 16 stages with a 67 % bubble at 18.00 ms, 2 stages at 18.12 ms.
DEEP = _s(16, 1, 18.00, overhead=0.70, headroom=0.5, bubble=0.67)
SHALLOW = _s(2, 8, 18.12, overhead=0.10, headroom=0.4, bubble=0.06)


def _proof(step: float = 18.0, status: str = "optimal", gap: float = 0.0) -> StepSolution:
    return StepSolution(
        starts=(0,),
        step=step,
        bound=step * (1 - gap),
        gap=gap,
        status=status,  # type: ignore[arg-type]
        method="milp",
        solver="highs",
        solve_s=0.0,
        solver_s=0.0,
        n_segments=1,
        evaluated=1,
        detail="",
    )


def test_a_sturdier_configuration_within_the_band_is_chosen() -> None:
    v = choose([DEEP, SHALLOW], SearchOptions())  # default: 8 %
    assert (v.chosen, v.fastest, v.rivals, v.band_pct) == (1, 0, 1, 8.0)


def test_outside_the_band_the_fastest_is_kept() -> None:
    slow = _s(2, 8, 18.00 * 1.081, overhead=0.10, bubble=0.06)  # +8.1 %
    v = choose([DEEP, slow], SearchOptions())
    assert (v.chosen, v.fastest, v.rivals) == (0, 0, 0)
    edge = _s(2, 8, 18.00 * 1.08, overhead=0.10, bubble=0.06)  # the band's edge is inside
    assert choose([DEEP, edge], SearchOptions()).chosen == 1


def test_band_zero_keeps_the_fastest() -> None:
    v = choose([SHALLOW, DEEP], SearchOptions(robust_band_pct=0))
    assert (v.chosen, v.fastest) == (1, 1)


def test_ties_break_by_stages_then_overhead_then_headroom_then_step() -> None:
    opts = SearchOptions(robust_band_pct=10)
    fast = _s(4, 2, 100.0, overhead=0.30, headroom=0.2)
    # Fewer stages beats less overhead and more headroom.
    fewer = _s(2, 4, 105.0, overhead=0.40, headroom=0.1)
    assert choose([fast, fewer], opts).chosen == 1
    # Same stages: less overhead (in whole percent) beats more headroom.
    leaner = _s(4, 2, 104.0, m=16, overhead=0.20, headroom=0.1)
    roomier = _s(4, 2, 103.0, m=4, overhead=0.30, headroom=0.6)
    assert choose([fast, roomier, leaner], opts).chosen == 2
    # Same stages and overhead (to the percent): more headroom wins.
    near = _s(4, 2, 104.0, m=16, overhead=0.301, headroom=0.25)
    assert choose([fast, near], opts).chosen == 1
    # All equal to the percent: the faster step.
    twin = _s(4, 2, 101.0, m=16, overhead=0.302, headroom=0.201)
    assert choose([twin, fast], opts).chosen == 1


def test_within_the_band_ddp_then_zero1_then_fsdp() -> None:
    auto = SearchOptions(dp_mode="auto")
    fsdp = _s(2, 4, 100.0, dp_mode="fsdp")
    zero1 = _s(2, 4, 104.0, dp_mode="zero1", headroom=0.1)
    ddp = _s(2, 4, 107.0, dp_mode="ddp", headroom=0.05)
    assert choose([fsdp, zero1, ddp], auto).chosen == 2
    assert choose([fsdp, zero1], auto).chosen == 1
    assert fsdp.name() == "pp 2 × dp 4, m 8, 1f1b, FSDP"
    # A pinned mode keeps to it: the others are never chosen.
    assert choose([fsdp, zero1, ddp], SearchOptions(dp_mode="fsdp")).chosen == 0


def test_a_configuration_stands_for_its_fastest_layout() -> None:
    """Two layouts of one configuration: the slower one's headroom does not make it win."""
    fast = _s(2, 4, 100.0, overhead=0.2, headroom=0.1)
    other_layout = _s(2, 4, 103.0, overhead=0.2, headroom=0.9)
    v = choose([fast, other_layout], SearchOptions())
    assert (v.chosen, v.rivals) == (0, 0)


def test_pins_are_untouched() -> None:
    # pp pinned: a shallower configuration within the band is never chosen.
    deep_other = _s(16, 1, 18.5, m=32, overhead=0.65, bubble=0.6)
    v = choose([DEEP, SHALLOW, deep_other], SearchOptions(pp=16))
    assert v.chosen == 2 and v.fastest == 0  # the sturdier of the pp 16 ones
    # Everything pinned: nothing to choose, whatever the band.
    pins = SearchOptions(pp=2, dp=8, micro_batches=8, schedule="1f1b", robust_band_pct=50)
    slower_layout = _s(2, 8, 18.2, overhead=0.05, headroom=0.9)
    v = choose([SHALLOW, slower_layout], pins)
    assert (v.chosen, v.fastest, v.pinned) == (0, 0, True)
    assert "pinned" in record(v, SHALLOW, SHALLOW, _proof()).reason


def test_the_record_names_the_fastest_and_never_calls_the_choice_optimal() -> None:
    v = choose([DEEP, SHALLOW], SearchOptions())
    rec = record(v, SHALLOW, DEEP, _proof())
    assert rec.band_pct == 8.0 and rec.fastest is not None
    assert (rec.fastest.pp, rec.fastest.dp, rec.fastest.step_ms) == (16, 1, 18.0)
    assert rec.fastest.status == "optimal"
    assert rec.reason == (
        "pp 2 × dp 8, m 8, 1f1b chosen over pp 16 × dp 1, m 8, 1f1b (18.00 ms, proven optimal "
        "for that configuration): 18.12 ms, +0.7 % predicted, within the ±8 % band of the cost "
        "model's error; 2 stages instead of 16, bubble 6 % instead of 67 %"
    )
    tail = rec.reason.partition("):")[2]
    assert "optimal" not in tail  # said of the fastest only
    # A fastest that is only bounded is said to be bounded, not optimal.
    bounded = explain(SHALLOW, DEEP, 8.0, _proof(status="bounded", gap=0.02))
    assert "within 2.0 % of optimal for that configuration" in bounded
    assert "proven" not in bounded
    # The fastest kept: the band recorded, no fastest.
    kept = record(choose([DEEP, SHALLOW], SearchOptions(robust_band_pct=0)), DEEP, DEEP, _proof())
    assert kept.fastest is None and kept.band_pct == 0 and "fastest" in kept.reason


@pytest.mark.parametrize("band", [-1.0, 100.0])
def test_the_band_is_a_percentage(band: float) -> None:
    with pytest.raises(ValueError, match=r"robust_band_pct \(--robust-band\) must be"):
        SearchOptions(robust_band_pct=band)


def _search(band: float):
    # 8 H100, 1 GiB of parameters a block, batch 64: pp 4 × dp 2 is predicted fastest,
    # pp 1 × dp 8 (all-reduce heavy, no pipeline) 5.1 % slower.
    return search(
        chain_profiles(param_bytes=2**30),  # 12 blocks of 1 GiB, the ends 4× the work
        from_gpus(8, "h100"),
        Training(global_batch=64),
        SearchOptions(robust_band_pct=band),
        n_blocks=12,
    )


def test_the_search_keeps_the_sturdier_plan_and_says_what_it_gave_up() -> None:
    fastest, sturdy = _search(0.0), _search(8.0)
    assert fastest.layout.pp > 1 and sturdy.layout.pp < fastest.layout.pp
    quick = fastest.prediction.step_ms
    assert quick < sturdy.prediction.step_ms <= quick * 1.08
    rec = sturdy.choice
    assert rec is not None and rec.fastest is not None
    assert (rec.fastest.pp, rec.fastest.dp) == (fastest.layout.pp, fastest.layout.dp)
    assert rec.fastest.step_ms == pytest.approx(quick)
    assert fastest.choice is not None and fastest.choice.fastest is None
    chosen = [c for c in sturdy.candidates if c.status == "chosen"]
    assert len(chosen) == 1 and "optimal" not in chosen[0].reason
    assert "sturdiest within the ±8 % band" in chosen[0].reason
    faster = [c for c in sturdy.candidates if c.status == "faster"]
    assert faster and all(c.step_ms is not None and c.step_ms < chosen[0].step_ms for c in faster)
    # Every configuration within the band was solved, not pruned against the fastest alone.
    solved = {(c.pp, c.dp, c.micro_batches, c.schedule) for c in sturdy.candidates if c.step_ms}
    assert len(solved) > len({(c.pp, c.dp) for c in fastest.candidates if c.step_ms})


def test_an_unsolved_configuration_that_cannot_be_chosen_is_outranked() -> None:
    opts = SearchOptions()  # band 8 %
    one = _s(1, 8, 100.0)
    lost = outranked((4, 1, "ddp"), 101.0, [one], 99.0, opts)
    assert lost is not None and "cannot be chosen: lower bound 101.0 ms > the fastest 100.0" in lost
    assert "1 stage instead of 4" in lost and "none below 99.0 ms" in lost
    assert outranked((4, 1, "ddp"), 100.0, [one], 99.0, opts) is None  # may be the fastest
    assert outranked((1, 1, "zero1"), 101.0, [one], 99.0, opts) is not None  # DDP is sturdier
    assert outranked((1, 1, "ddp"), 101.0, [one], 99.0, opts) is None  # as sturdy: its figures
    # The rival must stay in the band of any fastest to come: 100 > 92 × 1.08.
    assert outranked((4, 1, "ddp"), 101.0, [one], 92.0, opts) is None
    pinned = SearchOptions(pp=4, dp=2, micro_batches=8, schedule="1f1b")
    assert outranked((4, 1, "ddp"), 101.0, [one], 99.0, pinned) is None


def test_the_search_prunes_what_cannot_be_chosen_and_chooses_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def many() -> SearchResult:  # 64 single-device nodes: the steps lie close together
        return search(
            chain_profiles(param_bytes=2**20, heavy_ends=False),
            parse_cluster({"nodes": [{"type": "h100", "count": 1, "repeat": 64}]}),
            Training(global_batch=512),
            SearchOptions(keep=100),
            n_blocks=12,
        )

    quick = many()
    lost = [c for c in quick.candidates if "cannot be chosen" in c.reason]
    assert lost and all(c.status == "pruned" and c.step_ms is None for c in lost)
    monkeypatch.setattr("planner.search.loop.outranked", lambda *a, **k: None)
    full = many()
    assert (quick.layout, quick.prediction.step_ms) == (full.layout, full.prediction.step_ms)
    assert quick.choice is not None and full.choice is not None
    assert (quick.choice.fastest, quick.choice.band_pct) == (full.choice.fastest, 8.0)
    assert "other configurations solved within its ±8 % band" in quick.choice.reason
