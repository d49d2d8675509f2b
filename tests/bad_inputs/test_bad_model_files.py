"""Bad-input cases 1-3: a model file missing or broken, tracing that fails, non-tensor values
at split points."""

from __future__ import annotations

import textwrap

import pytest
import torch
from bad_input_kit import (
    A100,
    DATA_DEPENDENT,
    MLP,
    TUPLE_EVERYWHERE,
    TUPLE_ONCE,
    Env,
)

from planner.capture import CaptureError
from planner.devices import from_gpus
from planner.plan.modelfile import ModelFileError, load_model_file
from planner.planning import plan_model

# --------------------------------------------------------------------------- 1. model.py


def test_case01_model_file_missing(env: Env) -> None:
    missing = env.tmp / "nope.py"
    err = env.refused(missing, "--gpus", 2, *A100)
    assert f"{missing}: no such file" in err
    assert "fix: pass the path of a .py file" in err
    assert "build_model(**overrides) -> nn.Module (required)" in err  # the expected names
    assert "sample_batch(batch_size) -> (inputs, targets) (required)" in err
    with pytest.raises(ModelFileError):
        load_model_file(missing)


def test_case01_model_file_fails_to_import(env: Env) -> None:
    path = env.write("import torch\n\nraise RuntimeError('no driver found')\n")
    err = env.refused(path, "--gpus", 2, *A100)
    assert f"{path}: importing it raised RuntimeError at line 3" in err
    assert "no driver found" in err and "`python model.py` reproduces it" in err
    assert "(run with -v for the original traceback)" in err
    # -v shows the original traceback, down to the user's line.
    rc, _, err = env.cli("-v", "plan", path, "--gpus", 2, *A100, "--out", env.out)
    assert rc == 1 and "Traceback" in err and "raise RuntimeError('no driver found')" in err
    env.assert_nothing_written()
    with pytest.raises(ModelFileError) as exc:
        load_model_file(path)
    assert isinstance(exc.value.__cause__, RuntimeError)  # kept for the caller


def test_case01_model_file_lacks_functions(env: Env) -> None:
    path = env.write(MLP.replace("def sample_batch(", "def sample_batches("))
    err = env.refused(path, "--gpus", 2, *A100)
    assert "breaks the model-file contract: missing sample_batch" in err
    assert "(present: build_model, BATCH_SIZE)" in err
    assert "sample_batch (did you mean sample_batches?)" in err


# --------------------------------------------------------------------------- 2. tracing


def test_case02_tracing_fails(env: Env) -> None:
    path = env.write(DATA_DEPENDENT)
    line = textwrap.dedent(DATA_DEPENDENT).splitlines().index("        if x.sum() > 0:") + 1
    err = env.refused(path, "--gpus", 2, *A100)
    assert "could not capture the model as a graph" in err
    assert f"module 'gate' (Gate), {path}:{line}:\n    if x.sum() > 0:" in err  # where
    assert "Why: the planner needs one graph" in err
    assert "Fix: make the branch depend on configuration" in err and "torch.where" in err
    assert "def forward" not in err  # torch.export's partial graph stays off the terminal
    # Never a silent one-stage plan: the API raises too.
    mf = load_model_file(path)
    batch = mf.sample(4)
    with pytest.raises(CaptureError):
        plan_model(mf.build(), (batch.args[0], batch.targets), cluster=from_gpus(2, "a100"))


# --------------------------------------------------------------------------- 3. non-tensor values


def _export_disabled(*args: object, **kwargs: object) -> None:
    raise RuntimeError("torch.export disabled: symbolic_trace keeps tuples whole")


def test_case03_non_tensor_crosses_split_points(env: Env) -> None:
    env.monkeypatch.setattr(torch.export, "export", _export_disabled)
    # Every split point after the first is blocked: say which value blocks each.
    err = env.refused(env.write(TUPLE_EVERYWHERE), "--gpus", 2, *A100, "--pp", 2)
    assert "pp 2 > 1: the model has 1 block(s) that can start a stage" in err
    assert "2 candidate split point(s) were excluded" in err
    assert "b: a non-tensor value crosses it ('split' is a tuple)" in err
    assert "c: a non-tensor value crosses it ('split' is a tuple)" in err
    assert "Fix: --pp 1 or fewer" in err and "make the module before such a point return" in err
    # One legal split point left: the plan uses it and never the blocked one.
    plan, _ = env.planned(env.write(TUPLE_ONCE, "once.py"), "--gpus", 2, *A100, "--pp", 2)
    assert plan.split_points == ["c"]
    assert any(n.startswith("excluded split point b: a non-tensor") for n in plan.profiles[0].notes)
