"""Issue 15: ``planner run`` refusing what it is given says so once, in the runtime's words.

An expected refusal (a crafted checkpoint: ``CheckpointRefused``; a plan for
another machine, a held checkpoint folder, a model file that exits) carries its
what / why / fix: the worker's line names it, and torchrun's summary shows its
whole message instead of a Python traceback. A genuine error keeps its traceback.
"""

from __future__ import annotations

import builtins
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples" / "mlp.py"
RUN_TIMEOUT_S = 120
REFUSAL = (
    "checkpoint ckpt/step-1 refused: its .metadata names builtins.exec, which is not DCP "
    "metadata.\n  fix: do not load this checkpoint; resume from one saved by a run you trust"
)


def _failed(exc: str, error_file: Path | None) -> subprocess.CompletedProcess[str]:
    """A worker process that ends with ``runtime.failure.fail(<exc>)``."""
    code = (
        "from runtime.checkpoint.safeload import CheckpointRefused\n"
        "from runtime.failure import fail\n"
        f"try:\n    raise {exc}\nexcept BaseException as e:\n    fail(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_ERROR_FILE"}
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    return subprocess.run(
        [sys.executable, "-c", code], env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_refusal_is_its_whole_message_with_no_traceback(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    proc = _failed(f"CheckpointRefused({REFUSAL!r})", error_file)
    assert proc.returncode == 1
    line = "[rank 0] failed while starting: CheckpointRefused: checkpoint ckpt/step-1"
    assert line in proc.stderr
    recorded = json.loads(error_file.read_text())["message"]["extraInfo"]["py_callstack"]
    assert recorded == f"CheckpointRefused: {REFUSAL}"  # before: Python's traceback
    proc = _failed(f"CheckpointRefused({REFUSAL!r})", None)  # not under torchrun
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("fix: do not load this checkpoint") == 1, proc.stderr


def test_a_genuine_error_keeps_its_traceback(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    proc = _failed("KeyError('stage 3')", error_file)
    recorded = json.loads(error_file.read_text())["message"]["extraInfo"]["py_callstack"]
    assert "Traceback (most recent call last)" in recorded and "KeyError: 'stage 3'" in recorded
    proc = _failed("KeyError('stage 3')", None)
    assert "Traceback (most recent call last)" in proc.stderr


class _Planted:
    """Unpickled by a full unpickler, it creates the file ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.exec, (f"open({self.path!r}, 'w').close()",))


def _run(tmp: Path, *args: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLP_IN": "32"}
    env["PLANNER_CACHE_DIR"] = str(tmp / "cache")
    return subprocess.run(
        [sys.executable, "-m", "planner", *map(str, args)], env=env, cwd=tmp,
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT_S + 60)
def test_planner_run_of_a_refused_checkpoint_prints_no_traceback(tmp_path: Path) -> None:
    plan = ("plan", MLP, "--gpus", 1, "--micro-batches", 1, "--repeats", 1)
    assert _run(tmp_path, *plan, "--warmup", 0, "--out", "plan.yaml").returncode == 0
    run = ("run", MLP, "--plan", "plan.yaml", "--checkpoint-dir", "ckpt")
    first = _run(tmp_path, *run, "--steps", 1)
    assert first.returncode == 0, first.stderr
    index = tmp_path / "ckpt" / "step-00000001" / ".metadata"
    crafted = pickle.dumps(_Planted(str(tmp_path / "PWNED")), protocol=2)
    size = index.stat().st_size  # the size COMPLETE records: the index is read, then refused
    index.write_bytes(crafted + b"\0" * (size - len(crafted)))
    second = _run(tmp_path, *run, "--steps", 2)
    said = second.stdout + second.stderr
    assert second.returncode == 1, said
    assert "failed while resuming: CheckpointRefused: checkpoint ckpt/step-00000001 refused" in said
    assert "traceback : CheckpointRefused: checkpoint ckpt/step-00000001 refused" in said
    assert "fix: do not load this checkpoint" in said
    assert "Traceback (most recent call last)" not in said  # before: one per rank
    assert not (tmp_path / "PWNED").exists()
