"""Checkpoints (runtime/checkpoint/): exact resume, incomplete checkpoints skipped, refusals.

Two 2-process worlds (pp = 2, gloo on CPU), run one after the other as two
separate jobs, so the resume happens in new processes with a new process group:

* job A trains a model with dropout 4 steps straight (the reference); then a
  second copy 2 steps, saves (step 2), and saves again after steps 3 and 4;
  the step-3 checkpoint is then broken as a crash mid-save leaves it (no
  ``COMPLETE`` marker, a data file cut short) and the step-4 one as a disk
  that filled up after the save would (marker present, a data file cut
  short). It also saves a copy of step 2 with a pickled object (one that
  would create a file when unpickled) in place of an optimizer value;
* job B (other initial weights) resumes from the latest complete checkpoint,
  which must be step 2 (steps 4 and 3 are skipped, with one warning each that
  names the folder and why), trains steps 3 and 4, and must end bit-identical
  to the reference: weights, Adam's state and the losses. Dropout stays on:
  each rank's RNG is seeded per (stage, replica, step) by ``seed_step``
  (reliability item 23), so the masks of steps 3 and 4 do not depend on what
  ran before.

Job B also checks the refusals, on both ranks with the same message: a plan
of another layout (pp 1 × dp 2), unless ``reshard=True`` (which loads the
step-2 weights into that layout by name); a checkpoint of another model; an
incomplete one named explicitly; and checkpoints holding pickled objects, in
an optimizer value or in DCP's index (reliability item 27), which must not run.
"""

from __future__ import annotations

import builtins
import json
import logging
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from world import run_world

from planner.devices import from_gpus
from planner.options import PlanOptions, SearchOptions, Training
from planner.plan import Plan, load_plan, save_plan
from planner.planning import plan_model

BATCH = 8
TIMEOUT_S = 90

pytestmark = pytest.mark.multiprocess


class DropMLP(nn.Module):
    """An MLP with dropout (on) between its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0 = nn.Linear(16, 64)
        self.act0 = nn.ReLU()
        self.drop0 = nn.Dropout(0.2)
        self.fc1 = nn.Linear(64, 64)
        self.act1 = nn.ReLU()
        self.drop1 = nn.Dropout(0.2)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop0(self.act0(self.fc0(x)))
        return self.fc2(self.drop1(self.act1(self.fc1(h))))


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return DropMLP()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 16, generator=gen), torch.randint(0, 4, (BATCH,), generator=gen)


def _plan(pp: int, dp: int) -> Plan:
    x, y = _batch(0)
    return plan_model(
        _model(0),
        (x, y),
        cluster=from_gpus(pp * dp, "h100"),
        loss_fn=F.cross_entropy,
        options=PlanOptions(
            training=Training(global_batch=BATCH, optimizer="adam"),
            search=SearchOptions(pp=pp, dp=dp, micro_batches=2, schedule="gpipe"),
        ),
        model_file="DropMLP",
    )


def _build(plan_path: str, seed: int) -> Any:
    from runtime.engine import ParallelModel

    return ParallelModel.from_plan(
        _model(seed),
        load_plan(plan_path),
        loss_fn=F.cross_entropy,
        optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2),
        sample=((_batch(0)[0],), {}),
    )


def _train(pm: Any, steps: range) -> list[float]:
    from runtime.checkpoint import seed_step

    losses = []
    for step in steps:
        seed_step(pm, step, seed=7)
        losses.append(pm.step(*_batch(step)))
    return losses


class Planted:
    """A pickled object that, unpickled by a full unpickler, creates the file ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.exec, (f"open({self.path!r}, 'w').close()",))


def _save_planted(pm: Any, directory: str, step: int, path: str) -> None:
    """``save``, with rank 1's first optimizer hyper-parameter replaced by a ``Planted``."""
    import torch.distributed as dist

    from runtime.checkpoint import store

    real = store.rank_state

    def planted(pmodel: Any, at: int) -> dict[str, Any]:
        state = real(pmodel, at)
        if dist.get_rank() == 1:
            key = next(k for k in state["optim"] if k.startswith("param_groups."))
            state["optim"][key] = Planted(path)
        return state

    store.rank_state = planted  # type: ignore[assignment]
    try:
        store.save(pm, directory, step)
    finally:
        store.rank_state = real  # type: ignore[assignment]


def _snapshot(pm: Any) -> dict[str, Any]:
    return {
        "weights": {k: v.detach().clone() for k, v in pm.stage_state_dict().items()},
        "optim": pm.optimizer.state_dict(),
    }


# --------------------------------------------------------------------------- the jobs


def _job_a(plan_path: str, ckpt: str, planted_dir: str, planted_file: str) -> dict[str, Any]:
    import torch.distributed as dist

    from runtime.checkpoint import checkpoint_path, save

    ref = _build(plan_path, seed=0)
    out = {"ref_losses": _train(ref, range(4)), **_snapshot(ref)}
    pm = _build(plan_path, seed=0)
    _train(pm, range(2))
    save(pm, ckpt, 2)
    out["step2_weights"] = _snapshot(pm)["weights"]
    _save_planted(pm, planted_dir, 2, planted_file)
    for step in (2, 3):
        _train(pm, range(step, step + 1))
        save(pm, ckpt, step + 1)
    if dist.get_rank() == 0:
        crashed = checkpoint_path(ckpt, 3)  # what a crash during the save leaves behind
        (crashed / "COMPLETE").unlink()
        part = crashed / "__1_0.distcp"
        part.write_bytes(part.read_bytes()[:100])
        cut = checkpoint_path(ckpt, 4) / "__1_0.distcp"  # a file cut short after the save
        out["cut_size"] = cut.stat().st_size
        cut.write_bytes(cut.read_bytes()[:100])
    dist.barrier()
    return out


def _job_b(plan_path: str, other_plan_path: str, ckpt: str, bad: dict[str, str]) -> dict[str, Any]:
    from runtime.checkpoint import checkpoint_path, latest_complete, load

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("runtime.checkpoint").addHandler(Keep(level=logging.WARNING))
    out: dict[str, Any] = {}
    other = _build(other_plan_path, seed=1)  # pp 1 × dp 2: another layout
    path = latest_complete(ckpt)
    assert path is not None
    latest_complete(ckpt)  # a second look does not warn again
    out["path"] = path.name
    out["warnings"] = list(seen)
    pm = _build(plan_path, seed=1)  # other initial weights: the checkpoint must overwrite them
    for name, target, where, kwargs in [
        ("other_layout", other, path, {}),
        ("alien", other, bad["alien"], {"reshard": True}),
        ("incomplete", pm, checkpoint_path(ckpt, 4), {}),
        ("planted_entry", pm, bad["planted_entry"], {}),
        ("planted_index", pm, bad["planted_index"], {}),
    ]:
        try:
            load(target, where, **kwargs)
            out[name] = "not refused"
        except ValueError as exc:
            out[name] = str(exc)
    out["reshard_step"] = load(other, path, reshard=True)
    out["reshard_weights"] = {k: v.clone() for k, v in other.stage_state_dict().items()}
    out["step"] = load(pm, path)
    out["losses"] = _train(pm, range(out["step"], 4))
    out.update(_snapshot(pm))
    return out


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("ckpt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLANNER_CACHE_DIR", str(tmp / "cache"))
        pp2 = str(save_plan(_plan(2, 1), tmp / "pp2.yaml"))
        dp2 = str(save_plan(_plan(1, 2), tmp / "dp2.yaml"))
    ckpt = tmp / "checkpoints"
    ran = tmp / "planted-code-ran"  # what the planted objects would create, if unpickled
    a = run_world(
        _job_a, 2, args=(pp2, str(ckpt), str(tmp / "planted"), str(ran)), timeout_s=TIMEOUT_S
    )
    bad = {
        "alien": tmp / "alien" / "step-00000002",  # the step-2 checkpoint, of "another model"
        "planted_entry": tmp / "planted" / "step-00000002",
        "planted_index": tmp / "planted-index" / "step-00000002",
    }
    shutil.copytree(ckpt / "step-00000002", bad["alien"])
    _edit_marker(bad["alien"], fingerprint="0123456789abcdef")
    shutil.copytree(ckpt / "step-00000002", bad["planted_index"])
    (bad["planted_index"] / ".metadata").write_bytes(pickle.dumps(Planted(str(ran))))
    _edit_marker(bad["planted_index"])
    args = (pp2, dp2, str(ckpt), {k: str(v) for k, v in bad.items()})
    b = run_world(_job_b, 2, args=args, timeout_s=TIMEOUT_S)
    return {"a": a, "b": b, "ckpt": ckpt, "ran": ran}


def _edit_marker(path: Path, **changes: Any) -> None:
    """Change a checkpoint's COMPLETE marker, its files' sizes recounted (a valid marker)."""
    marker = json.loads((path / "COMPLETE").read_text())
    marker.update(changes)
    marker["files"] = {name: (path / name).stat().st_size for name in marker["files"]}
    (path / "COMPLETE").write_text(json.dumps(marker))


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_resume_in_a_new_process_group_is_exact(jobs: dict[str, Any]) -> None:
    for rank, (a, b) in enumerate(zip(jobs["a"], jobs["b"], strict=True)):
        assert b["step"] == 2
        assert b["losses"] == a["ref_losses"][2:], (rank, b["losses"], a["ref_losses"])
        assert a["weights"].keys() == b["weights"].keys()
        for name, want in a["weights"].items():
            assert torch.equal(b["weights"][name], want), (rank, name)
        sa, sb = a["optim"], b["optim"]
        assert sa["param_groups"] == sb["param_groups"]
        for idx, per in sa["state"].items():
            for key, want in per.items():
                assert torch.equal(sb["state"][idx][key], want), (rank, idx, key)


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_incomplete_checkpoints_are_skipped_with_one_warning_each(jobs: dict[str, Any]) -> None:
    ckpt: Path = jobs["ckpt"]
    names = ["step-00000002", "step-00000003", "step-00000004"]
    assert sorted(p.name for p in ckpt.iterdir()) == names
    marker = json.loads((ckpt / "step-00000002" / "COMPLETE").read_text())
    assert (marker["step"], marker["pp"], marker["dp"], marker["world_size"]) == (2, 2, 1, 2)
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(marker["files"])
    cut = jobs["a"][0]["cut_size"]
    for b in jobs["b"]:
        assert b["path"] == "step-00000002"
        newest, crashed = b["warnings"]  # one each, newest first; the second look added none
        assert newest == (
            f"skipping incomplete checkpoint {ckpt / 'step-00000004'}: __1_0.distcp has 100 "
            f"bytes, its save wrote {cut} (cut short, or overwritten after the save); looking "
            "for an earlier one"
        )
        assert crashed == (
            f"skipping incomplete checkpoint {ckpt / 'step-00000003'}: it has no COMPLETE "
            "marker (its save did not finish); looking for an earlier one"
        )
        assert b["incomplete"].startswith(
            f"checkpoint {ckpt / 'step-00000004'} is not complete: __1_0.distcp has 100 bytes"
        ), b["incomplete"]


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_a_checkpoint_holding_a_pickled_object_is_refused_and_nothing_runs(
    jobs: dict[str, Any],
) -> None:
    b0, b1 = jobs["b"]
    assert not jobs["ran"].exists()  # neither planted object was unpickled
    entry, index = b0["planted_entry"], b0["planted_index"]
    assert (b1["planted_entry"], b1["planted_index"]) == (entry, index)  # the same on both ranks
    planted = jobs["ran"].parent / "planted" / "step-00000002"
    assert entry.startswith(f"checkpoint {planted} refused: "), entry
    assert "refused: entry 'optim.param_groups." in entry, entry
    assert "holds a pickled object, not data (Unsupported global: GLOBAL exec " in entry, entry
    assert "refused: its .metadata names builtins.exec, which is not DCP metadata" in index, index
    for msg in (entry, index):
        assert "torch.load(weights_only=True)" in msg and "fix: do not load this checkpoint" in msg


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_another_layout_or_model_is_refused_with_the_same_message_on_every_rank(
    jobs: dict[str, Any],
) -> None:
    b0, b1 = jobs["b"]
    assert b0["other_layout"] == b1["other_layout"]
    msg = b0["other_layout"]
    assert "another layout" in msg and "pp 2 in the checkpoint, 1 now" in msg, msg
    assert "dp 1 in the checkpoint, 2 now" in msg and "reshard=True" in msg, msg
    assert b0["alien"] == b1["alien"]
    assert "another model" in b0["alien"] and "0123456789abcdef" in b0["alien"], b0["alien"]


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_reshard_loads_the_weights_by_name_into_another_layout(jobs: dict[str, Any]) -> None:
    saved: dict[str, torch.Tensor] = {}
    for a in jobs["a"]:  # each pp-2 stage's weights at step 2
        saved.update(a["step2_weights"])
    for b in jobs["b"]:  # pp 1 × dp 2: every weight, on both replicas
        assert b["reshard_step"] == 2
        assert set(b["reshard_weights"]) == set(saved)
        for name, want in saved.items():
            assert torch.equal(b["reshard_weights"][name], want), name
