"""bench_schedules: torchtitan's default as the benchmark prices it, and the summary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from bench import bench_schedules as bs


@dataclass
class _Pred:
    step_ms: float
    fits: bool


def test_torchtitans_default_is_its_even_interleaved_split_at_m_equal_pp() -> None:
    from planner.devices import from_gpus
    from planner.plan.schedule import stage_ranks

    cluster = from_gpus(8, "h100")
    seen: list[tuple[Any, tuple[int, ...]]] = []

    class _Cost:
        def __init__(self, lay: Any) -> None:
            self.lay = lay

        def predict(self, starts: tuple[int, ...]) -> _Pred:
            seen.append((self.lay, starts))
            pp = self.lay.pp
            return _Pred(step_ms=100.0 / pp, fits=pp >= 4)  # pp 2 does not fit memory

    # batch 24: dp·pp = 8 divides it at every pp, m = pp; 12 blocks: pp 8 × 2 stages > 12
    got = bs.titan_default(_Cost, cluster, 24, 12, [2, 4, 8])
    assert sorted(got) == [2, 4]
    assert got[2][1] is False and got[4] == (25.0, True, got[4][2])
    assert got[4][2].startswith("pp 4 × dp 2, m 4, v 2, ")  # no schedule: it is always one
    for lay, starts in seen:
        assert lay.schedule == "interleaved-1f1b" and lay.virtual == 2
        assert lay.micro_batches == lay.pp and lay.dp == 8 // lay.pp
        assert lay.dp_mode == "fsdp"  # torchtitan's data parallelism: FSDP over the replicas
        assert len(starts) == 2 * lay.pp  # 12 blocks evenly: 6 or 3 per stage
        sizes = [b - a for a, b in zip(starts, [*starts[1:], 12], strict=True)]
        assert max(sizes) - min(sizes) <= 1
        on = stage_ranks("interleaved-1f1b", lay.pp, 2)
        assert all(lay.ranks[s] == lay.ranks[on.index(on[s])] for s in range(len(on)))
    # dp · m = 8 at every pp: a batch of 12 splits into none of them
    assert bs.titan_default(_Cost, cluster, 12, 12, [2, 4]) == {}


def test_config_text_names_the_stages_per_rank_only_when_several() -> None:
    from bench._common import config_text
    from planner.cost import Layout

    ranks = ((0, 1), (2, 3))
    one = Layout(pp=2, dp=2, micro_batches=8, schedule="1f1b", ranks=ranks)
    looped = Layout(pp=2, dp=2, micro_batches=8, schedule="looped-bfs", ranks=ranks * 2, virtual=2)
    assert config_text(one) == "pp 2 × dp 2, m 8, 1f1b"  # bench_plan's text, as before
    assert config_text(looped) == "pp 2 × dp 2, m 8, looped-bfs, v 2"
    zero1 = Layout(pp=2, dp=2, micro_batches=8, schedule="1f1b", ranks=ranks, dp_mode="zero1")
    assert config_text(zero1) == "pp 2 × dp 2, m 8, 1f1b, ZeRO-1"
    fsdp = Layout(pp=2, dp=2, micro_batches=8, schedule="1f1b", ranks=ranks, dp_mode="fsdp")
    assert config_text(fsdp) == "pp 2 × dp 2, m 8, 1f1b, FSDP"


def _row(name: str, one: float, titan: float | None, pp: int, v: int = 1) -> dict[str, Any]:
    return {
        "row": name,
        "one_stage": {"pp": pp, "step_ms": 10.0 * one, "config": "x"},
        "schedules": {
            "pp": pp,
            "virtual": v,
            "status": "optimal" if v == 1 else "time_limit",
            "step_ms": 10.0,
            "config": "y",
        },
        "ratio_one_stage": one,
        "ratio_torchtitan": titan,
        "ratio_torchtitan_at_ours": None,
    }


def test_summary_geomeans_over_pipelined_rows_and_lists_the_unproven() -> None:
    rows = [
        _row("a", 1.0, 2.0, pp=1),
        _row("b", 1.21, 1.5, pp=4, v=2),
        _row("c", 1.0, None, pp=2),
        {"row": "d", "error": "boom"},
    ]
    s = bs.summarize(rows)
    assert s["all"]["ratio_one_stage"]["geomean"] == pytest.approx((1.21) ** (1 / 3))
    assert s["pipelined"]["ratio_one_stage"]["geomean"] == pytest.approx(1.1)
    assert s["pipelined"]["ratio_torchtitan"]["rows"] == 1
    assert s["pipelined"]["ratio_torchtitan"]["missing"] == 1
    assert s["all"]["ratio_one_stage"]["worst"] == 1.0
    assert s["rows_with_several_stages_per_rank"] == 1
    assert s["not_proven"] == ["b"] and s["errors"] == ["d: boom"]
    table = bs.format_rows(rows)
    assert "| d | failed: boom |" in table and "does not fit" in table
