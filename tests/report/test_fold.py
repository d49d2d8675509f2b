"""Tables at 80, 100 and 150 columns (planner.plan.fold): every line fits, no word is
split, the important columns stay, and the hidden ones are named."""

from __future__ import annotations

import dataclasses
import io
import re

import pytest
from rich.console import Console
from torch import nn

from planner.devices import from_gpus
from planner.options import ProfileOptions
from planner.plan import (
    Candidate,
    LayoutPlan,
    ModelInfo,
    Plan,
    Predicted,
    SolverRecord,
    StageMemory,
    StagePlan,
    StepInputs,
    TrainingPlan,
)
from planner.plan.fold import PIPE_WIDTH, Col, fold, output_width
from planner.plan.units import GIB
from planner.profile.profiler import profile_model
from planner.report import print_plan
from planner.report.profile_table import print_profile
from runtime.measure.compare import comparison_table
from runtime.measure.recorder import Interval, Measurement, RankRecord

WIDTHS = (80, 100, 150)


def _words(text: str) -> set[str]:
    return set(text.split())


def _plan() -> Plan:
    mods = [f"layers.{i}.attention" for i in range(8)]

    def memory(k: int) -> StageMemory:
        m = {"params": 1.0 * GIB, "grads": 1.0 * GIB, "optimizer": 2.0 * GIB}
        m |= {"buffers": 0.01 * GIB, "comm_buffers": 0.5 * GIB, "tied_copies": 0.0}
        m["activations"] = (10.0 + 30 * k) * GIB
        return StageMemory(**m, total=sum(m.values()), capacity=79.6 * GIB)

    stages = tuple(
        StagePlan(
            index=k,
            split_point=mods[2 * k] if k else "",
            blocks=(2 * k, 2 * k + 2),
            modules=tuple(mods[2 * k : 2 * k + 2]),
            ranks=(k, k + 4),
            device="h100",
            recompute=k == 1,
            fwd_ms=12.345 + k,
            bwd_ms=24.5,
            send_ms=0.5,
            sync_ms=1.25,
            memory=memory(k % 3),
        )
        for k in range(4)
    )
    reason = "pipeline-inside: lower bound 2078.8 ms ≥ best 2039.5 ms (proven by its MILP)"
    return Plan(
        model=ModelInfo(fingerprint="0123456789abcdef", file="model.py", parameters=10**9),
        cluster=from_gpus(8, "h100").to_record(),
        training=TrainingPlan(
            global_batch=64,
            micro_batches=8,
            micro_batch_size=4,
            optimizer="adamw",
            precision="bf16",
            schedule="1f1b",
        ),
        layout=LayoutPlan(pp=4, dp=2),
        stages=stages,
        predicted=Predicted(
            step_ms=400.0, closed_form_ms=400.0, samples_per_s=160.0, bubble_fraction=0.2
        ),
        solver=SolverRecord(
            name="highs", status="optimal", gap=0.0, bound_ms=None, time_limit_s=60.0, n_segments=10
        ),
        candidates=(
            _candidate(4, 2, "1f1b", 400.0, "chosen", "pipeline-inside: fastest"),
            _candidate(2, 4, "gpipe", None, "pruned", reason),
        ),
    )


def _candidate(
    pp: int, dp: int, schedule: str, step: float | None, status: str, reason: str
) -> Candidate:
    return Candidate(
        pp=pp,
        dp=dp,
        micro_batches=8,
        schedule=schedule,
        step_ms=step,
        status=status,
        reason=reason,
    )


def _render(plan: Plan, width: int) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    print_plan(plan, console=console)
    return console.export_text()


@pytest.mark.parametrize("width", WIDTHS)
def test_the_plan_report_fits_the_width_and_splits_no_word(width: int) -> None:
    plan = _plan()
    text = _render(plan, width)
    assert max(len(line) for line in text.splitlines()) <= width
    flat = " ".join(text.split())
    pattern = r"\(\d+ columns? hidden at (\d+) columns: (.*?); widen the terminal or see the HTML"
    note = re.search(pattern, flat)  # the stage table's
    # Every word at this width is a whole word of the unfolded report: nothing is cut.
    shown = _words(re.sub(pattern + r" report\)", "", flat))
    assert {w for w in shown if set(w) != {"─"}} <= _words(_render(plan, 400))
    for header in ("stage", "fwd ms", "bwd ms", "total / capacity"):
        assert header in text  # the columns a plan is read for, headers on one line
    assert "44.5 / 79.6 (56 %)" in text  # a number cell, whole
    if width < 150:
        assert note is not None and note.group(1) == str(width), text
        hidden = note.group(2).split(", ")
        assert "other" in hidden and not {"stage", "fwd ms", "total / capacity"} & set(hidden)
    else:
        assert note is None and "attention …" in text


def test_narrow_tables_drop_by_priority_and_name_what_they_drop() -> None:
    cols = [Col("name"), Col("a", right=True), Col("b", right=True, drop=2), Col("c", drop=1)]
    words = "alpha beta gamma delta epsilon"
    rows = [[words, "12345", "678", "some words here"]]
    wide = fold(cols, rows, 80)
    assert wide.hidden == [] and wide.lines[0].split() == ["name", "a", "b", "c"]
    assert fold(cols, rows, 40).hidden == ["b"]  # the highest drop first
    narrow = fold(cols, rows, 30)
    assert narrow.hidden == ["b", "c"] and narrow.keep == [0, 1]
    assert all(len(line) <= 30 for line in narrow.lines)
    body = narrow.lines[2:]
    assert len(body) == 2 and body[0].endswith("12345")  # the text wrapped, the number whole
    assert " ".join(" ".join(body).split()[:-1]).replace(" 12345", "") == words.replace(
        " epsilon", ""
    ) or " ".join(body).split() == [*words.split()[:4], "12345", "epsilon"]


def test_piped_output_honours_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    assert output_width(False) == PIPE_WIDTH == 100
    monkeypatch.setenv("COLUMNS", "80")
    assert output_width(False) == 80
    assert output_width(True, 132) == 132  # a terminal's own width wins


def _measurement(plan: Plan) -> Measurement:
    records = []
    for st in plan.stages:
        for rank in st.ranks:
            ivs = [Interval("step", s, -1, s, s + 0.41) for s in range(3)]
            ivs += [Interval("F", s, mb, s, s + 0.013) for s in range(3) for mb in range(8)]
            ivs += [Interval("B", s, mb, s, s + 0.026) for s in range(3) for mb in range(8)]
            records.append(
                RankRecord(
                    rank=rank,
                    replica=st.ranks.index(rank),
                    stage=st.index,
                    device="h100",
                    intervals=ivs,
                    peak_bytes=st.memory.total * 1.1,
                    memory_method="CUDA allocator peak",
                )
            )
    return Measurement(records=records, steps=[0, 1, 2], counted=[1, 2], global_batch=64)


@pytest.mark.parametrize("width", WIDTHS)
def test_the_runs_comparison_table_fits_the_width(width: int) -> None:
    plan = _plan()
    text = comparison_table(plan, _measurement(plan), width=width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width, text
    head = lines[1].split()  # one header line, read by programs column by column
    assert head[:2] == ["stage", "fwd"] or head[:3] == ["stage", "ranks", "fwd"], head
    assert "bwd" in head and "err" in head
    # fwd measured 13 ms against 12.345 predicted, memory 1.1 × the prediction:
    # (predicted − measured) / measured, negative where the run was slower or larger
    assert lines[2].split()[0] == "0" and "-5%" in lines[2] and "+5%" not in lines[2]
    assert "err: error = (predicted − measured) / measured" in " ".join(lines)
    if width >= 150:
        assert lines[2].split()[-1] == "-9%", lines[2]
    assert "memory measured as: CUDA allocator peak" in text
    if width >= 150:
        assert "hidden" not in text and "mem" in head and "step" in head
    if width == 80:
        assert "hidden at 80 columns: step ms, step meas, step err;" in text.replace("\n", " "), (
            text
        )


def test_one_micro_batchs_backward_is_compared_with_its_all_reduce_not_the_optimizer() -> None:
    """dp > 1, m = 1: the measured backward holds DDP's all-reduce, so the predicted one
    adds the step inputs' reduce_ms (0.75), not sync_ms (1.25, the optimizer step too)."""
    base = _plan()
    inputs = StepInputs(
        schedule="1f1b",
        micro_batches=1,
        fwd_ms=(12.0,) * 4,
        bwd_ms=(24.5,) * 4,
        link_fwd_ms=(0.5,) * 3,
        link_bwd_ms=(0.5,) * 3,
        reduce_ms=(0.75,) * 4,
        tail_ms=(0.5,) * 4,
        speed=(1.0,),
    )
    training = dataclasses.replace(base.training, micro_batches=1, micro_batch_size=32)
    plan = dataclasses.replace(base, training=training, step=inputs)
    rows = comparison_table(plan, _measurement(plan), width=150).splitlines()
    assert rows[2].split()[5] == "25.25*", rows[2]  # 24.5 + 0.75
    older = dataclasses.replace(plan, step=None)  # no step inputs: sync_ms, all it has
    assert comparison_table(older, _measurement(older), width=150).splitlines()[2].split()[5] == (
        "25.75*"
    )


def test_the_profile_table_fits_80_columns() -> None:
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
    import torch

    prof = profile_model(
        model, (torch.randn(4, 16),), options=ProfileOptions(device="h100", cache=False)
    )
    for width in WIDTHS:
        console = Console(record=True, width=width, file=io.StringIO())
        print_profile(prof, title="four linears · micro-batch 4", console=console)
        text = console.export_text()
        assert max(len(line) for line in text.splitlines()) <= width, text
        assert "block (split point)" in text and "fwd ms" in text
        assert f"total ({len(prof.blocks)} blocks)" in text
