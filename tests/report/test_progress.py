"""Progress while planning (planner.report.progress): one line per phase's start and end
in a pipe, fixed totals, labelled phases per anchor size, the search's count and best."""

from __future__ import annotations

import io
import re
from collections import defaultdict

import pytest
import torch
from repo import ROOT
from torch import nn

from planner.cli import main
from planner.devices import from_gpus
from planner.options import PlanOptions, ProfileOptions, Training
from planner.planning import plan_model
from planner.profile.sizes import SizedProfiles
from planner.report.progress import PREFIX, PhaseLines, progress_bar

Call = tuple[str, int, int, str]


@pytest.fixture(autouse=True)
def _empty_cache(cache_dir):
    """Every test profiles into an empty cache (a cached profile times nothing)."""


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[Call] = []

    def __call__(self, phase: str, done: int, total: int, note: str = "") -> None:
        self.calls.append((phase, done, total, note))

    def phases(self) -> list[str]:
        seen: list[str] = []
        for phase, *_ in self.calls:
            if not seen or seen[-1] != phase:
                seen.append(phase)
        return seen


def _check_totals(calls: list[Call]) -> None:
    """Within a phase the total never changes, done never goes back nor past it."""
    by_phase: dict[str, list[Call]] = defaultdict(list)
    for call in calls:
        by_phase[call[0]].append(call)
    for phase, mine in by_phase.items():
        assert len({t for _, _, t, _ in mine}) == 1, (phase, sorted({t for *_, t, _ in mine}))
        dones = [d for _, d, _, _ in mine]
        assert dones == sorted(dones) and all(0 <= d <= mine[0][2] for d in dones), phase


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def _sample(b: int) -> tuple[tuple[torch.Tensor], dict[str, object], torch.Tensor]:
    gen = torch.Generator().manual_seed(b)
    return (torch.randn(b, 8, generator=gen),), {}, torch.randint(0, 4, (b,), generator=gen)


def test_measured_anchors_each_get_a_labelled_phase_with_a_fixed_total() -> None:
    rec = _Recorder()
    cluster = from_gpus(2, "cpu")
    opts = ProfileOptions(repeats=2, warmup=1, cache=False)
    training = Training(global_batch=8)
    profiles = SizedProfiles(
        _mlp(), _sample, nn.functional.cross_entropy, cluster, training, opts, [1, 4], rec
    )
    profiles.first()
    profiles.get("cpu", 1)
    threads = cluster.devices[0].threads
    unit = "thread" if threads == 1 else "threads"
    n = len(profiles.first().blocks)
    want = []
    for k, b in enumerate([4, 1]):
        at = f"micro-batch {b} ({k + 1} of 2), {threads} {unit}"
        want += [f"tracing the model at {at}", f"timing {n} blocks at {at}"]
    assert rec.phases() == want
    _check_totals(rec.calls)
    for phase in want[1::2]:  # each timing phase ends full, saying how many rounds ran
        last = [c for c in rec.calls if c[0] == phase][-1]
        assert last[1] == last[2] > 0 and re.fullmatch(r"\d+ rounds, \d+ kept", last[3]), last
    assert all(t == 0 for p, _, t, _ in rec.calls if p.startswith("tracing"))


def test_the_search_counts_configurations_and_names_the_best() -> None:
    rec = _Recorder()
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    plan = plan_model(
        _mlp(),
        (x, y),
        cluster=from_gpus(4, "h100"),
        loss_fn=nn.functional.cross_entropy,
        options=PlanOptions(training=Training(global_batch=16)),
        progress=rec,
    )
    _check_totals(rec.calls)
    search = [c for c in rec.calls if c[0].startswith("searching ")]
    total = search[0][2]
    assert search[0][0] == f"searching {total} configurations" and total > 1
    assert [d for _, d, _, _ in search] == list(range(total + 1))
    best = f"best pp {plan.pp} × dp {plan.dp}, m {plan.micro_batches}, {plan.schedule}: "
    assert search[-1][3] == best + f"{plan.predicted.step_ms:.1f} ms"
    assert rec.phases()[-1] == search[0][0]  # nothing after the search


def test_phase_lines_write_a_start_and_an_end_per_phase() -> None:
    out = io.StringIO()
    lines = PhaseLines(out)
    lines("tracing", 0, 0, "")
    for done in range(4):
        lines("timing 3 blocks", done, 4, f"round {done + 1}")
    lines("timing 3 blocks", 4, 4, "2 rounds, 1 kept")
    lines("searching 9 configurations", 0, 9, "")
    lines.close()
    got = [re.sub(r"\d+\.\d s", "T s", line) for line in out.getvalue().splitlines()]
    assert got == [
        f"{PREFIX} tracing ...",
        f"{PREFIX} tracing: T s",
        f"{PREFIX} timing 3 blocks ...",
        f"{PREFIX} timing 3 blocks: T s, 2 rounds, 1 kept",
        f"{PREFIX} searching 9 configurations ...",
        f"{PREFIX} searching 9 configurations: T s",
    ]


def test_progress_bar_draws_no_bar_in_a_pipe() -> None:
    out = io.StringIO()  # not a terminal
    with progress_bar(stream=out) as progress:
        assert isinstance(progress, PhaseLines)
        progress("phase", 1, 2, "")
    first, second = out.getvalue().splitlines()  # ended as the bar closed
    assert first == f"{PREFIX} phase ..." and re.fullmatch(
        rf"{re.escape(PREFIX)} phase: \d+\.\d s", second
    )
    with progress_bar(enabled=False, stream=out) as progress:
        assert progress is None


def test_planner_plan_piped_says_each_phase_on_stderr_only(capsys, tmp_path) -> None:
    rc = main(
        [
            "plan",
            str(ROOT / "examples" / "mlp.py"),
            "--gpus",
            "4",
            "--device-type",
            "h100",
            "--out",
            str(tmp_path / "plan.yaml"),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0
    assert PREFIX not in captured.out  # the report alone on stdout
    err = [line for line in captured.err.splitlines() if line.startswith(PREFIX)]
    starts = [line.removesuffix(" ...") for line in err if line.endswith(" ...")]
    ends = [line for line in err if not line.endswith(" ...")]
    assert len(starts) == len(ends) and len(err) == 2 * len(starts), err
    for start, end in zip(starts, ends, strict=True):  # each phase: its start, then its end
        assert re.fullmatch(re.escape(start) + r": \d+\.\d s(, .+)?", end), (start, end)
    assert starts[0].startswith(f"{PREFIX} loading torch and ")
    assert any(s.startswith(f"{PREFIX} building the model") for s in starts)
    assert any("tracing and pricing the model at micro-batch" in s for s in starts)
    assert re.fullmatch(
        rf"{re.escape(PREFIX)} searching \d+ configurations: \d+\.\d s, best pp \d × dp \d, .*",
        ends[-1],
    )
