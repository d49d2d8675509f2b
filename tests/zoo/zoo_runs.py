"""The model files of the zoo and the examples, and what the zoo's worlds run on every rank.

``MODELS`` names every model file the invariant covers: the bundled examples
and the zoo's library models (transformers, torchvision, timm; small configs,
random weights, nothing downloaded). The workers run in ``world.run_world``
processes (gloo on CPU) and go through the runtime as ``planner run`` does:
the model built after ``torch.manual_seed(0)`` on every rank, the step's batch
drawn with the RNG seeded per step, ``ParallelModel.from_plan``, ``step``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torchvision_cpu  # noqa: F401  (before anything imports transformers or timm)
from repo import EXAMPLES

from planner.plan.files import load_plan
from planner.plan.modelfile import ModelFile, load_model_file

__all__ = [
    "MODELS",
    "QUICK",
    "ZOO",
    "model_path",
    "parity_worker",
    "plan_all",
    "plans_of",
    "run_worker",
]

ZOO_DIR = Path(__file__).resolve().parent

EXAMPLE_NAMES = ("mlp", "gpt", "resnet", "unet", "hf_gpt2")
ZOO = (
    "hf_llama",
    "hf_qwen2",
    "hf_mixtral",
    "hf_bert",
    "hf_t5",
    "hf_vit",
    "tv_resnet50",
    "tv_mobilenetv3",
    "tv_convnext",
    "tv_vit",
    "timm_efficientnet",
    "timm_vit",
)
MODELS = EXAMPLE_NAMES + ZOO

SEED = 0
STEPS = 2
LR = 0.05

# Small configurations of the bundled examples (their defaults are sized for planning).
EXAMPLE_ENV = {
    "GPT_LAYERS": "2",
    "GPT_DIM": "64",
    "GPT_SEQ": "32",
    "GPT_VOCAB": "512",
    "RESNET_WIDTH": "8",
    "UNET_DEPTH": "2",
    "UNET_RES": "32",
    "MLP_SCALE": "1",
    "HF_GPT2_LAYERS": "2",
    "HF_GPT2_DIM": "64",
    "HF_GPT2_SEQ": "32",
    "HF_GPT2_VOCAB": "512",
}


QUICK = ("--repeats", "1", "--warmup", "1")  # CPU profiles: one timed round is enough here


def plans_of(name: str, m: int) -> dict[str, list[str]]:
    """The plans of the invariant: their planner arguments, by label."""
    h100 = ["--device-type", "h100"]
    return {
        "pp1": ["--gpus", "4", *h100, "--pp", "1"],
        "pp4": ["--gpus", "4", *h100, "--pp", "4"],
        "pp2": ["--gpus", "2", *h100, "--pp", "2", "--dp", "1", "--micro-batches", str(m)],
        "cpu": ["--gpus", "4", *QUICK],
        "h100x8": ["--gpus", "8", *h100],
    }


def _planner(*args: str) -> tuple[int, str]:
    """``planner ARGS`` in this process: (exit status, what it printed)."""
    from planner import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = cli.main(list(args))
        except SystemExit as exc:
            rc = int(exc.code or 0)
    return rc, out.getvalue()


def _has_batchnorm(name: str) -> bool:
    model = _build(load_model_file(model_path(name)))
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def plan_all(name: str, folder: str) -> dict[str, tuple[int, str, str]]:
    """``planner profile`` and the five plans of ``name`` (plan files in ``folder``).

    Returns (exit status, what it printed, plan file) by label ("profile" too).
    BatchNorm models get one micro-batch in their pp = 2 plan (see the tests).
    """
    path = str(model_path(name))
    out: dict[str, tuple[int, str, str]] = {}
    rc, text = _planner("profile", path, *QUICK)
    out["profile"] = (rc, text, "")
    for label, args in plans_of(name, 1 if _has_batchnorm(name) else 2).items():
        plan = str(Path(folder) / f"{name}-{label}.yaml")
        rc, text = _planner("plan", path, *args, "--out", plan)
        out[label] = (rc, text, plan)
    return out


def model_path(name: str) -> Path:
    """The model file of ``name``: examples/NAME.py or tests/zoo/NAME.py."""
    return (EXAMPLES if name in EXAMPLE_NAMES else ZOO_DIR) / f"{name}.py"


def _batch(mf: ModelFile, size: int, step: int) -> Any:
    """Step ``step``'s batch, as the runtime's worker draws it (RNG seeded per step)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED + step)
        return mf.sample(size)


def _build(mf: ModelFile) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return mf.build()


def run_worker(cases: list[tuple[str, str]]) -> dict[str, Any]:
    """Every rank: each (model, plan file) built and trained for one step; the losses."""
    from runtime.engine import ParallelModel

    out: dict[str, Any] = {}
    for name, plan_path in cases:
        print(f"[zoo] rank {os.environ.get('RANK')}: {plan_path}", file=sys.stderr, flush=True)
        plan = load_plan(plan_path)
        mf = load_model_file(model_path(name))
        model = _build(mf)
        first = _batch(mf, plan.global_batch, 0)
        pm = ParallelModel.from_plan(
            model,
            plan,
            loss_fn=mf.loss,
            optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
            sample=(first.args, first.kwargs),
            timeout_s=120,
        )
        loss = pm.step(first.inputs(), first.targets)
        out[plan_path] = {"loss": loss, "method": pm.stage.method}
    return out


def parity_worker(cases: list[tuple[str, str]]) -> dict[str, Any]:
    """Every rank: each model pipelined for ``STEPS`` SGD steps; rank 0 also trains it alone.

    Returns, per model (on rank 0): the pipelined and the one-process losses,
    and the largest relative difference of any parameter or buffer after
    training (an SGD step moves a weight by lr × its gradient, so equal weights
    after the steps mean equal gradients at every step).
    """
    import torch.distributed as dist

    from runtime.engine import ParallelModel

    out: dict[str, Any] = {}
    for name, plan_path in cases:
        plan = load_plan(plan_path)
        mf = load_model_file(model_path(name))
        model = _build(mf)
        reference = copy.deepcopy(model)
        batches = [_batch(mf, plan.global_batch, k) for k in range(STEPS)]
        pm = ParallelModel.from_plan(
            model,
            plan,
            loss_fn=mf.loss,
            optimizer=lambda ps: torch.optim.SGD(ps, lr=LR),
            sample=(batches[0].args, batches[0].kwargs),
            timeout_s=120,
        )
        losses = [pm.step(b.inputs(), b.targets) for b in batches]
        trained = pm.state_dict()
        if dist.get_rank() != 0:
            continue
        opt = torch.optim.SGD(reference.parameters(), lr=LR)
        ref_losses = []
        for b in batches:
            opt.zero_grad()
            loss = mf.loss(reference(*b.args, **b.kwargs), b.targets)
            loss.backward()
            opt.step()
            ref_losses.append(loss.item())
        worst, where, missing = 0.0, "", []
        for key, want in reference.state_dict().items():
            got = trained.get(key)
            if got is None:
                missing.append(key)
                continue
            if not want.is_floating_point():
                same = torch.equal(got, want)
                rel = 0.0 if same else float("inf")
            else:
                scale = want.abs().max().clamp_min(1e-3)
                rel = float((got.float() - want.float()).abs().max() / scale)
            if rel > worst:
                worst, where = rel, key
        out[name] = {
            "losses": losses,
            "ref_losses": ref_losses,
            "worst": worst,
            "where": where,
            "missing": [k for k in missing if not _tied_alias(reference, k, trained)],
            "method": pm.stage.method,
            "split_points": plan.split_points,
            "micro_batches": plan.micro_batches,
        }
    return out


def _tied_alias(model: torch.nn.Module, key: str, trained: dict[str, Any]) -> bool:
    """Whether ``key`` is a second name of a tensor ``trained`` holds under another name."""
    state = model.state_dict(keep_vars=True)
    target = state[key]
    return any(k in trained for k, v in state.items() if v is target and k != key)


def example_env() -> dict[str, str]:
    """The environment the zoo's processes run in: small example configurations."""
    return {k: os.environ.get(k, v) for k, v in EXAMPLE_ENV.items()}
