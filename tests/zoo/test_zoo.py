"""The invariant: a plan the planner writes runs, for every example and every zoo model.

The zoo is models from the libraries users have (``zoo_runs.ZOO``: transformers'
Llama, Qwen2, Mixtral, BERT with an attention mask, T5, ViT; torchvision's
ResNet-50, MobileNetV3, ConvNeXt, ViT-B/16; timm's EfficientNet-B0 and ViT),
small configurations, random weights, nothing downloaded; with them the
bundled examples (``hf_gpt2`` wraps GPT-2 from transformers). For each:

* ``planner profile`` succeeds, and so do five plans: pp = 1 and pp = 4 pinned
  on 4 H100s; pp = 2 pinned (with dp = 1 and the micro-batch count) on 2
  H100s; unpinned on 4 local CPU processes (profiled); unpinned on 8 H100s;
* every plan but the last runs through the runtime (in worlds of pp × dp
  processes, gloo on CPU): one step each, and the pp = 2 plan ``STEPS`` SGD
  steps that must match one process, every step's loss and every weight
  afterwards. BatchNorm models train that plan on one micro-batch (their
  statistics over the whole batch, as one process computes them), the others
  on two. Dropout is off in every model.

The CLI runs in two worker processes (``planner.cli.main``, two models at a
time), against one profile cache for the whole module. ``ZOO_SUMMARY=FILE``
also writes every model's parity figures to FILE (JSON), for the record.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision_cpu  # noqa: F401  (before anything imports transformers or timm)
from world import run_world
from zoo_runs import MODELS, example_env, parity_worker, plan_all, plans_of, run_worker

from planner.plan.files import load_plan

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORLD_TIMEOUT_S = 900
RTOL = 1e-4
RUN = ("pp1", "pp4", "cpu")  # the plans run for one step; "pp2" trains with parity


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder for the module's plans; one profile cache; the small example configurations."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLANNER_CACHE_DIR", str(tmp_path_factory.mktemp("zoo-cache")))
        for key, value in example_env().items():
            mp.setenv(key, value)
        yield tmp_path_factory.mktemp("zoo-plans")


Planned = dict[tuple[str, str], tuple[int, str, Path]]


@pytest.fixture(scope="module")
def planned(zoo: Path) -> Planned:
    """Every model profiled and planned five ways: (status, output, plan file) by (model, label).

    Two models at a time (two processes: the CLI's planning is one Python thread).
    """
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=spawn) as pool:
        done = list(pool.map(plan_all, MODELS, [str(zoo)] * len(MODELS)))
    return {
        (name, label): (rc, text, Path(path))
        for name, plans in zip(MODELS, done, strict=True)
        for label, (rc, text, path) in plans.items()
    }


@pytest.fixture(scope="module")
def ran(planned: Planned) -> dict[str, Any]:
    """The plans of ``RUN``, one step each, in one world per layout; rank 0's results.

    (One process group serves every plan of a world: plans of one layout share it,
    as a job's steps would; a world is not reused for another layout.)
    """
    by_layout: dict[tuple[int, int], list[tuple[str, str]]] = {}
    for (name, label), (rc, _, path) in planned.items():
        if label in RUN and rc == 0:
            plan = load_plan(path)
            by_layout.setdefault((plan.pp, plan.dp), []).append((name, str(path)))
    results: dict[str, Any] = {}
    for (pp, dp), cases in sorted(by_layout.items()):
        ranks = run_world(run_worker, pp * dp, args=(cases,), timeout_s=WORLD_TIMEOUT_S)
        results.update(ranks[0])
    return results


@pytest.fixture(scope="module")
def parity(planned: Planned) -> dict[str, Any]:
    """The pp = 2 plans trained in a world of 2; rank 0's comparison with one process."""
    cases = [
        (name, str(path))
        for (name, label), (rc, _, path) in planned.items()
        if label == "pp2" and rc == 0
    ]
    results = dict(run_world(parity_worker, 2, args=(cases,), timeout_s=WORLD_TIMEOUT_S)[0])
    if os.environ.get("ZOO_SUMMARY"):  # for the record: every model's parity figures
        Path(os.environ["ZOO_SUMMARY"]).write_text(json.dumps(results, indent=1, default=str))
    return results


@pytest.mark.timeout(WORLD_TIMEOUT_S)
@pytest.mark.parametrize("name", MODELS)
def test_profiles_and_plans_five_ways(planned: Planned, name: str) -> None:
    for label in ("profile", *plans_of(name, 1)):
        rc, text, path = planned[(name, label)]
        assert rc == 0, f"{name} {label}:\n{text[-3000:]}"
        if label.startswith("pp"):
            assert load_plan(path).pp == int(label[2:])
    assert (
        load_plan(planned[(name, "h100x8")][2]).pp * load_plan(planned[(name, "h100x8")][2]).dp <= 8
    )


@pytest.mark.timeout(2 * WORLD_TIMEOUT_S)
@pytest.mark.parametrize("name", MODELS)
def test_every_plan_runs(planned: Planned, ran: dict[str, Any], name: str) -> None:
    for label in RUN:
        path = planned[(name, label)][2]
        result = ran[str(path)]
        assert math.isfinite(result["loss"]), (name, label, result)
        # pp = 1 runs the model itself under DDP (runtime.accumulate): nothing to split
        want = "whole" if load_plan(path).pp == 1 else "pipeline"
        assert result["method"] == want, (name, label, result)


@pytest.mark.timeout(2 * WORLD_TIMEOUT_S)
@pytest.mark.parametrize("name", MODELS)
def test_pp2_matches_one_process(parity: dict[str, Any], name: str) -> None:
    res = parity[name]
    assert res["method"] == "pipeline", res
    torch.testing.assert_close(
        torch.tensor(res["losses"]), torch.tensor(res["ref_losses"]), rtol=RTOL, atol=1e-6
    )
    assert not res["missing"], res["missing"]
    assert res["worst"] <= RTOL, f"{res['where']} differs by {res['worst']:.2e} (relative)"
