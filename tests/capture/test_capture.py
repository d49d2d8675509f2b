"""Capture: export first, symbolic_trace as fallback, clear errors when both fail."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from repo import EXAMPLES
from torch import nn

from planner.capture import CaptureError, TensorInfo, capture
from planner.plan.modelfile import load_model_file


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet", "unet"])
def test_every_example_captures_with_export(name: str) -> None:
    mf = load_model_file(EXAMPLES / f"{name}.py")
    model = mf.build()
    batch = mf.sample(2)
    cap = capture(model, batch.args, batch.kwargs)
    assert cap.method == "export"
    calls = list(cap.call_nodes())
    assert calls
    # Almost every operation sits inside some module call (root glue is the exception).
    inside = sum(1 for n in calls if cap.stacks[n])
    assert inside / len(calls) > 0.5
    assert all(
        isinstance(cap.values[n], TensorInfo) for n in cap.gm.graph.nodes if n.op == "placeholder"
    )


class Awkward(nn.Module):
    """What symbolic_trace cannot take: control flow on a tensor's rank, keyword
    arguments, a dict output; plus a buffer and tied parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, idx: torch.Tensor, *, mask: torch.Tensor | None = None) -> dict:
        h = self.emb(idx)
        if h.dim() == 3:  # a Python branch on the rank: fine for export, not for fx
            h = h * self.scale
        if mask is not None:
            h = h * mask.unsqueeze(-1)
        h = self.proj(h)
        return {"logits": self.head(h), "hidden": h}


def test_export_handles_what_symbolic_trace_cannot() -> None:
    model = Awkward()
    idx = torch.randint(0, 20, (2, 5))
    mask = torch.ones(2, 5)
    with pytest.raises(Exception):  # noqa: B017 - any tracing error proves the point
        torch.fx.symbolic_trace(model)
    cap = capture(model, (idx,), {"mask": mask})
    assert cap.method == "export"
    assert cap.input_names == ["idx", "mask"]
    fqns = {c.fqn for n in cap.call_nodes() for c in cap.stacks[n]}
    assert {"emb", "proj", "head"} <= fqns
    # The captured graph runs and matches the model.
    out = cap.gm(idx, mask=mask)
    torch.testing.assert_close(out["logits"], model(idx, mask=mask)["logits"])


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(x))


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # depends on the data: no tracer can follow it
            return self.lin(x)
        return x


def test_both_tracers_failing_names_the_module_and_line() -> None:
    with pytest.raises(CaptureError) as err:
        capture(DataDependent(), (torch.randn(2, 4),))
    msg = str(err.value)
    assert "module 'gate' (Gate)" in msg
    assert "test_capture.py" in msg and "if x.sum() > 0:" in msg
    assert "torch.where" in msg  # the suggested fix
    assert err.value.__cause__ is not None


def test_fallback_to_symbolic_trace(monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("unsupported operator for this test")

    monkeypatch.setattr(torch.export, "export", broken)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    cap = capture(model, (torch.randn(3, 4),))
    assert cap.method == "symbolic_trace"
    assert "unsupported operator" in (cap.export_error or "")
    stacks = [tuple(c.fqn for c in cap.stacks[n]) for n in cap.call_nodes()]
    assert stacks == [("0",), ("1",), ("2",)]
    assert cap.values[next(iter(cap.call_nodes()))] == TensorInfo((3, 8), torch.float32)


def test_capture_keeps_the_model_mode_and_buffers() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    model[1].eval()  # a submodule in its own mode must keep it
    before = {k: v.clone() for k, v in model.state_dict().items()}
    capture(model, (torch.randn(8, 4),))
    assert model.training and not model[1].training
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])
