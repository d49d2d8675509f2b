"""A short soak (bench/soak.py, ``--step-log``): 60 steps on 4 processes, no leak, no hang, learns.

``python -m bench.soak --steps 60 --every 20`` plans ``examples/mlp.py`` for
pp 2 × dp 2 and trains it with ``planner run``, a checkpoint every 20 steps,
every rank logging its resident set size each step. Here: every rank logged
every step; its RSS grew by at most ``RSS_GROWTH_MIB`` from the first
checkpoint (step 20) to the end (a generous bound: measured 0-4 MiB, as over
the full 200-step soak); the run ended with status 0 within ``WALL_S``; and
the mean loss of the last 10 steps is below that of the first 10.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo import ROOT

STEPS, EVERY = 60, 20
RSS_GROWTH_MIB = 32.0  # per rank, step 20 → 60 (measured: -2 to +4 MiB)
WALL_S = 120.0  # the run itself (measured: ~15 s on 2 shared CPU cores)

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(WALL_S + 120)
def test_a_short_soak_does_not_leak_hang_or_stall(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "bench.soak", "--steps", str(STEPS), "--every", str(EVERY)]
    proc = subprocess.run(
        [*cmd, "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=WALL_S + 60,
    )
    text = proc.stdout + proc.stderr
    assert out.is_file(), text
    res = json.loads(out.read_text())
    assert res["rc"] == 0 and res["wall_s"] < WALL_S, (res["rc"], res["wall_s"], text)
    assert [r["rank"] for r in res["ranks"]] == [0, 1, 2, 3], text
    for r in res["ranks"]:
        assert r["steps_logged"] == STEPS, (r, text)
        assert r["growth_mib"] <= RSS_GROWTH_MIB, (r, text)
        assert 50 < r["rss_from_mib"] < 4096, r  # a plausible RSS was read
    loss = res["loss"]
    assert loss["steps"] == STEPS and loss["last10_mean"] < loss["first10_mean"], loss
    assert "RSS per rank, step 20 (first checkpoint) → step 60" in proc.stdout, text
