"""The zero-bubble schedules as they run (runtime/zero_bubble.py): they train like one process.

Multi-process on CPU with gloo (tests/world.py). Each case is planned by the
search with its schedule, pp 2 × v 2 and dp mode pinned, trains 3 Adam steps
pipelined (× data parallel) and on a deep-copied single process on the same
global batches, and requires every step's loss and global gradient norm (on
every rank; every step clipped) and every parameter to match, and every rank's
copy of a tensor (replicas, tied copies) to agree. The model is the GPT with
its tied embedding and head (stage 0 and the last stage each hold a copy); for
ZB-V and DualPipeV those two stages are on rank 0, and stages 1 and 2, next to
each other, on rank 1 (their tensors pass within the rank).

World 2 (dp 1): Interleaved ZB, ZB-V, DualPipeV, and ZB-V over the fx split
(the MLP); also with every stage recomputing (Interleaved ZB), and ZB-1p
(Interleaved ZB at v 1, one stage per rank). World 4 (dp 2): each schedule
with DDP, ZeRO-1 and FSDP, and ZB-1p with DDP; ZB-V with DDP also saves a
checkpoint and loads it into a run of other starting weights (every rank's
weights and optimizer state back), and ZB-V at dp 1 is timed (each backward's
two parts). With DDP and ZeRO-1 the stages
are not DDP-wrapped and average their gradients by hand after their last
weight backward ([Note: DDP under a split backward]); without that the
replicas drift apart (checked by hand: the weights differ by 8e-3 after 3
steps).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from dp_mode_runs import ATOL, RTOL, STEPS, WORLD_TIMEOUT_S, Trainer, plan_file, reference_run
from world import run_world

from planner.options import SearchOptions
from planner.plan import load_plan

CLIP = 0.05  # below every step's gradient norm here: each step clips
MEASURED = "zbv"  # also timed: each backward's two parts are one micro-batch's backward
RESUMED = "zbv-ddp"  # also saved and loaded into a fresh run
ZERO_BUBBLE = ("interleaved-zb", "zbv", "dualpipev")
DP_MODES = ("ddp", "zero1", "fsdp")

pytestmark = pytest.mark.multiprocess


def _plan(
    tmp: Path, name: str, schedule: str, dp: int, mode: str, recompute: bool = False, v: int = 2
) -> str:
    world = 2 * dp
    search = SearchOptions(
        pp=2, dp=dp, micro_batches=4, schedule=schedule, virtual=v, dp_mode=mode
    )  # m 4: DualPipeV needs m ≥ 2·pp
    path = Path(plan_file(name, world, search, tmp / f"{name}-{schedule}-{v}-{dp}-{mode}.yaml"))
    if recompute:  # every stage recomputes its activations in the backward
        data = yaml.safe_load(path.read_text())
        for st in data["stages"]:
            st["recompute"] = True
        path = tmp / f"{name}-{schedule}-recompute.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        assert all(st.recompute for st in load_plan(path).stages)
    return str(path)


def _worker(cases: list[tuple[str, str, str]]) -> dict[str, dict[str, Any]]:
    import torch.distributed as dist

    from runtime.fsdp import whole
    from runtime.measure.recorder import Recorder

    results = {}
    for label, name, path in cases:
        trainer = Trainer(name, path, CLIP, split="fx" if "fx" in label else "auto")
        pm = trainer.run(0)
        recorder = Recorder(pm, warmup_steps=1) if label == MEASURED else None
        losses, norms = [], []
        for x, y in trainer.batches:
            losses.append(pm.step(x, y))
            norms.append(pm.last_grad_norm)
        timed = _timed(pm, recorder) if recorder is not None else {}
        if label == RESUMED:
            timed["resumed"] = _resumed(pm, trainer, Path(path).parent / "ckpt")
        out: dict[str, Any] = {
            "losses": losses,
            "norms": norms,
            "schedule": type(pm.schedule).__name__,
            "wrapped": sorted({"fsdp" if s.fsdp else "ddp" if s.ddp else "-" for s in pm.stages}),
            "method": pm.stages[0].method,
            "stages": len(pm.plan.stages),
        } | timed
        full = pm.state_dict()
        mine = {k: whole(v).cpu() for k, v in pm.stage_state_dict().items()}
        copies = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, copies, dst=0)
        if dist.get_rank() == 0:
            out.update(reference_run(name, trainer.reference, trainer.batches, full, copies, CLIP))
        results[label] = out
    return results


def _resumed(pm: Any, trainer: Any, where: Path) -> str:
    """Save ``pm``, load it into a run of other starting weights: "" when every weight and
    optimizer state is back, else what differs."""
    from runtime.checkpoint import load, save

    path = save(pm, where, STEPS)
    fresh = trainer.run(1)
    load(fresh, path)
    mine, back = pm.stage_state_dict(), fresh.stage_state_dict()
    bad = [k for k, v in mine.items() if not torch.equal(v, back[k])]
    state = [
        k for p, q in zip(pm.optimizer.state.values(), fresh.optimizer.state.values(), strict=True)
        for k in p if not torch.equal(torch.as_tensor(p[k]), torch.as_tensor(q[k]))
    ]  # fmt: skip
    return f"weights {bad[:3]}" if bad else f"optimizer state {state[:3]}" if state else ""


def _timed(pm: Any, recorder: Any) -> dict[str, Any]:
    """Per stage of this rank, the micro-batches its timed input (B) and weights' (W)
    backwards ran for in every step, and (rank 0) its measured backward against the median
    of its W alone."""
    result = recorder.gather()
    mine = recorder.record()
    recorder.close()
    out: dict[str, Any] = {}
    for st in pm.stages:
        ivs = [iv for iv in mine.intervals if iv.stage == st.index]
        out[f"B{st.index}"] = sorted(iv.micro_batch for iv in ivs if iv.kind == "B")
        out[f"W{st.index}"] = sorted(iv.micro_batch for iv in ivs if iv.kind == "W")
        if result is not None:
            w_alone = mine.durations("W", set(result.counted), stage=st.index)
            bwd = result.stage_figures(st.index)["bwd_ms"]
            out[f"bwd{st.index}"] = (bwd, statistics.median(w_alone))
    return out


TORCH_CLASS = {
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def _check(ranks: list[dict[str, dict[str, Any]]], label: str, schedule: str) -> dict[str, Any]:
    root = ranks[0][label]
    assert root["schedule"] == TORCH_CLASS[schedule], root["schedule"]
    assert not root["mismatches"], "\n".join(root["mismatches"])
    assert root["spread"] <= 1e-6, f"copies differ by {root['spread']}"
    for rank, res in enumerate(r[label] for r in ranks):
        for what in ("losses", "norms"):
            want = "ref_losses" if what == "losses" else "ref_norms"
            torch.testing.assert_close(
                torch.tensor(res[what]), torch.tensor(root[want]), rtol=RTOL, atol=ATOL,
                msg=lambda m, r=rank, w=what: f"{label}: rank {r} {w}: {m}",
            )  # fmt: skip
    assert all(n > CLIP for n in root["ref_norms"]), root["ref_norms"]  # every step clipped
    return root


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("zb2")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLANNER_CACHE_DIR", str(tmp / "cache"))
        cases = [(s, "gpt", _plan(tmp, "gpt", s, 1, "ddp")) for s in ZERO_BUBBLE]
        cases.append(("zbv-fx", "mlp", _plan(tmp, "mlp", "zbv", 1, "ddp")))
        cases.append(("interleaved-zb-recompute", "gpt",
                      _plan(tmp, "gpt", "interleaved-zb", 1, "ddp", recompute=True)))  # fmt: skip
        cases.append(("zb-1p", "gpt", _plan(tmp, "gpt", "interleaved-zb", 1, "ddp", v=1)))
    return run_world(_worker, 2, args=(cases,), timeout_s=WORLD_TIMEOUT_S)


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("zb4")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLANNER_CACHE_DIR", str(tmp / "cache"))
        cases = [
            (f"{s}-{mode}", "gpt", _plan(tmp, "gpt", s, 2, mode))
            for s in ZERO_BUBBLE
            for mode in DP_MODES
        ]
        cases.append(("zb-1p-ddp", "gpt", _plan(tmp, "gpt", "interleaved-zb", 2, "ddp", v=1)))
    return run_world(_worker, 4, args=(cases,), timeout_s=2 * WORLD_TIMEOUT_S)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
def test_a_zero_bubble_schedule_trains_like_one_process(
    world2: list[dict[str, dict[str, Any]]], schedule: str
) -> None:
    root = _check(world2, schedule, schedule)
    assert root["wrapped"] == ["-"] and root["method"] == "pipeline", root


@pytest.mark.timeout(600)
def test_a_split_backward_is_timed_in_both_parts(world2: list[dict[str, dict[str, Any]]]) -> None:
    """ZB-V, m 4: every stage times an input part (B; stage 0's is empty, torch runs its
    whole backward as W) and a weights' part (W) per micro-batch of each step, and
    the stage's measured backward counts both."""
    every = [mb for _ in range(STEPS) for mb in range(4)]
    seen = set()
    for rank in world2:
        res = rank[MEASURED]
        for s in range(4):
            if f"W{s}" in res:
                seen.add(s)
                assert res[f"B{s}"] == sorted(every) == res[f"W{s}"], (s, res)
    assert seen == {0, 1, 2, 3}
    for s in (0, 3):  # rank 0's stages: its figures are gathered there
        bwd, w_alone = world2[0][MEASURED][f"bwd{s}"]
        assert bwd > w_alone > 0, (s, bwd, w_alone)


@pytest.mark.timeout(600)
def test_zbv_over_the_fx_split_and_interleaved_zb_recomputing_train_like_one_process(
    world2: list[dict[str, dict[str, Any]]],
) -> None:
    assert _check(world2, "zbv-fx", "zbv")["method"] == "fx"
    _check(world2, "interleaved-zb-recompute", "interleaved-zb")


@pytest.mark.timeout(900)
def test_zb_1p_trains_like_one_process_alone_and_over_replicas(
    world2: list[dict[str, dict[str, Any]]], world4: list[dict[str, dict[str, Any]]]
) -> None:
    """Interleaved ZB at v 1, one stage per rank: the zero-bubble paper's ZB-1p."""
    assert _check(world2, "zb-1p", "interleaved-zb")["stages"] == 2
    assert _check(world4, "zb-1p-ddp", "interleaved-zb")["stages"] == 2


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", DP_MODES)
@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
def test_a_zero_bubble_schedule_over_replicas_trains_like_one_process(
    world4: list[dict[str, dict[str, Any]]], schedule: str, mode: str
) -> None:
    root = _check(world4, f"{schedule}-{mode}", schedule)
    # DDP's hooks never see a split backward's weight gradients: by hand instead.
    assert root["wrapped"] == (["fsdp"] if mode == "fsdp" else ["-"]), root["wrapped"]
    if f"{schedule}-{mode}" == RESUMED:  # a checkpoint loads back on every rank
        assert [r[RESUMED]["resumed"] for r in world4] == [""] * 4
