"""Building each rank's stage without the whole model (runtime.materialize, ``--init-from``).

In one process: a model built with its parameters on meta, split, and each
stage filled from the initial-weights file holds exactly the tensors of a full
build's stage (every name, every stage, ``pipeline`` and ``fx``, the tied GPT,
BatchNorm's buffers); a pretrained-style file without the non-persistent
buffers; DCP folders; the file reader and writer. The runs of two processes
are in ``test_meta_runs.py``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from small_examples import batch, build
from torch import nn

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


def test_tensors_sharing_a_storage_are_written_apart(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = nn.Linear(3, 3)
    model.register_buffer("table", torch.arange(10.0))
    model.register_buffer("window", model.get_buffer("table")[2:5])  # a view of the table
    got = load_file(str(write_weights(model, tmp_path / "w.safetensors")))
    assert torch.equal(got["window"], torch.tensor([2.0, 3.0, 4.0])) and len(got) == 4


def test_a_forward_that_reads_values_cannot_take_the_fx_split_on_meta() -> None:
    from runtime.split import StageError

    with meta_parameters():
        model = build("branchy")  # bool(torch.isfinite(x).all()) in its forward
    with pytest.raises(StageError, match=r"meta device \(--init-from\).*\n  why: the forward"):
        split_model(model, ["fc1"], ((torch.randn(2, 32, device="meta"),), {}))


class TiedTwice(nn.Module):
    """One weight in three modules, two of them in the first stage (as T5's embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Embedding(32, 16)
        self.dec = nn.Embedding(32, 16)
        self.dec.weight = self.enc.weight
        self.mix = nn.Linear(16, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.enc.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.mix(self.enc(idx) + self.dec(idx.flip(1)))
        return self.head(torch.relu(self.body(h)))


def test_two_copies_of_one_tied_weight_in_a_stage_are_both_filled(tmp_path: Path) -> None:
    torch.manual_seed(6)
    full = TiedTwice()
    init = write_weights(full, tmp_path / "init.safetensors")
    idx = torch.randint(0, 32, (2, 5))
    with meta_parameters():
        model = TiedTwice()
    weights = StageWeights(init, model)
    pipe, _ = split_pipeline(model, ["body"], weights.example(((idx,), {})))
    first = pipe.get_stage_module(0)
    prune_unused(first, used_tensors(first))
    copies = {id(p) for n, p in first.named_parameters() if n in ("enc.weight", "dec.weight")}
    assert len(copies) == 2  # pipeline() gives the stage two tensors of the one weight
    weights(first, torch.device("cpu"))
    for name in ("enc.weight", "dec.weight"):
        assert torch.equal(first.get_parameter(name), full.enc.weight), name
