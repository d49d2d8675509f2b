"""Precision and recompute pieces, in one process: what the plan may ask, and the wrappers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from planner.devices import from_gpus
from planner.options import PlanOptions, SearchOptions, Training
from planner.planning import plan_model
from runtime.precision import SendAs, check_training, send_as
from runtime.recompute import Recompute, maybe_recompute


@pytest.fixture(scope="module")
def plan():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    return plan_model(
        model,
        (x, y),
        cluster=from_gpus(1, "h100"),
        options=PlanOptions(training=Training(global_batch=4), search=SearchOptions(pp=1)),
    )


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [("precision", "fp64", "--precision fp32 or bf16-mixed"), ("optimizer", "lion", "adamw")],
)
def test_a_precision_or_optimizer_the_runtime_does_not_run_is_refused(  # type: ignore[no-untyped-def]
    plan, field, value, words
) -> None:
    check_training(plan)  # the planner's own choices run
    bad = dataclasses.replace(plan, training=dataclasses.replace(plan.training, **{field: value}))
    with pytest.raises(ValueError, match=f"training.{field} is '{value}'") as err:
        check_training(bad)
    assert words in str(err.value)


def test_send_as_casts_what_is_sent_and_the_gradient_comes_back_in_fp32() -> None:
    lin = nn.Linear(4, 4)
    wrapped = SendAs(lin, (torch.bfloat16,))
    x = torch.randn(2, 4, requires_grad=True)
    out = wrapped(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.float32
    assert send_as(lin, (None, None)) is lin  # nothing to cast: no wrapper


def test_recompute_runs_the_forward_again_in_backward_with_the_same_gradients() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Dropout(0.5), nn.Linear(6, 2))
    again = Recompute(nn.Sequential(*[m for m in plain]))  # the same modules
    calls = [0]

    def count(*_: object) -> None:
        calls[0] += 1

    plain.register_forward_pre_hook(count)
    x = torch.randn(5, 6)
    torch.manual_seed(1)
    plain(x).square().sum().backward()
    want = [p.grad.clone() for p in plain.parameters()]  # type: ignore[union-attr]
    assert calls == [1]
    plain.zero_grad(set_to_none=True)
    wrapped_inner = again.module
    wrapped_inner.register_forward_pre_hook(count)
    calls[0] = 0
    torch.manual_seed(1)  # the same dropout mask, and the recomputation replays it
    again(x).square().sum().backward()
    assert calls == [2]  # forward, and again at the start of backward
    for w, p in zip(want, again.parameters(), strict=True):
        torch.testing.assert_close(p.grad, w)
    assert maybe_recompute(plain, False) is plain
