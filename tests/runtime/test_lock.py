"""runtime.lock: one run per checkpoint folder, across processes; released at a clean end;
a restarted rank 0 takes its own job's lock back quietly. (End to end, through
``planner run``: tests/runtime/test_lifecycle.py.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from repo import ROOT

from runtime.lock import LockHeld, check_free, hold


def test_the_lock_is_exclusive_across_processes_and_released(tmp_path: Path) -> None:
    lock = hold(tmp_path / "ckpt", "planner run x.py --plan p.yaml")
    probe = (
        "import sys; from runtime.lock import hold, LockHeld\n"
        "try:\n    hold(sys.argv[1])\nexcept LockHeld as e:\n    print(e); sys.exit(7)\n"
    )
    other = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "ckpt")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert other.returncode == 7, other.stderr
    assert f"pid {os.getpid()} on {socket.gethostname()}" in other.stdout
    assert "running `planner run x.py --plan p.yaml`" in other.stdout
    with pytest.raises(LockHeld):
        check_free(tmp_path / "ckpt")
    lock.release()
    check_free(tmp_path / "ckpt")
    hold(tmp_path / "ckpt").release()  # free again


def test_a_restarted_rank_0_takes_its_own_jobs_lock_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "LOCK").write_text(  # what rank 0's previous attempt, SIGKILLed, left
        f'{{"pid": 1, "parent": {os.getppid()}, "host": "{socket.gethostname()}", '
        '"started": "2026-01-01 00:00:00 UTC", "command": "planner run x.py"}\n'
    )
    with caplog.at_level("INFO", logger="runtime.lock"):
        hold(tmp_path).release()
    assert [r.levelname for r in caplog.records] == ["INFO"], caplog.text
    assert "this job's previous attempt" in caplog.text
