"""Bad-input cases 4-6: tied parameters, BatchNorm with micro-batches, a model left as found."""

from __future__ import annotations

import shutil

import torch
import torch.nn.functional as F
from bad_input_kit import (
    A100,
    BATCHNORM,
    TIED,
    Env,
)
from models import Net, assert_same_state, model_state

from planner.devices import from_gpus
from planner.options import PlanOptions, ProfileOptions, SearchOptions, Training
from planner.planning import plan_model

# --------------------------------------------------------------------------- 4. tied parameters


def test_case04_tied_parameters(env: Env) -> None:
    plan, _ = env.planned(env.write(TIED), "--gpus", 2, *A100, "--pp", 2)
    [tied] = plan.profiles[0].tied
    assert tied.names == ("emb.weight", "head.weight")  # found by identity
    first, last = plan.stages
    assert "emb" in first.modules and "head" in last.modules  # used on two stages ...
    assert first.memory.tied_copies == 0
    # ... so the stage without the owner pays for a copy: weights, grads, Adam's 2 states.
    assert last.memory.tied_copies == 4 * tied.nbytes


# --------------------------------------------------------------------------- 5. BatchNorm


def test_case05_batchnorm_with_micro_batches_warns(env: Env) -> None:
    plan, out = env.planned(env.write(BATCHNORM), "--gpus", 1, *A100, "--micro-batches", 2)
    [warning] = [w for w in plan.warnings if "BatchNorm" in w]
    assert warning.startswith(
        "the model has BatchNorm (bn): with 2 micro-batches its statistics are computed "
        "over 4 samples at a time, not the replica's 8"
    )
    assert "pin --micro-batches 1" in warning and "GroupNorm" in warning
    assert "warning: the model has BatchNorm" in out
    plan1, _ = env.planned(env.write(BATCHNORM), "--gpus", 1, *A100, "--micro-batches", 1)
    assert not [w for w in plan1.warnings if "BatchNorm" in w]
    env.out.unlink()
    shutil.rmtree(env.cache)
    # BatchNorm1d cannot train on one sample: say so, and which micro-batches to pin.
    err = env.refused(env.write(BATCHNORM), "--gpus", 2, *A100)
    assert "the model does not run on a micro-batch of 1 sample(s): ValueError: Expected" in err
    assert (
        "micro-batches of 8 / (dp × m) = 1, 2, 4, 8 samples; the model runs on 8, not on 1" in err
    )
    assert "fix: pin --micro-batches (and --dp) so that each micro-batch holds at least 2" in err
    assert "e.g. --dp 1 --micro-batches 4" in err


# --------------------------------------------------------------------------- 6. model untouched


def test_case06_profiling_leaves_the_model_unchanged(env: Env) -> None:
    torch.manual_seed(0)
    model = Net().train()
    model.drop.eval()  # a submodule in its own mode must keep it
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model(x).sum().backward()  # existing .grad to keep
    model.inp.bias.requires_grad_(False)
    # Built first: measuring the local CPU draws random numbers (not profiling's doing).
    clusters = (from_gpus(2, "cpu"), from_gpus(2, "a100"))  # measured, then analytic
    before = model_state(model)
    options = PlanOptions(  # BatchNorm1d needs 2 samples or more: micro-batches of 2 and 4
        training=Training(global_batch=8),
        search=SearchOptions(micro_batches=2),
        profile=ProfileOptions(repeats=1, warmup=0),
    )
    for cluster in clusters:
        plan = plan_model(model, (x, y), cluster=cluster, loss_fn=F.cross_entropy, options=options)
        assert plan.stages
        assert_same_state(before, model_state(model))
    assert list(env.cache.iterdir())  # a plan that succeeds does fill the cache
