"""Which steps the Recorder times and which it measures memory over (runtime/measure/recorder.py).

On the CPU the memory probe tracks every tensor, one Python call per operator: it
slowed examples/unet.py's step by 30-55 % and its Adam step 3-5 times. So the peak
comes from the first steps after warm-up and the times from the steps after them;
a run with no step after them times the tracked ones, and the table says so.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from models import cpu_cluster, tower_plan
from torch.utils._python_dispatch import _get_current_dispatch_mode

from runtime.measure import Recorder, comparison_table
from runtime.measure.memory import CPU_METHOD
from runtime.measure.recorder import MEMORY_STEPS


def _stub_model(tracked: list[bool]) -> Any:
    """What the Recorder wraps, with no stages: each step allocates and notes whether a
    dispatch mode (the probe's tracking) saw it."""

    def step(*_: Any) -> None:
        tracked.append(_get_current_dispatch_mode() is not None)
        torch.ones(1024).add_(1.0)

    mesh = SimpleNamespace(device=torch.device("cpu"), num_stages=1, rank=0, replica=0, stage=0)
    return SimpleNamespace(
        stages=[],
        schedule=None,
        tied=SimpleNamespace(mine=False),
        optimizer=None,
        mesh=mesh,
        plan=SimpleNamespace(global_batch=8),
        step=step,
    )


def _run(steps: int, **kw: Any) -> tuple[list[bool], Any]:
    tracked: list[bool] = []
    pm = _stub_model(tracked)
    with Recorder(pm, warmup_steps=1, **kw) as rec:
        for _ in range(steps):
            pm.step()
        result = rec.gather()
    return tracked, result


def test_cpu_memory_is_measured_over_the_steps_after_warm_up_and_they_are_not_timed() -> None:
    tracked, result = _run(6)
    assert MEMORY_STEPS == 2
    assert tracked == [True, True, True, False, False, False]  # warm-up, 2 memory, 3 timed
    assert result.steps == (0, 1, 2, 3, 4, 5)
    assert result.memory_steps == (1, 2)
    assert result.counted == (3, 4, 5)
    assert result.records[0].peak_bytes >= 1024 * 4  # the steps' own tensor, at least
    assert result.records[0].memory_method == CPU_METHOD


def test_a_run_with_no_step_after_the_memory_steps_times_the_tracked_ones() -> None:
    tracked, result = _run(3)
    assert tracked == [True, True, True]
    assert result.memory_steps == result.counted == (1, 2)


def test_without_memory_every_step_after_warm_up_is_timed_and_none_tracked() -> None:
    tracked, result = _run(5, memory=False)
    assert tracked == [False] * 5
    assert result.memory_steps == ()
    assert result.counted == (1, 2, 3, 4)


def test_memory_steps_is_checked() -> None:
    with pytest.raises(ValueError, match="memory_steps"):
        Recorder(_stub_model([]), memory_steps=0)


def _table(steps: int) -> str:
    _, result = _run(steps)
    plan = tower_plan(cluster=cpu_cluster(1), pp=1, dp=1, micro_batches=1, schedule="gpipe")
    rec = replace(result.records[0], rank=plan.stages[0].ranks[0])
    result = replace(result, records=(rec,), global_batch=plan.global_batch)
    return comparison_table(plan, result, width=150)


def test_the_table_says_which_steps_gave_the_memory_and_which_the_times() -> None:
    text = _table(6)
    assert "medians over step(s) 4–6" in text, text
    assert "step(s) 1: warm-up, not counted" in text
    assert "step(s) 2–3: memory measured (tracked, slower), not timed" in text


def test_the_table_says_when_the_times_were_tracked() -> None:
    text = " ".join(_table(3).split())
    assert "medians over step(s) 2–3" in text
    assert "step(s) 2–3: timed while memory was tracked (slower)" in text, text
    assert "not timed" not in text
