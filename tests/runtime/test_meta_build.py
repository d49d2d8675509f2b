"""Building each rank's stage without the whole model (runtime.materialize, ``--init-from``).

* one process: a model built with its parameters on meta, split, and each
  stage filled from the initial-weights file holds exactly the tensors of a
  full build's stage (every name, both stages, ``pipeline`` and ``fx``, the
  tied GPT, BatchNorm's buffers); a pretrained-style file without the
  non-persistent buffers, a DCP folder, and the file reader itself;
* two processes: ``planner run --init-from`` (file from ``planner
  init-weights``) trains the same losses as the full build;
* memory: a model whose full build exceeds the per-rank limit set here fits
  under it with ``init_from`` (peak RSS of the build, per rank).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from runs import RUN_TIMEOUT_S, planner_command
from small_examples import batch, build
from torch import nn
from world import run_world

from planner.devices import from_gpus
from planner.options import PlanOptions, SearchOptions, Training
from planner.plan import load_plan, save_plan
from planner.plan.modelfile import load_model_file
from planner.planning import plan_model
from runtime.materialize import StageWeights, meta_parameters, write_weights
from runtime.split import split_model
from runtime.split.pipeline import split_pipeline
from runtime.split.used import prune_unused, used_tensors

CASES = [  # (example, split, split points)
    ("gpt", "pipeline", ["blocks.1"]),  # tok_emb.weight is head.weight: a copy per stage
    ("resnet", "pipeline", ["stages.1"]),  # BatchNorm: running stats, num_batches_tracked
    ("mlp", "pipeline", ["fc2"]),
    ("mlp", "fx", ["fc2"]),
    ("unet", "fx", ["down.1", "up.0"]),  # three stages, long skips
]


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    items: list[tuple[str, torch.Tensor]] = [*module.named_parameters(remove_duplicate=False)]
    items += module.named_buffers(remove_duplicate=False)
    return {name: t.detach().clone() for name, t in items}


def _stages(name: str, split: str, points: list[str], init: Path | None) -> list[dict[str, Any]]:
    """Every stage's tensors: a full build (seed 0), or a meta build filled from ``init``."""
    torch.manual_seed(0)
    with meta_parameters() if init else contextlib.nullcontext():
        model = build(name)
    example: Any = ((batch(name, 2, 0)[0],), {})
    weights = StageWeights(init, model) if init else None
    if weights is not None:
        assert all(p.is_meta for p in model.parameters())
        example = weights.example(example)
    if split == "pipeline":
        pipe, _ = split_pipeline(model, points, example)
        mods = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    else:
        mods = list(split_model(model, points, example)[0])
    out = []
    for mod in mods:
        prune_unused(mod, used_tensors(mod))
        if weights is not None:
            weights(mod, torch.device("cpu"))
        out.append(_tensors(mod))
    return out


@pytest.mark.parametrize(("name", "split", "points"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_each_stage_filled_from_the_file_equals_a_full_builds_stage(
    tmp_path: Path, name: str, split: str, points: list[str]
) -> None:
    torch.manual_seed(0)
    init = write_weights(build(name), tmp_path / "init.safetensors")
    full = _stages(name, split, points, None)
    meta = _stages(name, split, points, init)
    assert len(meta) == len(full) == len(points) + 1
    for s, (want, got) in enumerate(zip(full, meta, strict=True)):
        assert sorted(got) == sorted(want), f"stage {s}"
        for key, value in want.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), (s, key)
            assert got[key].device.type == "cpu"
    if name == "gpt":  # the tied copy on the last stage is filled under its other name
        assert "head.weight" in meta[-1] and "tok_emb.weight" in meta[0]
        assert torch.equal(meta[-1]["head.weight"], meta[0]["tok_emb.weight"])


class Rotary(nn.Module):
    """A tied embedding, a non-persistent buffer (as rotary ``inv_freq``) and a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16), False)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx) * torch.cos(self.get_buffer("inv_freq")).repeat(2)
        return self.head(self.norm(h.transpose(1, 2)).transpose(1, 2))


def test_a_pretrained_style_file_without_non_persistent_buffers_or_tied_copies(
    tmp_path: Path,
) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(3)
    full = Rotary()
    state = {k: v for k, v in full.state_dict().items() if k != "head.weight"}  # as HF writes
    assert "inv_freq" not in state
    save_file(state, str(tmp_path / "model.safetensors"))
    with meta_parameters():
        model = Rotary()
    weights = StageWeights(tmp_path / "model.safetensors", model)
    weights(model, torch.device("cpu"))
    assert model.head.weight is model.emb.weight  # one tensor still
    got, want = _tensors(model), _tensors(full)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    idx = torch.randint(0, 32, (2, 5))
    torch.testing.assert_close(model(idx), full(idx), rtol=0, atol=0)


@pytest.mark.parametrize("runtime_checkpoint", [False, True], ids=["plain", "step-folder"])
def test_a_dcp_folder_fills_the_stage_by_name(tmp_path: Path, runtime_checkpoint: bool) -> None:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(4)
    full = Rotary()
    state: dict[str, Any] = _tensors(full)
    if runtime_checkpoint:  # as runtime.checkpoint saves: model/<name>, a COMPLETE marker
        state = {"model": state, "step": torch.tensor(7)}
        (tmp_path / "COMPLETE").write_text("{}")
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    with meta_parameters():
        model = Rotary()
    StageWeights(tmp_path, model)(model, torch.device("cpu"))
    got, want = _tensors(model), _tensors(full)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_tensors_no_stage_holds_are_read_for_rank_0(tmp_path: Path) -> None:
    torch.manual_seed(5)
    full = Rotary()
    init = write_weights(full, tmp_path / "init.safetensors")
    with meta_parameters():
        model = Rotary()
    templates = {"head.weight": model.head.weight, "norm.bias": model.norm.bias}
    got = StageWeights(init, model).values({**templates, "gone": torch.empty(2, device="meta")})
    assert sorted(got) == ["head.weight", "norm.bias"]  # "gone" is in no source: left out
    assert torch.equal(got["head.weight"], full.emb.weight) and not got["norm.bias"].is_meta


def test_the_reader_agrees_with_safetensors_for_every_dtype(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from runtime.weights import open_weights

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 4, generator=gen),
        "bf16": torch.randn(5, generator=gen).bfloat16(),
        "f16": torch.randn(2, 2, generator=gen).half(),
        "i64": torch.randint(-9, 9, (7,), generator=gen),
        "bool": torch.rand(6, generator=gen) > 0.5,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }
    save_file(tensors, str(tmp_path / "t.safetensors"))
    source = open_weights(tmp_path / "t.safetensors")
    dest = {k: torch.empty_like(v) for k, v in tensors.items()}
    dest["as_f32"] = torch.empty(5)  # bf16 in the file, converted on the way in
    source.load({**{k: dest[k] for k in tensors}})
    source.load({"bf16": dest["as_f32"]})
    want = load_file(str(tmp_path / "t.safetensors"))
    assert all(torch.equal(dest[k], want[k]) for k in tensors)
    assert torch.equal(dest["as_f32"], want["bf16"].float())
    with pytest.raises(ValueError, match=r"'f32' has shape \[3, 4\], but the model's tensor has"):
        source.load({"f32": torch.empty(4, 3)})


def test_a_tensor_the_file_lacks_is_named(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"emb.weight": torch.zeros(32, 16)}, str(tmp_path / "part.safetensors"))
    with meta_parameters():
        model = Rotary()
    weights = StageWeights(tmp_path / "part.safetensors", model)
    with pytest.raises(ValueError, match=r"2 tensor\(s\) of this stage are not in .*norm\.weight"):
        weights(model, torch.device("cpu"))


# --------------------------------------------------------------------------- planner run

TIED = """
import torch
import torch.nn.functional as F
from torch import nn

BATCH_SIZE = 8


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(0, 32, 2) / 32), False)
        self.fc0 = nn.Linear(32, 32)
        self.fc1 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.emb(idx) * torch.cos(self.inv_freq).repeat(2)
        h = torch.relu(self.fc0(h))
        return self.head(torch.relu(self.fc1(h)))


def build_model():
    return Tied()


def sample_batch(batch_size):
    gen = torch.Generator().manual_seed(torch.initial_seed())
    idx = torch.randint(0, 64, (batch_size, 6), generator=gen)
    return idx, torch.roll(idx, 1, dims=1)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1))
"""


@pytest.mark.multiprocess
def test_planner_run_with_init_from_trains_the_same_losses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "tied.py").write_text(TIED)
    mf = load_model_file(tmp_path / "tied.py")
    sample = mf.sample(mf.batch_size)
    plan = plan_model(
        mf.build(),
        (sample.args[0], sample.targets),
        cluster=from_gpus(2, "cpu"),
        loss_fn=mf.loss,
        options=PlanOptions(
            training=Training(global_batch=mf.batch_size, optimizer="adam"),
            search=SearchOptions(pp=2, micro_batches=2, schedule="gpipe"),
        ),
        model_file="tied.py",
    )
    assert plan.split_points and plan.split_points[0] != "emb"
    save_plan(plan, tmp_path / "plan.yaml")
    _, env = planner_command([], {"PLANNER_CACHE_DIR": str(tmp_path / "cache")})
    init = [sys.executable, "-m", "planner", "init-weights", "tied.py", "--out", "init.st"]
    done = subprocess.run(
        [*init, "--seed", "5"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    runs = {}
    for label, extra in (("full", []), ("init", ["--init-from", "init.st"])):
        args = ["tied.py", "--plan", "plan.yaml", "--steps", "3", "--seed", "5", *extra]
        cmd, env = planner_command(args, {"PLANNER_CACHE_DIR": str(tmp_path / "cache")})
        cmd.insert(cmd.index("run"), "-v")  # the workers log at INFO: what each built
        done = subprocess.run(
            cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        runs[label] = re.findall(r"step \d+/3\s+loss (\S+)", out)
        built = re.findall(r"stage materialised on cpu: (\d+) tensors from init.st", out)
        assert len(built) == (2 if extra else 0), out  # each rank filled its own stage
    assert len(runs["full"]) == 3
    assert runs["init"] == runs["full"]  # printed to 6 decimals; the values are bit-equal


# --------------------------------------------------------------------------- memory

WIDTH, LAYERS = 4096, 6
MODEL_BYTES = LAYERS * WIDTH * WIDTH * 4  # fp32, no biases: 384 MiB
LIMIT_BYTES = MODEL_BYTES * 3 // 4
"""The per-rank limit on what building the stage may add to a rank's peak RSS."""


class Wide(nn.Module):
    """Six 4096 × 4096 layers: 384 MiB, 192 MiB a stage at pp 2."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _wide_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, WIDTH, generator=gen), torch.randn(4, WIDTH, generator=gen)


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


def _build_and_measure(plan_path: str, init: str | None) -> dict[str, Any]:
    """One rank: build (full or from ``init``); the build's peak RSS above the start."""
    from runtime.engine import ParallelModel

    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := RSS now
    start = _status("VmRSS")
    torch.manual_seed(0)
    with meta_parameters() if init else contextlib.nullcontext():
        model = Wide()
    x, y = _wide_batch()
    pm = ParallelModel.from_plan(
        model,
        load_plan(plan_path),
        loss_fn=F.mse_loss,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        sample=((x,), {}),
        init_from=init,
    )
    grown = _status("VmHWM") - start
    held = sum(t.numel() * t.element_size() for t in pm.stage.module.state_dict().values())
    loss = pm.step(x, y)
    pm.close()
    return {"grown": grown, "stage": held, "loss": loss}


@pytest.mark.multiprocess
def test_memory_per_rank_follows_its_stage_not_the_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    full = Wide()
    x, y = _wide_batch()
    plan = plan_model(
        full,
        (x, y),
        cluster=from_gpus(2, "cpu"),
        loss_fn=F.mse_loss,
        options=PlanOptions(
            training=Training(global_batch=4, optimizer="sgd"),
            search=SearchOptions(pp=2, micro_batches=2, schedule="gpipe"),
        ),
        model_file="Wide",
    )
    save_plan(plan, tmp_path / "plan.yaml")
    init = str(write_weights(full, tmp_path / "wide.safetensors"))
    del full
    runs = {
        label: run_world(
            _build_and_measure, 2, args=(str(tmp_path / "plan.yaml"), path), timeout_s=150
        )
        for label, path in (("full", None), ("init", init))
    }
    mib = 2**20
    for r in range(2):  # shown with -s: the figures the README quotes
        print(
            f"rank {r}: stage {runs['init'][r]['stage'] / mib:.0f} MiB; build peak RSS growth "
            f"full {runs['full'][r]['grown'] / mib:.0f} MiB, --init-from "
            f"{runs['init'][r]['grown'] / mib:.0f} MiB (limit {LIMIT_BYTES / mib:.0f} MiB)"
        )
    for r in range(2):
        stage = runs["init"][r]["stage"]
        assert stage < MODEL_BYTES * 0.8  # the split is uneven at most 4:2
        assert runs["full"][r]["grown"] > LIMIT_BYTES, runs["full"][r]  # over the limit
        assert runs["init"][r]["grown"] < LIMIT_BYTES, runs["init"][r]  # under it
        assert runs["init"][r]["grown"] < stage + 64 * 2**20, runs["init"][r]  # ∝ the stage
        assert runs["init"][r]["loss"] == runs["full"][r]["loss"]


def test_tensors_sharing_a_storage_are_written_apart(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = nn.Linear(3, 3)
    model.register_buffer("table", torch.arange(10.0))
    model.register_buffer("window", model.get_buffer("table")[2:5])  # a view of the table
    got = load_file(str(write_weights(model, tmp_path / "w.safetensors")))
    assert torch.equal(got["window"], torch.tensor([2.0, 3.0, 4.0])) and len(got) == 4
