"""bench/gpu_check.sh and its Python steps (bench/_gpu_*.py).

The pure parts against literals: a `planner run` table read back, the summary's lines
and record, the block-by-block comparison of step (b). Then the script itself: its
usage, its stop without a GPU, and its CPU dry run (slow).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from repo import ROOT

# bench/ is a package of the repository, not of the installed distribution.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._gpu_check import parser
from bench._gpu_compare import (
    MERGED_NOTE,
    Round,
    comparison_lines,
    measured_record,
    total_lines,
    totals,
)
from bench._gpu_summary import run_lines, run_table, step_lines, summarize
from planner.plan.records import BlockCost, ModelProfile
from planner.plan.text import ERROR_CONVENTION

# What `planner run` printed for a pp 2 plan on two CPU processes (the dry run's step d).
RUN_PP2 = """\
training examples/gpt.py: pp 2 × dp 1, 4 micro-batches (gpipe), 21.4 ms/step; steps 1..4
step 1/4  loss 6.251087  137.6 ms  58.1 samples/s
step 2/4  loss 6.248130  43.7 ms  183.1 samples/s
step 3/4  loss 6.239970  46.5 ms  172.1 samples/s
step 4/4  loss 6.254124  49.9 ms  160.4 samples/s
predicted vs measured: pp 2 × dp 1, gpipe, m 4 × 2; medians over step(s) 2–4
stage  ranks  fwd ms  meas   err  bwd ms  meas   err  step ms  meas   err  mem MiB  meas   err
    0      0    2.10  2.42  -13%    1.75  1.99  -12%     21.4  46.5  -54%      2.4   2.9  -17%
    1      1    2.08  2.64  -21%    2.08     —     —     21.4  54.0  -60%      3.5   3.8   -9%
step: predicted 21.4 ms, measured 54.0 ms (-60%); throughput predicted 374, measured 148 \
samples/s (+153%)
step(s) 1: warm-up, not counted
err: error = (predicted − measured) / measured (−: slower or larger than predicted)
"""


def test_a_runs_table_is_read_column_by_column() -> None:
    got = run_table(RUN_PP2)
    assert got is not None
    assert got["step_ms"] == {"predicted": 21.4, "measured": 54.0}
    assert (got["steps_trained"], got["steps_asked"], got["last_loss"]) == (4, 4, 6.254124)
    s0, s1 = got["stages"]
    assert s0 == {
        "stage": 0,
        "fwd_ms": {"predicted": 2.10, "measured": 2.42},
        "bwd_ms": {"predicted": 1.75, "measured": 1.99},
        "mem_mib": {"predicted": 2.4, "measured": 2.9},
    }
    assert s1["stage"] == 1 and s1["bwd_ms"]["predicted"] == 2.08
    assert math.isnan(s1["bwd_ms"]["measured"])  # "—": not measured


def test_a_run_without_its_table_reads_as_none() -> None:
    assert run_table("error: rank 1 failed\nstep 1/4  loss 6.25  1 ms\n") is None


def test_a_runs_summary_lines_are_those_the_check_prints() -> None:
    got = run_table(RUN_PP2)
    assert got is not None
    lines = run_lines("run pp 2 on cpu, 2 processes (gloo)", got)
    assert lines[:3] == [
        "run pp 2 on cpu, 2 processes (gloo): 4/4 steps trained, last loss 6.2541",
        "  step                                 predicted      21.40 ms   measured      54.00 ms"
        "   error   -60%",
        "  stage 0 forward (per micro-batch)    predicted       2.10 ms   measured       2.42 ms"
        "   error   -13%",
    ]
    assert lines[-2].endswith("measured        nan ms   error      —")  # bwd, not measured
    assert lines[-1] == (
        "  stage 1 peak memory                  predicted        3.5 MiB  measured        "
        "3.8 MiB  error    -8%"
    )
    assert len(lines) == 2 + 2 * 3
    # the errors are added to the record, by planner.plan.text.rel_error's convention
    assert got["step_ms"]["error"] == pytest.approx((21.4 - 54.0) / 54.0)
    assert math.isnan(got["stages"][1]["bwd_ms"]["error"])


def test_the_steps_line_says_which_failed() -> None:
    steps, lines = step_lines(["a-device=0:2", "c-plan-pp2-gpu=skipped:0", "d-run-pp1=124:90"], 95)
    assert steps["d-run-pp1"] == {"status": "124", "s": 90}
    assert lines == [
        "steps: a-device ok (2 s), c-plan-pp2-gpu skipped (0 s), d-run-pp1 124 (90 s)",
        "failed: c-plan-pp2-gpu, d-run-pp1; wall 95 s so far",
    ]


def test_the_summary_is_written_as_strict_json(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "d-run-pp2.txt").write_text(RUN_PP2)  # no profile, no pp 1 run
    out = tmp_path / "summary.json"
    summarize(
        mode="cpu", where="cpu", scratch=tmp_path, out_path=out, wall=7, status=["a-device=0:2"]
    )
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == ERROR_CONVENTION + " (−: slower or larger than predicted)"
    assert printed[1] == "profile: no comparison (step b failed or was skipped)"
    assert printed[2] == (
        "run pp 1 on cpu, 1 process: no predicted-vs-measured table "
        "(step d-run-pp1 failed or was skipped)"
    )
    assert printed[3].startswith("run pp 2 on cpu, 2 processes (gloo): 4/4 steps trained")
    assert printed[-2:] == ["failed: none; wall 7 s so far", f"summary written to {out}"]
    record = json.loads(out.read_text())  # strict JSON: no NaN
    assert list(record) == ["mode", "measured_on", "runs", "profile", "steps", "wall_s"]
    assert record["runs"]["pp2"]["stages"][1]["bwd_ms"] == {
        "predicted": 2.08,
        "measured": None,
        "error": None,
    }


def _block(index: int, name: str, fwd_ms: float, bwd_ms: float, act: int) -> BlockCost:
    return BlockCost(
        index=index,
        name=name,
        modules=(),
        fwd_ms=fwd_ms,
        bwd_ms=bwd_ms,
        param_bytes=0,
        activation_bytes=act,
        output_bytes=0,
        boundary_bytes=0,
    )


# Two blocks, the second with no backward mark in the rounds ("merged" into the first).
ANALYTIC = ModelProfile(
    fingerprint="f",
    source="analytic",
    device="h100",
    batch_size=4,
    dtype="fp32",
    threads=0,
    capture="export",
    blocks=(
        _block(0, "", 1.0, 2.0, 2**20),
        _block(1, "head", 0.5, 1.0, 0),
    ),
    loss_fwd_ms=0.25,
    loss_bwd_ms=0.25,
)
ROUNDS: list[Round] = [
    {"fwd": [1.0, 0.4], "bwd": [4.0, math.nan], "loss_fwd": 0.2, "loss_bwd": 0.3, "whole": 6.0},
    {"fwd": [3.0, 0.6], "bwd": [2.0, math.nan], "loss_fwd": 0.2, "loss_bwd": 0.3, "whole": 8.0},
]


def test_the_profiles_are_compared_block_by_block() -> None:
    measured = measured_record(
        ANALYTIC, where="cuda:0", how="hooks", micro_batch=4, rounds=ROUNDS, saved=[2**19, 0]
    )
    assert [b["fwd_ms"] for b in measured["blocks"]] == [2.0, 0.5]  # medians over rounds
    assert measured["whole_ms"] == 7.0
    assert comparison_lines(ANALYTIC, measured) == [
        "\nanalytic (h100) against measured on cuda:0 (hooks, median of 2 rounds); "
        "error = (predicted − measured) / measured",
        "  #  block                       fwd ms      meas    err     bwd ms      meas    err"
        "    act MiB      meas    err",
        "  0  <input>                      1.000     2.000   -50%      2.000     3.000   -33%"
        "       1.00      0.50  +100%",
        "  1  head                         0.500     0.500    +0%      1.000    merged      —"
        "       0.00      0.00      —",
        "     (loss)                       0.250     0.200   +25%      0.250     0.300   -17%",
        MERGED_NOTE,
    ]


def test_the_totals_count_merged_backward_in_the_block_before() -> None:
    sums = totals(ANALYTIC, ROUNDS, [2**19, 0])
    assert sums == {
        "fwd_ms": (1.75, pytest.approx(2.7)),  # median of 1.6 and 3.8
        "bwd_ms": (3.25, pytest.approx(3.3)),  # median of 4.3 and 2.3
        "fwd_bwd_ms": (5.0, 7.0),
        "activation_mib": (1.0, 0.5),
    }
    assert total_lines(sums)[-1] == (
        "total activation_mib   predicted      1.000  measured      0.500  error +100%"
    )


def test_the_steps_command_line() -> None:
    args = parser().parse_args(["measure", "m.py", "cpu", "4", "a", "o", "c"])
    assert (args.command, args.micro_batch) == ("measure", 4)
    summary = "summary --mode cpu --where cpu --scratch s --out o --wall 3 a-device=0:1"
    args = parser().parse_args(summary.split())
    assert args.status == ["a-device=0:1"] and args.scratch == Path("s")


# --------------------------------------------------------------------------- gpu_check.sh

GPU_CHECK = ROOT / "bench" / "gpu_check.sh"
GPU_CHECK_BUDGET_S = 200  # its steps' budget; the dry run takes about a minute on 2 cores
# A summary row: "  step   predicted 8.20 ms   measured 15.20 ms   error -46%".
_SUMMARY_ROW = re.compile(
    r"^  (?P<what>\S.*?)\s+predicted\s+(?P<p>\S+) (?P<unit>ms|MiB)\s+"
    r"measured\s+(?P<m>\S+) (?:ms|MiB)\s+error\s+(?P<e>\S+)$"
)


def _gpu_check_sh(args: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """Run the script in its own process group; on a timeout the whole group is killed."""
    proc = subprocess.Popen(
        ["bash", str(GPU_CHECK), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"bench/gpu_check.sh {' '.join(args)} ran past {timeout_s} s:\n{out[-4000:]}")
    return proc.returncode, out


def _summary_sections(text: str) -> dict[str, list[dict[str, Any]]]:
    """The (e) summary's rows, by the line that heads each group ("profile: ...")."""
    sections: dict[str, list[dict[str, Any]]] = {}
    rows: list[dict[str, Any]] = []
    for line in text.split("== (e) summary", 1)[1].splitlines():
        m = _SUMMARY_ROW.match(line)
        if m:
            rows.append(
                {
                    "what": m["what"].strip(),
                    "p": float(m["p"]),
                    "m": float(m["m"]),
                    "unit": m["unit"],
                    "e": m["e"],
                }
            )
        elif line.startswith(("profile:", "run pp")):
            rows = sections.setdefault(line, [])
    return sections


def test_gpu_check_is_valid_bash_and_says_how_to_use_it() -> None:
    assert os.access(GPU_CHECK, os.X_OK), "bench/gpu_check.sh must be executable"
    subprocess.run(["bash", "-n", str(GPU_CHECK)], check=True)
    if shutil.which("shellcheck"):  # not on CI's machine; where it is, it must pass
        subprocess.run(["shellcheck", str(GPU_CHECK)], check=True)
    rc, out = _gpu_check_sh(["--help"], {}, 30)
    assert rc == 0 and "--dry-run" in out and "[Note: two processes cannot share one GPU]" in out
    rc, out = _gpu_check_sh(["--bogus"], {}, 30)
    assert rc == 2 and "unknown argument --bogus" in out


@pytest.mark.timeout(120)
def test_gpu_check_without_a_gpu_says_to_dry_run(tmp_path: Path) -> None:
    # CUDA_VISIBLE_DEVICES="" hides any GPU: this stops at step (a) on every machine
    env = {"GPU_CHECK_OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    rc, out = _gpu_check_sh([], env, 90)
    assert rc == 1, out[-3000:]
    assert "torch sees no CUDA GPU here" in out and "--dry-run" in out
    assert "stopping" in (tmp_path / "gpu_check.log").read_text()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(GPU_CHECK_BUDGET_S + 120)
def test_gpu_check_dry_run_prints_predicted_against_measured(tmp_path: Path) -> None:
    """Every step of the GPU check, on the CPU: the profiles compared block by block, a
    one-process and a two-process (gloo) plan trained, and the summary's numbers parse."""
    from planner.plan.text import fmt_error

    out_dir = tmp_path / "out"
    env = {"GPU_CHECK_OUT": str(out_dir), "GPU_CHECK_BUDGET_S": str(GPU_CHECK_BUDGET_S)}
    rc, out = _gpu_check_sh(["--dry-run"], env, GPU_CHECK_BUDGET_S + 60)
    assert rc == 0, out[-6000:]
    assert "failed: none" in out
    assert "dry run: no GPU" in out
    sections = _summary_sections(out)
    heads = list(sections)
    assert len(heads) == 3, heads
    assert heads[0].startswith("profile: micro-batch 4, ")
    assert heads[1].startswith("run pp 1 on cpu, 1 process: 4/4 steps trained")
    assert heads[2].startswith("run pp 2 on cpu, 2 processes (gloo): 4/4 steps trained")
    profile, pp1, pp2 = sections.values()
    assert [r["what"] for r in profile] == [
        "Σ forward (blocks + loss)",
        "Σ backward (blocks + loss)",
        "forward + backward, whole model",
        "Σ activations saved",
    ]
    assert [r["what"] for r in pp1] == [
        "step",
        "stage 0 forward (per micro-batch)",
        "stage 0 backward (per micro-batch)",
        "stage 0 peak memory",
    ]
    assert [r["what"] for r in pp2] == [
        "step",
        *(
            f"stage {i} {what}"
            for i in (0, 1)
            for what in ("forward (per micro-batch)", "backward (per micro-batch)", "peak memory")
        ),
    ]
    for row in (*profile, *pp1, *pp2):
        assert row["p"] > 0 and row["m"] > 0, row
        # printed figures are rounded: the error agrees to the percent, sign included
        shown = float(row["e"].rstrip("%"))
        assert abs(shown - float(fmt_error(row["p"], row["m"]).rstrip("%"))) <= 1, row
    # the bytes autograd saves, counted by hooks, are the planner's own figure
    saved = profile[-1]
    assert saved["m"] == pytest.approx(saved["p"], rel=0.1), saved

    record = json.loads((out_dir / "summary.json").read_text())
    assert {k: v["status"] for k, v in record["steps"].items()} == dict.fromkeys(
        [
            "a-device",
            "b-analytic",
            "b-measured",
            "c-plan-pp1",
            "c-plan-pp2",
            "c-plan-pp2-gpu",
            "d-run-pp1",
            "d-run-pp2",
        ],
        "0",
    )
    assert record["runs"]["pp1"]["steps_trained"] == 4
    assert [s["stage"] for s in record["runs"]["pp2"]["stages"]] == [0, 1]
    assert record["runs"]["pp2"]["step_ms"]["error"] == pytest.approx(
        (pp2[0]["p"] - pp2[0]["m"]) / pp2[0]["m"]
    )
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "gpu_check.log",
        "plan-pp1.yaml",
        "plan-pp2-gpu.yaml",
        "plan-pp2.yaml",
        "profile-analytic.json",
        "profile-measured.json",
        "summary.json",
    ]
    assert "== (e) summary" in (out_dir / "gpu_check.log").read_text()
