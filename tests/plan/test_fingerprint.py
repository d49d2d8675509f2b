"""The model's identity: the structural fingerprint, and what a mismatch says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from repo import ROOT
from torch import nn

from planner.plan.fingerprint import describe_mismatch, fingerprint, parameter_shapes
from planner.plan.modelfile import load_model_file


def _mlp(width: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def test_fingerprint_ignores_batch_size_but_not_shapes() -> None:
    model = _mlp()
    fp = fingerprint(model)
    assert len(fp) == 16 and fp == fingerprint(model)
    model(torch.randn(2, 4))
    model(torch.randn(5, 4))
    assert fingerprint(model) == fp  # running it at any batch size changes nothing
    assert fingerprint(_mlp(9)) != fp


class _Branchy(nn.Module):
    """A forward that takes another code path at batch 1 (as library masks do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return self.lin(x).expand(1, 4)
        return self.lin(x)


def test_fingerprint_is_the_same_whatever_path_the_forward_takes() -> None:
    a, b = _Branchy(), _Branchy()
    a(torch.randn(1, 4))
    b(torch.randn(3, 4))
    assert fingerprint(a) == fingerprint(b)


def test_fingerprint_sees_values_not_but_dtypes_buffers_and_ties() -> None:
    model = _mlp()
    same = _mlp()
    with torch.no_grad():
        same[0].weight.add_(1.0)
    assert fingerprint(same) == fingerprint(model)  # values do not count
    assert fingerprint(_mlp().double()) != fingerprint(model)
    normed = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    plain = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    assert fingerprint(normed) != fingerprint(plain)  # module classes and buffers count
    tied = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    untied = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    tied[1].weight = tied[0].weight
    assert fingerprint(tied) != fingerprint(untied)


def test_a_model_file_has_one_fingerprint_wherever_it_lies(tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere" / "mlp.py"
    copy.parent.mkdir()
    copy.write_text((ROOT / "examples" / "mlp.py").read_text())
    here = load_model_file(ROOT / "examples" / "mlp.py").build()
    there = load_model_file(copy).build()
    assert type(here).__module__ != type(there).__module__ or type(here) is nn.Sequential
    assert fingerprint(here) == fingerprint(there)


def test_fingerprint_is_the_same_in_another_process() -> None:
    code = (
        "from planner.plan.fingerprint import fingerprint; "
        "from planner.plan.modelfile import load_model_file; "
        f"print(fingerprint(load_model_file({str(ROOT / 'examples' / 'gpt.py')!r}).build()))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    mine = fingerprint(load_model_file(ROOT / "examples" / "gpt.py").build())
    assert out.stdout.strip() == mine


def test_describe_mismatch_names_missing_extra_and_reshaped() -> None:
    want = parameter_shapes(_mlp())
    assert describe_mismatch(want, _mlp()) == []
    lines = describe_mismatch(want, nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 2)))
    assert len(lines) == 1 and "3 parameter(s) have other shapes" in lines[0]
    assert "0.weight [8, 4] in the plan, [9, 4] here" in lines[0]
    lines = describe_mismatch(want, nn.Sequential(nn.Linear(4, 8)))
    assert any("missing from the model: 2.weight, 2.bias" in line for line in lines)
