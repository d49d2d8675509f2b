"""The benchmarks' pure parts: ratios and geometric means, the scaling table, the orchestrator.

No benchmark runs here: sections are stubbed.
"""

from __future__ import annotations

import json
import math
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from repo import ROOT

# bench/ is a package of the repository, not of the installed distribution.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


import bench.__main__ as orchestrator
from bench import bench_plan, bench_scaling
from bench._common import knobs


def _row(
    cluster: str, ratios: dict[str, tuple[float | None, float | None]], pp: int = 2
) -> dict[str, Any]:
    return {
        "example": "x",
        "cluster": cluster,
        "ours": {"pp": pp},
        "baselines": {
            b: {"at_ours": {"ratio": ours}, "at_best": {"ratio": best}}
            for b, (ours, best) in ratios.items()
        },
    }


def test_geomean() -> None:
    assert bench_plan.geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert bench_plan.geomean([]) is None
    with pytest.raises(ValueError, match="positive"):
        bench_plan.geomean([1.0, 0.0])


def test_summary_counts_does_not_fit_and_errors_apart() -> None:
    rows = [
        _row(
            "a",
            {"uniform": (2.0, 1.5), "deepspeed_balanced": (None, None), "time_balanced": (1, 1)},
        ),
        _row(
            "a",
            {"uniform": (8.0, 1.5), "deepspeed_balanced": (1.0, 1.0), "time_balanced": (1, 1)},
        ),
        _row(
            "b",
            {"uniform": (1.0, 1.0), "deepspeed_balanced": (3.0, 0.9), "time_balanced": (1, 1)},
        ),
        _row("b", dict.fromkeys(bench_plan.BASELINES, (1.0, 1.0)), pp=1),
        {"example": "y", "cluster": "b", "error": "AssertionError: boom"},
    ]
    s = bench_plan.summarize(rows)
    uni = s["by_cluster"]["a"]["uniform"]
    assert uni["at_ours"]["geomean"] == pytest.approx(4.0)  # √(2·8)
    assert uni["at_best"]["geomean"] == pytest.approx(1.5)
    assert (uni["at_ours"]["worst"], uni["at_ours"]["best"]) == (2.0, 8.0)
    pb = s["by_cluster"]["a"]["deepspeed_balanced"]["at_ours"]
    assert (pb["rows"], pb["does_not_fit"], pb["geomean"]) == (1, 1, 1.0)
    assert s["by_baseline"]["deepspeed_balanced"]["at_best"]["worst"] == 0.9  # ours lost there
    piped = [2.0, 1.0, 8.0, 1.0, 1.0, 1.0, 3.0, 1.0]  # the None left out
    assert s["pipelined"]["at_ours"]["geomean"] == pytest.approx(
        math.exp(sum(map(math.log, piped)) / len(piped))
    )
    everything = [*piped, 1.0, 1.0, 1.0]  # and the pure data-parallel row
    assert s["overall"]["at_ours"]["geomean"] == pytest.approx(
        math.exp(sum(map(math.log, everything)) / len(everything))
    )
    assert s["pure_dp_rows"] == 1
    assert s["overall"]["at_ours"]["does_not_fit"] == 1
    assert s["errors"] == ["y on b: AssertionError: boom"]
    table = bench_plan.format_summary(s)
    assert "| a | 4.000 | 1.500 | 1.000 (1 n/f) |" in table
    assert "planner failed: y on b" in table


def test_a_baseline_that_never_fits_reads_does_not_fit() -> None:
    rows = [_row("a", dict.fromkeys(bench_plan.BASELINES, (None, None)))]
    s = bench_plan.summarize(rows)
    assert s["overall"]["at_best"] == {
        "geomean": None,
        "rows": 0,
        "does_not_fit": 3,
        "worst": None,
        "best": None,
    }
    assert "does not fit" in bench_plan.format_summary(s)


def test_knobs_restore_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_KNOB_A", "old")
    monkeypatch.delenv("BENCH_KNOB_B", raising=False)
    import os

    with knobs({"BENCH_KNOB_A": "1", "BENCH_KNOB_B": "2"}):
        assert (os.environ["BENCH_KNOB_A"], os.environ["BENCH_KNOB_B"]) == ("1", "2")
    assert os.environ["BENCH_KNOB_A"] == "old"
    assert "BENCH_KNOB_B" not in os.environ


@dataclass
class _Sol:
    status: str
    gap: float | None
    n_segments: int = 10
    bound: float | None = None


def test_scaling_grid_and_proof_record() -> None:
    assert bench_scaling.grid(True) == [
        (32, 16),
        (128, 16),
        (512, 16),
        (64, 8),
        (64, 64),
        (64, 512),
    ]
    assert len(bench_scaling.grid(False)) == len(bench_scaling.BLOCKS) * len(bench_scaling.DEVICES)
    assert bench_scaling.solve_record([_Sol("optimal", 0.0)] * 2)["proven"]
    # ruled out by the ceiling (its bound reaches the chosen step): a proof, counted apart
    pruned = _Sol("bounded", 0.1, 5, bound=12.0)
    assert bench_scaling.solve_record([_Sol("optimal", 0.0), pruned], 12.0)["proven"]
    assert not bench_scaling.solve_record([_Sol("optimal", 0.0), pruned], 12.5)["proven"]
    rec = bench_scaling.solve_record(
        [
            _Sol("optimal", 0.0),
            _Sol("time_limit", 0.02, 50),
            _Sol("heuristic", 0.01),
            _Sol("bounded", 0.3, bound=20.0),
        ],
        15.0,
    )
    assert rec == {
        "solves": 4,
        "optimal": 1,
        "proven_slower": 1,
        "not_proven": 2,
        "proven": False,
        "time_limit_hit": 1,
        "worst_gap": 0.02,
        "max_segments": 50,
    }
    row = {
        "blocks": 32,
        "devices": 8,
        "solver": "cbc",
        "search_s": 1.0,
        "ilp_s": 0.5,
        "step_s": 0.4,
        "solver_s": 0.25,
        "configurations": 43,
        "candidates": {"solved": 12, "pruned": 30, "out_of_memory": 1},
        "chosen": "pp 2 × dp 4, m 64, 1f1b",
        **rec,
    }
    line = bench_scaling.format_table([row]).splitlines()[-1]
    assert line.startswith("| 32 | 8 | cbc | 1.0 | 0.5 | 0.4 | 0.2 | 43 (12 / 30 / 1) |")
    assert "2/4 not proven (gap ≤ 2.00%, 1 hit the limit)" in line


def test_timed_records_calls_that_raise() -> None:
    mod = types.SimpleNamespace(f=lambda x: 1 / x)
    with bench_scaling.timed(mod, "f") as t:
        assert mod.f(2) == 0.5
        with pytest.raises(ZeroDivisionError):
            mod.f(0)
    assert [r for _, r in t.calls] == [0.5, None]
    assert mod.f(4) == 0.25 and len(t.calls) == 2  # restored


# --------------------------------------------------------------------------- orchestrator


@pytest.fixture
def stubs(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Sections backed by stub modules: one taking argv, one reading sys.argv, one
    failing, one missing."""
    seen: dict[str, list[Any]] = {"argv": [], "sys_argv": []}

    def with_argv(argv: list[str]) -> int:
        seen["argv"].append(argv)
        return 0

    def reads_sys_argv() -> None:
        seen["sys_argv"].append(list(sys.argv))

    def fails(argv: list[str]) -> int:
        raise RuntimeError("broken bench")

    for name, main in (("_stub_a", with_argv), ("_stub_b", reads_sys_argv), ("_stub_c", fails)):
        mod = types.ModuleType(f"bench.{name}")
        mod.main = main  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, f"bench.{name}", mod)
    sections = {
        "plan": orchestrator.Section(("bench._stub_a",), 100, "stub"),
        "scaling": orchestrator.Section(("bench._stub_a", "bench._stub_b"), 0, "stub"),
        "soak": orchestrator.Section(("bench._not_written_yet",), 100, "stub"),
    }
    monkeypatch.setattr(orchestrator, "SECTIONS", sections)
    return seen


def test_one_section_gets_its_flags(stubs: dict[str, list[Any]], tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    rc = orchestrator.main(["plan", "--quick", "--clusters", "8xa100", "--summary", str(out)])
    assert rc == 0
    assert stubs["argv"] == [["--quick", "--clusters", "8xa100"]]
    record = json.loads(out.read_text())
    assert record["sections"]["plan"]["modules"][0]["status"] == "ok"
    assert record["budget_warnings"] == []


def test_all_runs_every_section_skips_missing_and_warns_over_budget(
    stubs: dict[str, list[Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s.json"
    assert orchestrator.main(["all", "--quick", "--summary", str(out)]) == 0
    assert stubs["argv"] == [["--quick"], ["--quick"]]
    assert stubs["sys_argv"] == [["bench._stub_b", "--quick"]]
    text = capsys.readouterr().out
    assert "skipped: bench._not_written_yet is not there yet" in text
    assert "budget warning: scaling took" in text  # its budget is 0 s
    record = json.loads(out.read_text())
    assert [m["status"] for m in record["sections"]["soak"]["modules"]] == ["skipped"]
    assert record["budget_warnings"][0].startswith("scaling took")


def test_a_failing_section_is_recorded_and_the_rest_still_run(
    stubs: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    sections = dict(orchestrator.SECTIONS)
    sections["plan"] = orchestrator.Section(("bench._stub_c",), 100, "stub")
    monkeypatch.setattr(orchestrator, "SECTIONS", sections)
    out = tmp_path / "s.json"
    assert orchestrator.main(["all", "--summary", str(out)]) == 1
    assert stubs["argv"] == [[]]  # scaling still ran
    plan = json.loads(out.read_text())["sections"]["plan"]["modules"][0]
    assert (plan["status"], plan["detail"]) == ("failed", "RuntimeError: broken bench")


def test_flags_for_all_are_refused(stubs: dict[str, list[Any]]) -> None:
    with pytest.raises(SystemExit):
        orchestrator.parse(["all", "--clusters", "8xa100"])
    ns, rest = orchestrator.parse(["scaling", "--limit", "5"])
    assert (ns.section, rest) == ("scaling", ["--limit", "5"])
    assert ns.summary.endswith("summary-scaling.json")


def test_budget_warnings_only_in_quick_mode(stubs: dict[str, list[Any]]) -> None:
    assert orchestrator.budget_warnings({"plan": 1e9}, quick=False) == []
    assert orchestrator.budget_warnings({"plan": 50}, quick=True) == []
    assert orchestrator.budget_warnings({"plan": 150}, quick=True) == [
        "plan took 150 s, over its --quick budget of 100 s"
    ]


def test_the_published_bubble_row_is_the_simulators_1f1b_at_the_papers_p_and_m(
    tmp_path: Path,
) -> None:
    """The zero-bubble paper's 1F1B row (p 8, m 24): without transfers the simulator gives
    the formula's (p − 1)/(m + p − 1) = 7/31, the paper's ideal 0.2258; transfers add to it."""
    from bench import bench_published

    bare, linked = bench_published.zero_bubble_row(0.0), bench_published.zero_bubble_row(0.1)
    assert bare["simulated_bubble"] == pytest.approx(7 / 31, rel=1e-9)
    assert bare["paper_ideal"] == pytest.approx(7 / 31, abs=5e-5)
    assert linked["simulated_bubble"] > bare["simulated_bubble"]
    assert bench_published.main(["--quick", "--out", str(tmp_path / "p.json")]) == 0
    record = json.loads((tmp_path / "p.json").read_text())
    assert record["zero_bubble"]["rows"][0]["simulated_bubble"] == bare["simulated_bubble"]
    assert record["torchtitan"]["rows"] == []  # --quick: the simulator only


def test_the_published_schedule_gains_are_simulated_from_torchs_orders() -> None:
    """Equal stages, no transfers: Interleaved 1F1B at pp 8, m 8 gains (15 − 11.5)/11.5 over
    1F1B (the textbook bubbles (p − 1) and (p − 1)/v); ZB-1p at p 8, m 24 a third of 1F1B's
    bubble; every gain positive, ZB-V's the largest of the paper's case."""
    from bench import bench_published

    rows = {(r["case"], r["schedule"]): r for r in bench_published.schedule_gain_rows(0.0)}
    assert rows[("torchtitan", "interleaved-1f1b")]["simulated_gain"] == pytest.approx(
        15 / 11.5 - 1
    )
    assert rows[("zero-bubble", "interleaved-zb")]["simulated_gain"] == pytest.approx(
        31 / 79 * 3 - 1
    )
    assert rows[("torchtitan", "interleaved-1f1b")]["published_gain"] == 0.28
    paper = [
        r for (case, _), r in rows.items() if case == "zero-bubble" and r["schedule"] != "1f1b"
    ]
    assert all(r["simulated_gain"] > 0 for r in paper)
    assert max(paper, key=lambda r: r["simulated_gain"])["schedule"] in ("zbv", "dualpipev")


def test_accuracy_assess_reads_a_plan_and_its_measurements() -> None:
    """``bench accuracy``'s last step, on a plan and measured figures of its shape (it had
    crashed on the stage memory record after the whole run)."""
    from models import cpu_cluster, tower_plan

    from bench.bench_accuracy import assess

    plan = tower_plan(cluster=cpu_cluster(2), pp=2, dp=1, micro_batches=4, schedule="gpipe")
    ranks = [
        {"stage": s, "peak_bytes": 1000.0 * (s + 1), "peak_at": "F", "peak_total_bytes": 2e3,
         "held_outside_stage_bytes": 0.0, "rss_bytes": 3e3, "state_bytes": 1e2,
         "ddp_bucket_bytes": 0.0, "minor_faults_per_step": 0.0}
        for s in range(plan.pp)
    ]  # fmt: skip
    meas = {
        "times": {"foreign": [0.0] * 4, "times": {"step": [0.010, 0.012, 0.011, 0.013]}},
        "ranks": ranks,
        "stages": [{"fwd_ms": 1.0, "bwd_ms": 2.0, "optimizer_ms": 0.1}] * plan.pp,
        "threads": 1,
        "recorder_step_ms": 11.0,
        "plan_load": 0.0,
    }
    case = {"name": "tower-2-1-4", "example": "tower", "config": (2, 1, 4)}
    row = assess(case, meas, plan)
    assert row["step_measured_ms"] == pytest.approx(11.5)
    assert row["step_error"] == pytest.approx(plan.predicted.step_ms / 11.5 - 1)
    stage = row["stages"][1]
    assert stage["memory_measured_bytes"] == 2000.0
    # The results file's figures keep 6 significant digits (planner.plan.fields.FIGURE).
    total = plan.stages[1].memory.total
    assert stage["memory_breakdown_predicted"]["total"] == pytest.approx(total, rel=1e-5)


def test_scaling_plans_the_gpt_example_on_single_device_nodes() -> None:
    """``bench_scaling --nodes N``'s case, end to end on 40 nodes: a plan, timed, with its
    peak memory and the configurations it recorded."""
    rec = bench_scaling.nodes_end_to_end(40, "highs", 10.0)
    assert rec["devices"] == 40 and rec["solver"] == "highs"
    assert 0 < rec["total_s"] < 300 and 50 < rec["peak_rss_mib"] < 4096
    assert rec["chosen"].startswith("pp ") and rec["step_ms"] > 0
    assert rec["candidates_recorded"]["chosen"] == 1
