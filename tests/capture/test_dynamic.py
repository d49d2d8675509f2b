"""Which outputs have a data-dependent dim 0, and the operation, module and line behind it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.capture import capture
from planner.capture.dynamic import data_dependent_outputs


class Select(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "masked_select":
            return torch.masked_select(x, x > 0).reshape(-1, 1)
        return torch.unique(x[:, 0]).unsqueeze(1)


class Net(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.select = Select(how)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.fc(x)
        return {"logits": h, "picked": self.select(h)}


@pytest.mark.parametrize(
    ("how", "op"),
    [
        ("masked_select", "torch.masked_select (aten.masked_select.default)"),
        ("unique", "torch.unique (aten._unique2.default)"),
    ],
)
def test_a_data_dependent_output_names_the_op_module_and_line(how: str, op: str) -> None:
    cap = capture(Net(how), (torch.randn(6, 4),))
    fixed, picked = data_dependent_outputs(cap)
    assert fixed is None  # (6, 4) whatever the values
    assert picked is not None and len(picked) == 1
    origin = picked[0]
    assert origin.op == op
    assert origin.module == "'select' (Select)"
    assert origin.source is not None and "test_dynamic.py:" in origin.source
    assert str(origin).startswith(f"{op} in module 'select' (Select) at ")


def test_fixed_outputs_have_no_origin() -> None:
    cap = capture(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(3, 4),))
    assert data_dependent_outputs(cap) == [None]
