"""Issue 15, items 1, 2, 4, 5, 6: a model file's code that exits, raises what is not a
ValueError, lives on the meta device, returns NaN, or has data-dependent shapes (inside
a module, planned; in the output's batch dimension, refused naming the operation).

Each refusal is one message (what, why, fix) with exit status 1, no traceback
(``-v`` prints it) and nothing written; the original error's type and message
are in the text. Times are analytic (``--device-type a100``) unless a case
needs a measurement (``--gpus 2`` alone: this machine's CPU).
"""

from __future__ import annotations

import logging
import textwrap

import pytest
import torch
from bad_input_kit import A100, MLP, Env
from torch import nn

from planner.capture import CaptureError, capture
from planner.options import ProfileOptions
from planner.profile.profiler import profile_model

NET = """
import sys
import torch
from torch import nn

BATCH_SIZE = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 4)

    def forward(self, x):
        #FORWARD
        return self.b(torch.relu(self.a(x)))


def build_model():
    #BUILD
    return Net()


def sample_batch(batch_size):
    #SAMPLE
    return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))
"""
CPU = ("--gpus", 2, "--repeats", 1, "--warmup", 0)  # measured on this machine's CPU


def _net(**lines: str) -> str:
    text = NET
    for mark, code in lines.items():
        text = text.replace(f"#{mark}", code)
    return text


def _line(text: str, code: str) -> int:
    return textwrap.dedent(text).splitlines().index(code) + 1


# --------------------------------------------------------------------------- 1. sys.exit


@pytest.mark.parametrize(
    ("mark", "function", "code"),
    [("BUILD", "build_model", 3), ("SAMPLE", "sample_batch", 0), ("FORWARD", "forward", 0)],
)
def test_item1_sys_exit_in_the_model_code_is_an_error(
    env: Env, mark: str, function: str, code: int
) -> None:
    text = _net(**{mark: f"sys.exit({code})"})
    path = env.write(text)
    line = _line(text, f"{'        ' if mark == 'FORWARD' else '    '}sys.exit({code})")
    err = env.refused(path, "--gpus", 2, *A100)  # before: exit 0 (or 3), nothing said
    assert f"called sys.exit({code}) at model.py:{line} in {function}" in err
    assert "must return or raise, not exit" in err
    assert "fix: return" in err


# --------------------------------------------------------------------------- 2. other errors


def test_item2_an_autograd_error_of_the_model_names_the_phase_and_block(env: Env) -> None:
    path = env.write(_net(FORWARD="self.a.weight.add_(1.0)"))
    err = env.refused(path, "--gpus", 2, *A100)  # before: a bare RuntimeError traceback
    assert (
        "error: profiling the model's blocks raised RuntimeError: a leaf Variable that "
        "requires grad is being used in an in-place operation." in err
    )
    assert "where: running the forward of block 0 'a' (modules a)" in err
    assert "why: the model's own code or ops raised it, as a training step would" in err
    assert "only under torch.no_grad()" in err
    assert "(run with -v for the original traceback)" in err
    rc, _, err = env.cli("-v", "plan", path, "--gpus", 2, *A100, "--out", env.out)
    assert rc == 1 and "Traceback" in err and "a_weight.add_" in err
    env.assert_nothing_written()


@pytest.mark.parametrize(
    ("error", "expect"),
    [
        (
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough "
                "memory: you tried to allocate 8589934592 bytes."
            ),
            "why: this machine ran out of memory (",
        ),
        (MemoryError(), "why: this machine ran out of memory ("),
        (RecursionError("maximum recursion depth exceeded"), "Python's recursion limit is "),
    ],
)
def test_item2_memory_and_recursion_errors_in_a_backward_are_named(
    env: Env, monkeypatch: pytest.MonkeyPatch, error: BaseException, expect: str
) -> None:
    def backward(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(torch.autograd, "grad", backward)
    err = env.refused(env.write(MLP), "--gpus", 2, *A100)
    said = str(error) or "(no message)"
    assert f"error: profiling the model's blocks raised {type(error).__name__}: {said}" in err
    assert "where: running the backward of block 0 '0'" in err
    assert "; in profiling the model at micro-batch 8" in err
    assert expect in err
    fix = "--device-type h100" if "memory" in expect else "sys.setrecursionlimit"
    assert fix in err


def test_item2_a_planner_bug_keeps_its_type_and_message(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    import planner.planning

    def search(*args: object, **kwargs: object) -> None:
        raise KeyError("stage 3")

    monkeypatch.setattr(planner.planning, "search", search)
    err = env.refused(env.write(MLP), "--gpus", 2, *A100)
    assert "error: planning raised KeyError: 'stage 3'" in err
    assert "where: searching the placements of" in err
    assert "most likely a bug in the planner" in err and "run again with -v" in err


# --------------------------------------------------------------------------- 4. meta device

META_BUILD = "with torch.device('meta'):\n        return Net()"
META_BATCH = (
    "return torch.randn(batch_size, 16, device='meta'), "
    "torch.randint(0, 4, (batch_size,), device='meta')"
)


def test_item4_a_meta_model_is_refused_for_a_measured_plan(env: Env) -> None:
    text = _net(BUILD=META_BUILD)
    # before: "could not capture ... make the branch depend on configuration"
    err = env.refused(env.write(text), *CPU)
    said = "error: 4 of the model's 4 parameters and buffers are on meta, and the batch is on cpu"
    assert said in err
    assert "measures this machine's CPU" in err
    assert "fix: build the model and draw the batch on a real device" in err
    assert "--device-type h100" in err
    # before: a traceback from the profiler
    text = _net(BUILD=META_BUILD, SAMPLE=META_BATCH)
    err = env.refused(env.write(text), "--gpus", 2, "--device-type", "cpu")
    assert "4 of the model's 4 parameters and buffers are on meta, and the batch is on meta" in err
    # Planned analytically, a meta model works.
    plan, _ = env.planned(env.write(text), "--gpus", 2, *A100)
    assert plan.model.parameters == 16 * 32 + 32 + 32 * 4 + 4


def test_item4_capture_says_the_devices_differ() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(CaptureError) as exc:
        capture(model, (torch.randn(2, 4),))
    said = str(exc.value)
    assert "its tensors are on different devices" in said
    assert "The model's parameters and buffers: 4 on meta." in said
    assert "--device-type h100" in said
    assert "make the branch depend on configuration" not in said


# --------------------------------------------------------------------------- 5. NaN


def test_item5_nan_outputs_are_a_warning_naming_the_module(env: Env) -> None:
    nan = "m = Net()\n    with torch.no_grad():\n        m.a.weight[0, 0] = float('nan')"
    nan += "\n    return m"
    path = env.write(NET.replace("#BUILD\n    return Net()", nan))
    plan, out = env.planned(path, *CPU)  # before: planned, no word of it
    warning = " ".join(w for w in plan.warnings if "not finite" in w)
    assert "the model's outputs are not finite (NaN or inf) on the sample micro-batch of" in warning
    assert "first in the output of module 'a' (Linear)" in warning
    assert "NaN gradients" in warning and "sample_batch's values" in warning
    assert "not finite" in out  # printed with the report


def test_item5_a_nan_loss_is_a_warning(env: Env) -> None:
    path = env.write(NET + "\n\ndef loss_fn(out, y):\n    return out.sum() * float('nan')\n")
    plan, _ = env.planned(path, *CPU)
    assert any("the loss is nan on the sample micro-batch" in w for w in plan.warnings)
    clean = env.write(NET, "clean.py")  # a finite model: no such warning
    plan, _ = env.planned(clean, *CPU)
    assert not any("finite" in w for w in plan.warnings)


# --------------------------------------------------------------------------- 6. data-dependent


@pytest.mark.parametrize("device", [A100, ()])
def test_item6_a_data_dependent_shape_inside_a_module_is_planned(
    env: Env, device: tuple[str, ...]
) -> None:
    # Supported: a boolean mask's result stays inside one module (the sample's shape is
    # profiled); split points its tensors would cross are excluded (tests/capture).
    code = "h = torch.relu(self.a(x))\n        return self.b(h) + h[h > 0.5].mean()"
    text = NET.replace("#FORWARD\n        return self.b(torch.relu(self.a(x)))", code)
    plan, _ = env.planned(env.write(text), "--gpus", 2, *(device or CPU[2:]))
    assert plan.pp * plan.dp >= 1


# Every other row of the sample is kept: dim 0 of a selection is half the batch, never all of it.
HALF = "x = torch.randn(batch_size, 16)\n    x[:, 0] = torch.arange(batch_size) % 2\n    "
HALF += "return x, torch.randint(0, 4, (batch_size,))"
PICK = """class Pick(nn.Module):
    def forward(self, out, x):
        return out[torch.nonzero(x[:, 0] > 0.5).squeeze(1)]


class Net(nn.Module):"""


@pytest.mark.parametrize("device", [A100, ()])
def test_item6_b_an_output_of_data_dependent_batch_size_is_refused_naming_the_op(
    env: Env, device: tuple[str, ...]
) -> None:
    code = "out = self.b(torch.relu(self.a(x)))\n        return out[x[:, 0] > 0.5]"
    text = _net(FORWARD=code, SAMPLE=HALF)
    err = env.refused(env.write(text), "--gpus", 2, *(device or CPU[2:]))
    # before: the default loss's "outputs (4, 4) and targets (8,) fit neither ..." alone
    assert (
        "error: the model's output has a batch dimension (dim 0) of 4 where the batch is 8" in err
    )
    assert "integer targets mean cross-entropy, but outputs (4, 4) and targets (8,)" in err
    said = "boolean-mask indexing x[mask] (aten.index.Tensor) in module '<root>' (Net) at "
    line = _line(text, "        return out[x[:, 0] > 0.5]")
    assert said in err and f"model.py:{line}: return out[x[:, 0] > 0.5]" in err
    assert "whose size depends on the values, not on the batch size" in err
    assert "fix: keep the data-dependent shape inside a module and return a tensor of fixed" in err
    assert "define loss_fn(outputs, targets)" in err


@pytest.mark.parametrize("device", [A100, ()])
def test_item6_c_nonzero_in_a_submodule_is_named_when_loss_fn_fails_on_it(
    env: Env, device: tuple[str, ...]
) -> None:
    text = _net(FORWARD="return self.pick(self.b(torch.relu(self.a(x))), x)", SAMPLE=HALF)
    text = text.replace("class Net(nn.Module):", PICK)
    text = text.replace("nn.Linear(32, 4)\n", "nn.Linear(32, 4)\n        self.pick = Pick()\n")
    text += "\n\ndef loss_fn(out, y):\n    return torch.nn.functional.cross_entropy(out, y)\n"
    err = env.refused(env.write(text), "--gpus", 2, *(device or CPU[2:]))
    assert (
        "error: the model's output has a batch dimension (dim 0) of 4 where the batch is 8" in err
    )
    assert "loss_fn(outputs, targets) raised ValueError" in err  # the loss's own error, kept
    said = "torch.nonzero (aten.nonzero.default) in module 'pick' (Pick) at "
    line = _line(text, "        return out[torch.nonzero(x[:, 0] > 0.5).squeeze(1)]")
    assert said in err and f"model.py:{line}: " in err


@pytest.mark.parametrize("device", [A100, ()])
def test_item6_d_a_loss_fn_that_takes_the_varying_size_plans(
    env: Env, device: tuple[str, ...]
) -> None:
    # The fix the refusal suggests: return the mask too; the loss selects the same targets.
    code = "out = self.b(torch.relu(self.a(x)))\n        keep = x[:, 0] > 0.5"
    code += "\n        return out[keep], keep"
    text = _net(FORWARD=code, SAMPLE=HALF)
    text += "\n\ndef loss_fn(outputs, y):\n    out, keep = outputs\n"
    text += "    return torch.nn.functional.cross_entropy(out, y[keep])\n"
    plan, _ = env.planned(env.write(text), "--gpus", 2, *(device or CPU[2:]))
    assert plan.pp * plan.dp >= 1


# --------------------------------------------------------------------------- _shapes_only


def test_a_model_error_on_meta_is_raised_once_not_retried_on_real_tensors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = []

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(str(x.device))  # under symbolic_trace, a Proxy
            raise RuntimeError("boom: a bug in the model")

    with caplog.at_level(logging.WARNING), pytest.raises(CaptureError, match="boom"):
        profile_model(Broken(), (torch.randn(2, 4),), options=ProfileOptions(device="a100"))
    assert "profiling on the real tensors instead" not in caplog.text
    assert "meta" in calls and "cpu" not in calls  # before: run again on the real tensors
