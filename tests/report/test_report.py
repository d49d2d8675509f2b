"""Tests for planner.report: the terminal report, the HTML page and the Chrome trace."""

from __future__ import annotations

import html
import io
import itertools
import json
import subprocess
import sys
from dataclasses import replace

import pytest
from repo import ROOT
from rich.console import Console

from planner.cost import closed_form
from planner.devices import from_gpus
from planner.plan import (
    Candidate,
    LayoutPlan,
    ModelInfo,
    Plan,
    Predicted,
    SolverRecord,
    StageMemory,
    StagePlan,
    TrainingPlan,
    load_plan,
    save_plan,
)
from planner.report import print_plan, timeline, trace_events, write_html, write_trace
from planner.report.format import fmt_ms
from planner.search.robust import Sturdiness, Verdict, record
from planner.solve.step_problem import StepSolution

GIB = 2**30
CAPACITY = 79.6 * GIB


def _memory(params_gib: float, activations_gib: float) -> StageMemory:
    m = {
        "params": params_gib * GIB,
        "grads": params_gib * GIB,
        "optimizer": 2 * params_gib * GIB,
        "buffers": 0.01 * GIB,
        "comm_buffers": params_gib * GIB,
        "tied_copies": 0.0,
        "activations": activations_gib * GIB,
    }
    return StageMemory(**m, total=sum(m.values()), capacity=CAPACITY)


def _stage(k: int, split: str, modules: tuple[str, ...], memory: StageMemory) -> StagePlan:
    return StagePlan(
        index=k,
        split_point=split,
        blocks=(2 * k, 2 * k + 2),
        modules=modules,
        ranks=(2 * k, 2 * k + 1),
        device="h100",
        recompute=k == 1,
        fwd_ms=2.0 + k,
        bwd_ms=4.0 + 2 * k,
        send_ms=0.5 if k == 0 else 0.0,
        sync_ms=1.5 - k,
        memory=memory,
    )


def _plan(**overrides: object) -> Plan:
    stages = (
        _stage(0, "", ("embed", "layers.0", "layers.1"), _memory(4.0, 20.0)),
        _stage(1, "layers.2", ("layers.2", "layers.3", "head"), _memory(4.0, 30.0)),
    )
    plan = Plan(
        version=2,  # no simulation inputs: the timeline comes from the stage figures
        model=ModelInfo(fingerprint="0123456789abcdef", file="model.py", parameters=1_100_000_000),
        cluster=from_gpus(4, "h100").to_record(),
        training=TrainingPlan(
            global_batch=64,
            micro_batches=4,
            micro_batch_size=8,
            optimizer="adamw",
            precision="bf16",
            schedule="gpipe",
        ),
        layout=LayoutPlan(pp=2, dp=2),
        stages=stages,
        predicted=Predicted(
            step_ms=0.0, closed_form_ms=0.0, samples_per_s=0.0, bubble_fraction=0.0
        ),
        solver=SolverRecord(
            name="highs",
            status="optimal",
            gap=0.0,
            bound_ms=None,
            solve_s=0.42,
            time_limit_s=60.0,
            n_segments=10,
        ),
        candidates=(
            Candidate(
                pp=2,
                dp=2,
                micro_batches=4,
                schedule="gpipe",
                step_ms=40.0,
                status="chosen",
                reason="fastest predicted step",
            ),
            Candidate(
                pp=4,
                dp=1,
                micro_batches=8,
                schedule="1f1b",
                step_ms=55.0,
                status="slower",
                reason="deeper pipeline, more bubble",
            ),
            Candidate(
                pp=1,
                dp=4,
                micro_batches=1,
                schedule="gpipe",
                step_ms=None,
                status="out_of_memory",
                reason="the whole model does not fit one device",
            ),
        ),
        warnings=("4 micro-batches for 2 stages: the bubble is large",),
    )
    tl = timeline(plan)
    predicted = Predicted(
        step_ms=tl.step_ms,
        closed_form_ms=tl.step_ms,
        samples_per_s=1600.0,
        bubble_fraction=tl.bubble_fraction,
    )
    return replace(plan, predicted=predicted, **overrides)


def _text(plan: Plan, *, styles: bool = False) -> str:
    console = Console(record=True, width=160, file=io.StringIO())
    print_plan(plan, console=console)
    return console.export_text(styles=styles)


def test_timeline_matches_the_closed_form_for_gpipe():
    plan = _plan()
    st = plan.stages
    want = closed_form(
        fwd=[s.fwd_ms for s in st],
        bwd=[s.bwd_ms for s in st],
        micro_batches=4,
        schedule="gpipe",
        link_fwd=[0.25],
        link_bwd=[0.25],
        sync=[s.sync_ms for s in st],
    )
    tl = timeline(plan)
    assert tl.step_ms == pytest.approx(want)
    assert (tl.n_stages, tl.micro_batches, tl.schedule) == (2, 4, "gpipe")
    sends = [e for e in tl.events if e.kind.startswith("send_")]
    assert len(sends) == 8 and all(e.end - e.start == pytest.approx(0.25) for e in sends)


def test_print_plan_shows_stages_solver_candidates_and_warnings():
    text = _text(_plan())
    assert "layers.2" in text and "(input)" in text
    assert "0,1" in text and "2,3" in text  # the ranks of each stage
    assert "proven optimal" in text
    assert "pp 2 × dp 2" in text and "global batch 64" in text and "1.1 B parameters" in text
    assert "1 node × 4 h100" in text
    for status in ("chosen", "slower", "out_of_memory"):
        assert status in text
    assert "warning: 4 micro-batches for 2 stages" in text
    assert "over capacity" not in text


def test_print_plan_names_the_dp_mode():
    plan = _plan(layout=LayoutPlan(pp=2, dp=2, dp_mode="fsdp"))
    fsdp = tuple(replace(c, dp_mode="fsdp") if c.dp > 1 else c for c in plan.candidates)
    text = _text(replace(plan, candidates=fsdp))
    assert "pp 2 × dp 2 = 4 devices, FSDP (each replica holds a shard of every weight" in text
    assert "2 FSDP" in text and "ZeRO-1" not in text
    assert "FSDP" not in _text(_plan())  # DDP: no word for it


def test_print_plan_flags_a_stage_over_capacity():
    plan = _plan()
    big = replace(plan.stages[1], memory=_memory(10.0, 60.0))  # 110 GiB on a 79.6 GiB device
    text = _text(replace(plan, stages=(plan.stages[0], big)), styles=True)
    assert "over capacity: stage 1 needs 110 GiB" in text
    assert "\x1b[1;31m110 / 79.6 (138 %)" in text  # bold red
    assert "40.0 / 79.6 (50 %)" in text and "\x1b[1;31m40.0" not in text


def test_print_plan_marks_a_stage_near_capacity_in_yellow():
    plan = _plan()
    near = replace(plan.stages[0], memory=_memory(4.0, 56.0))  # 76 of 79.6 GiB
    text = _text(replace(plan, stages=(near, plan.stages[1])), styles=True)
    assert "\x1b[33m76.0 / 79.6 (95 %)" in text and "over capacity" not in text


def test_print_plan_names_a_time_limited_solve_and_a_closed_form_gap():
    plan = _plan()
    solver = replace(plan.solver, status="time_limit", gap=0.031, bound_ms=38.0)
    predicted = replace(plan.predicted, closed_form_ms=plan.predicted.step_ms + 2)
    text = _text(replace(plan, solver=solver, predicted=predicted))
    assert "best found in 60 s, gap 3.1 %" in text and "proven" not in text
    assert "closed form" in text


def _sturdier(plan: Plan) -> Plan:
    """``plan`` (pp 2) chosen by the search over a pp 4 configuration 1 % faster."""
    step = plan.predicted.step_ms
    mine = Sturdiness(pp=2, dp=2, micro_batches=4, schedule="gpipe", step_ms=step, bubble=0.1)
    quick = Sturdiness(pp=4, dp=1, micro_batches=8, schedule="1f1b", step_ms=step / 1.01)
    proof = StepSolution(
        starts=(0, 1, 2, 3),
        step=quick.step_ms,
        bound=quick.step_ms,
        gap=0.0,
        status="optimal",
        method="milp",
        solver="highs",
        solve_s=0.0,
        solver_s=0.0,
        n_segments=4,
        evaluated=1,
        detail="",
    )
    choice = record(Verdict(0, 1, 1, 8.0), mine, replace(quick, bubble=0.4), proof)
    rows = (
        replace(plan.candidates[1], step_ms=quick.step_ms, status="faster", reason="-1.0%"),
        replace(plan.candidates[0], step_ms=step, reason="the sturdiest within the ±8 % band"),
    )
    return replace(plan, choice=choice, candidates=rows)


def test_a_sturdier_choice_says_why_and_never_calls_itself_optimal(tmp_path):
    plan = _sturdier(_plan())
    assert plan.choice is not None and plan.choice.fastest is not None
    reason = plan.choice.reason
    assert "chosen over pp 4 × dp 1, m 8, 1f1b" in reason and "+1.0 % predicted" in reason
    assert "within the ±8 % band" in reason and "2 stages instead of 4" in reason
    for text in (_text(plan), write_html(plan, tmp_path / "p.html").read_text()):
        flat = " ".join(html.unescape(text).split())
        assert " ".join(reason.split()) in flat
        # "optimal" only of the fastest's configuration and of this one's own placement.
        claims = flat.count("proven optimal for that configuration")
        claims += flat.count("step proven optimal for this configuration")
        assert claims == 2 and flat.count("optimal") == 2
        # Each solved candidate's step with its interval step × (1 ± 8 %).
        step = plan.predicted.step_ms
        assert f"{fmt_ms(step)} ({fmt_ms(step * 0.92)}–{fmt_ms(step * 1.08)})" in flat
    chosen_line = next(line for line in _text(plan).splitlines() if "  chosen  " in line)
    assert "optimal" not in chosen_line and "fastest predicted" not in chosen_line
    # Saved and loaded, it reads the same; a plan without a choice shows no interval.
    assert _text(load_plan(save_plan(plan, tmp_path / "plan.yaml"))) == _text(plan)
    assert "–" in _text(plan) and "–" not in _text(_plan())


def test_write_html_is_one_self_contained_page(tmp_path):
    path = write_html(_plan(), tmp_path / "report" / "plan.html")
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert page.count("<svg") == 2 and page.count("</svg>") == 2
    assert page.count("<table") == page.count("</table>")
    assert "layers.2" in page and "(input)" in page
    assert "http://" not in page and "https://" not in page
    assert "proven optimal" in page and "warning: 4 micro-batches" in page
    assert not list(tmp_path.glob("report/.*"))  # the temporary file was renamed away
    # The step's end is marked, lanes say their ranks, every module is listed (folded),
    # and the layouts and the closed form are explained.
    plan = _plan()
    assert f"step {fmt_ms(plan.predicted.step_ms)} ms</text>" in page
    assert "stage 0 · ranks 0,1" in page and "stage 1 · ranks 2,3" in page
    assert page.count("<details>") == 2 and "<li><code>head</code></li>" in page
    assert "pipeline-inside (each replica" in page and "closed form: the flow-shop" in page


def test_write_html_escapes_module_names(tmp_path):
    plan = _plan()
    odd = replace(plan.stages[1], split_point="blocks.<lambda>", modules=("blocks.<lambda>",))
    page = write_html(replace(plan, stages=(plan.stages[0], odd)), tmp_path / "p.html").read_text()
    assert "blocks.&lt;lambda&gt;" in page and "<lambda>" not in page


def test_write_trace_is_chrome_trace_json_in_microseconds(tmp_path):
    plan = _plan()
    tl = timeline(plan)
    data = json.loads(write_trace(plan, tmp_path / "plan.trace.json").read_text())
    assert data["displayTimeUnit"] == "ms"
    boxes = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(boxes) == len(tl.events)
    kinds = sorted(e["cat"] for e in boxes)
    assert kinds == sorted(e.kind for e in tl.events)
    assert {"F", "B", "send_F", "send_B", "tail"} == set(kinds)
    first_b = next(e for e in tl.events if e.kind == "B" and e.stage == 0 and e.micro_batch == 3)
    box = next(e for e in boxes if e["name"] == "B3" and e["tid"] == 0)
    assert box["ts"] == pytest.approx(first_b.start * 1000)
    assert box["dur"] == pytest.approx((first_b.end - first_b.start) * 1000)
    assert box["args"]["micro_batch"] == 3
    names = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    assert names[0] == "stage 0 · ranks 0,1" and names[1] == "stage 1 · ranks 2,3"
    # Transfers sit on their own link threads, never on a stage's thread.
    for e in boxes:
        on = names[e["tid"]]
        assert on.startswith("link") == e["cat"].startswith("send_"), (e, on)
    assert {"link 0→1", "link 1→0"} <= set(names.values())
    assert any(e["name"] == "send F2" for e in boxes)
    # A format 2 plan's tail holds the all-reduce too: the box says so.
    assert any(e["name"] == "all-reduce, tied exchange, optimizer step" for e in boxes)
    (end,) = [e for e in data["traceEvents"] if e["name"] == "step ends"]
    assert end["ph"] == "i" and end["ts"] == pytest.approx(plan.predicted.step_ms * 1000)
    _assert_no_overlap(boxes)


def _assert_no_overlap(boxes: list[dict]) -> None:
    """Perfetto draws one track per thread: its complete events must not overlap."""
    by_tid: dict[int, list[dict]] = {}
    for e in boxes:
        by_tid.setdefault(e["tid"], []).append(e)
    for events in by_tid.values():
        events.sort(key=lambda e: e["ts"])
        for a, b in itertools.pairwise(events):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-6, (a, b)


def test_trace_events_is_generic_over_a_timeline():
    from planner.cost import simulate

    tl = simulate(
        fwd=[1.0, 1.0, 1.0],
        bwd=[2.0, 2.0, 2.0],
        micro_batches=4,
        schedule="1f1b",
        link_fwd=[0.5, 0.5],
        link_bwd=[0.5, 0.5],
    )
    data = trace_events(tl, process_name="measured", pid=3)
    proc = [e for e in data["traceEvents"] if e["name"] == "process_name"]
    assert proc == [
        {"name": "process_name", "ph": "M", "pid": 3, "tid": 0, "args": {"name": "measured"}}
    ]
    boxes = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(boxes) == len(tl.events) == 3 * 8 + 2 * 2 * 4
    assert {e["pid"] for e in data["traceEvents"]} == {3}
    # 1F1B sends both ways on a link at once: each direction is its own thread.
    _assert_no_overlap(boxes)


def test_a_saved_plan_renders_as_the_fresh_one(tmp_path):
    plan = _plan()
    loaded = load_plan(save_plan(plan, tmp_path / "plan.yaml"))
    assert _text(loaded) == _text(plan)


def test_report_does_not_import_torch():
    code = "import sys, planner.report; print('torch' in sys.modules)"
    root = ROOT
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
