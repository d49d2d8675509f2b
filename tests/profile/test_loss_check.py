"""A loss failing on an output of data-dependent batch size is explained; others pass through."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from planner.capture import capture
from planner.plan.default_loss import default_loss
from planner.profile.loss_check import checked_loss


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.fc(x)
        return {"logits": h, "kept": h[x[:, 0] > 0]}


def _sample() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(6, 4)
    x[:, 0] = torch.tensor([1.0, -1, 1, -1, -1, -1])  # two rows kept of six
    return x, torch.tensor([0, 1, 2, 0, 1, 2])


def test_a_loss_failing_on_the_data_dependent_output_is_explained() -> None:
    model, (x, y) = Net(), _sample()
    cap = capture(model, (x,))
    loss = checked_loss(lambda out, t: F.cross_entropy(out["kept"], t), cap)
    assert loss is not None
    with pytest.raises(ValueError) as exc:
        loss(model(x), y)
    said = str(exc.value)
    assert said.startswith(
        "the model's output['kept'] has a batch dimension (dim 0) of 2 where the batch is 6"
    )
    assert "(ValueError: Expected input batch_size (2) to match target batch_size (6)" in said
    assert "boolean-mask indexing x[mask] (aten.index.Tensor) in module '<root>' (Net)" in said
    assert "test_loss_check.py:" in said and "fix: keep the data-dependent shape" in said
    assert isinstance(exc.value.__cause__, ValueError)  # the loss's own error


def test_a_loss_that_works_or_fails_for_another_reason_is_left_alone() -> None:
    model, (x, y) = Net(), _sample()
    cap = capture(model, (x,))
    loss = checked_loss(default_loss, cap)  # reads "logits": (6, 3), fine
    assert loss is not None and loss(model(x), y).dim() == 0
    varying = checked_loss(lambda out, t: out["kept"].pow(2).mean(), cap)
    assert varying is not None and varying(model(x), y).dim() == 0
    broken = checked_loss(lambda out, t: F.cross_entropy(out["logits"], t[:3]), cap)
    assert broken is not None
    with pytest.raises(ValueError, match="Expected input batch_size") as exc:
        broken(model(x), y)
    assert "batch dimension (dim 0)" not in str(exc.value)
    assert checked_loss(None, cap) is None
