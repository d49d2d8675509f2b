"""Search: pins, pruning, candidates and the errors a user sees."""

from __future__ import annotations

from dataclasses import replace

import pytest
from models import chain_profiles

from planner.devices import from_gpus
from planner.options import SearchOptions, Training
from planner.search import layouts, search

GIB = 2**30


def _search(devices=8, batch=32, n_blocks=12, device="h100", **opts):
    cluster = from_gpus(devices, device)
    return search(
        chain_profiles(n_blocks),
        cluster,
        Training(global_batch=batch),
        SearchOptions(**opts),
        n_blocks=n_blocks,
    )


def test_search_finds_a_plan_and_explains_the_candidates() -> None:
    res = _search()
    lay = res.layout
    assert lay.pp * lay.dp == 8
    assert res.solution.status == "optimal"
    statuses = {c.status for c in res.candidates}
    assert "chosen" in statuses and ({"slower", "pruned"} & statuses)
    chosen = [c for c in res.candidates if c.status == "chosen"]
    assert len(chosen) == 1 and chosen[0].step_ms == pytest.approx(res.prediction.step_ms)
    for c in res.candidates:
        if c.status == "slower":
            assert c.step_ms is not None and c.step_ms >= res.prediction.step_ms
            assert "%" in c.reason
        if c.status == "pruned":
            assert "lower bound" in c.reason
    # Ranked: the solved ones fastest first, then those without a step.
    steps = [c.step_ms for c in res.candidates]
    solved = [s for s in steps if s is not None]
    assert solved == sorted(solved) and steps[: len(solved)] == solved


def test_pins_are_respected() -> None:
    res = _search(pp=4, micro_batches=8, schedule="1f1b")
    assert (res.layout.pp, res.layout.dp, res.layout.micro_batches, res.layout.schedule) == (
        4,
        2,
        8,
        "1f1b",
    )
    assert all(c.pp == 4 and c.micro_batches == 8 for c in res.candidates)


def test_batch_not_divisible_prints_the_arithmetic() -> None:
    with pytest.raises(ValueError) as err:
        _search(batch=30, dp=8)
    assert "batch 30 not divisible by dp 8" in str(err.value)
    assert "Fix:" in str(err.value)
    with pytest.raises(ValueError, match=r"replica batch 15 .* not divisible by 4 micro-batches"):
        _search(batch=30, pp=4, dp=2, micro_batches=4)


def test_more_stages_than_blocks_quotes_both_numbers() -> None:
    with pytest.raises(ValueError, match="pp 8 > 4"):
        _search(n_blocks=4, pp=8)


def test_out_of_memory_everywhere_names_stages_and_fix() -> None:
    small = from_gpus(2, "l4")  # 22.5 GiB each
    big = chain_profiles(n_blocks=4, param_bytes=8 * GIB)  # 2 Gi params a block: 32 GiB of state
    with pytest.raises(ValueError) as err:
        search(big, small, Training(global_batch=8), SearchOptions(), n_blocks=4)
    msg = str(err.value)
    assert "no configuration fits" in msg and "GiB" in msg and "Fix:" in msg


def test_memory_pressure_turns_on_recompute_or_more_stages() -> None:
    profile_for = chain_profiles(n_blocks=8, param_bytes=512 * 2**20)

    def heavy(device, b):  # activations dominate
        prof = profile_for(device, b)
        return replace(
            prof,
            blocks=tuple(replace(x, activation_bytes=x.activation_bytes * 64) for x in prof.blocks),
        )

    res = search(heavy, from_gpus(4, "l4"), Training(global_batch=64), SearchOptions(), n_blocks=8)
    assert res.prediction.fits
    for st in res.prediction.stages:
        assert st.memory.total <= st.capacity


def test_layouts_for_mixed_devices_try_both_orders() -> None:
    from planner.devices import parse_cluster

    mixed = parse_cluster(
        {"nodes": [{"type": "a100-80gb", "count": 2}, {"type": "v100-32gb", "count": 2}]}
    )
    names = [name for name, _ in layouts(mixed, 2, 2)]
    assert "replicas-inside" in names and "reversed replicas-inside" in names
    homo = from_gpus(4, "h100")
    assert len(layouts(homo, 2, 2)) == 1


def test_layouts_that_differ_only_by_node_names_are_one() -> None:
    """Single-device nodes: every link crosses nodes in both layouts (they cost the same;
    10,000 such nodes solved each configuration twice). Two nodes of two: they differ."""
    from planner.devices import parse_cluster

    singles = parse_cluster({"nodes": [{"type": "h100", "count": 1, "repeat": 6}]})
    assert [name for name, _ in layouts(singles, 2, 3)] == ["pipeline-inside"]
    pairs = parse_cluster({"nodes": [{"type": "h100", "count": 2, "repeat": 2}]})
    assert [name for name, _ in layouts(pairs, 2, 2)] == ["pipeline-inside", "replicas-inside"]


# ---------------------------------------------------------------- several stages per rank


def test_the_default_search_keeps_one_stage_per_rank() -> None:
    res = _search()
    assert res.layout.virtual == 1
    assert {c.virtual for c in res.candidates} == {1}
    assert {c.schedule for c in res.candidates} <= {"gpipe", "1f1b"}


def test_interleaved_is_searched_when_asked_and_its_memory_is_per_rank() -> None:
    """pp 2 × v 2 pinned: four stages, stage i on rank i mod 2, each rank's two stages
    summed against its device; the simulated step beats 1F1B's at the same pp and m."""
    res = _search(devices=2, batch=8, pp=2, micro_batches=8, schedule="interleaved-1f1b", virtual=2)
    lay, pred = res.layout, res.prediction
    assert (lay.pp, lay.virtual, lay.n_stages, lay.schedule) == (2, 2, 4, "interleaved-1f1b")
    assert pred.stage_ranks == (0, 1, 0, 1)
    totals = [sum(st.memory.total for st in pred.stages if st.index % 2 == k) for k in (0, 1)]
    assert pred.rank_memory == pytest.approx(tuple(totals))
    assert pred.fits and res.solution.step == pytest.approx(pred.step_ms)
    assert res.solution.bound <= pred.step_ms
    one = _search(devices=2, batch=8, pp=2, micro_batches=8, schedule="1f1b")
    assert pred.step_ms < one.prediction.step_ms  # the bubble shrinks with v


def test_max_virtual_adds_the_multi_stage_schedules_to_the_search() -> None:
    from planner.search.schedules import schedules

    res = _search(devices=4, batch=16, pp=4, max_virtual=2, robust_band_pct=0)
    kinds = {(c.schedule, c.virtual) for c in res.candidates}
    assert {("interleaved-1f1b", 2), ("looped-bfs", 2), ("1f1b", 1)} <= kinds
    assert {("interleaved-zb", 1), ("interleaved-zb", 2), ("zbv", 2)} <= kinds
    best = min(c.step_ms for c in res.candidates if c.step_ms is not None)
    assert res.prediction.step_ms == pytest.approx(best)
    # What each (pp, dp, m) tries: ZB-1p is Interleaved ZB at v 1; ZB-V and DualPipeV
    # run exactly two stages per rank; none of them unless asked.
    tried = {(s, v) for *_, s, v in schedules(4, 1, 8, SearchOptions(max_virtual=3), [], 12)}
    several = {(s, v) for s in ("interleaved-1f1b", "looped-bfs", "interleaved-zb") for v in (2, 3)}
    assert tried == {("gpipe", 1), ("1f1b", 1), ("interleaved-zb", 1), ("zbv", 2),
                     ("dualpipev", 2)} | several  # fmt: skip
    assert {(s, v) for *_, s, v in schedules(4, 1, 8, SearchOptions(), [], 12)} == {
        ("gpipe", 1),
        ("1f1b", 1),
    }


def test_two_stages_that_fit_alone_but_not_together_are_refused() -> None:
    """Each stage of a rank fits its device, the two together do not: no plan."""
    cluster = from_gpus(2, "h100")
    n, cap = 8, cluster.devices[0].device.memory_bytes
    # A block: weights, gradients and Adam's two moments, a third of a device: a stage of
    # two blocks fits, and a rank holds at least four of the eight (two stages).
    profiles = chain_profiles(n, param_bytes=int(cap // 12), heavy_ends=False)
    with pytest.raises(ValueError, match="together"):
        search(
            profiles, cluster, Training(global_batch=8),
            SearchOptions(pp=2, micro_batches=8, schedule="interleaved-1f1b", virtual=2),
            n_blocks=n,
        )  # fmt: skip


def test_a_one_stage_schedule_with_virtual_stages_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="virtual-stages 1"):
        _search(devices=2, batch=8, pp=2, schedule="1f1b", virtual=2)
