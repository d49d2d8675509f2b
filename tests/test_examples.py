"""Tests for the example model files: each follows the contract, trains, and exports."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from repo import EXAMPLES
from torch import nn

from planner.plan.modelfile import ModelFile, load_model_file

NAMES = ("mlp", "gpt", "resnet", "unet")


def _load(name: str) -> ModelFile:
    return load_model_file(EXAMPLES / f"{name}.py")


def _model(mf: ModelFile, seed: int = 0) -> Any:
    """The built model, typed Any so tests can reach the example's own attributes."""
    torch.manual_seed(seed)  # deterministic init is the caller's job, not the file's
    return mf.build()


@pytest.mark.parametrize("name", NAMES)
def test_trains_at_two_batch_sizes(name: str) -> None:
    mf = _load(name)
    model = _model(mf)
    for batch_size in (2, 3):
        batch = mf.sample(batch_size)
        assert batch.size == batch_size
        out = model(*batch.args, **batch.kwargs)
        assert out.shape[0] == batch_size
        loss = mf.loss(out, batch.targets)
        assert loss.dim() == 0 and torch.isfinite(loss)
        model.zero_grad()
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", NAMES)
def test_forward_is_deterministic_and_batches_reproducible(name: str) -> None:
    mf = _load(name)
    model = _model(mf).eval()
    rng = torch.random.get_rng_state()
    first, again = mf.sample(2), mf.sample(2)
    assert torch.equal(torch.random.get_rng_state(), rng)  # a local generator, no global state
    assert torch.equal(first.args[0], again.args[0])
    assert torch.equal(first.targets, again.targets)
    with torch.no_grad():
        a, b = model(*first.args, **first.kwargs), model(*first.args, **first.kwargs)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_exports(name: str) -> None:
    mf = _load(name)
    model = _model(mf)
    batch = mf.sample(2)
    exported = torch.export.export(model, batch.args, batch.kwargs, strict=False)
    assert any(node.op == "call_function" for node in exported.graph.nodes)


def test_gpt_ties_the_head_to_the_embedding() -> None:
    model = _model(_load("gpt"))
    assert model.head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "head.weight" not in names  # one Parameter, counted once


def test_gpt_grows_to_48_layers() -> None:
    mf = _load("gpt")
    model = mf.module.build_model(n_layers=48, dim=32, n_heads=2, vocab_size=64, seq_len=8)
    assert len(model.blocks) == 48
    idx = torch.randint(0, 64, (2, 8))
    assert model(idx).shape == (2, 8, 64)


def test_gpt_dropout_knob_and_bad_config() -> None:
    build = _load("gpt").module.build_model
    model = build(n_layers=1, dim=16, n_heads=2, vocab_size=32, seq_len=4, dropout=0.1)
    assert model(torch.randint(0, 32, (2, 4))).shape == (2, 4, 32)
    with pytest.raises(ValueError, match="multiple of n_heads"):
        build(dim=30, n_heads=4)


def test_knobs_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPT_LAYERS", "2")
    monkeypatch.setenv("GPT_DIM", "32")
    monkeypatch.setenv("GPT_VOCAB", "100")
    monkeypatch.setenv("GPT_SEQ", "16")
    gpt = _load("gpt")
    model = _model(gpt)
    assert len(model.blocks) == 2 and model.tok_emb.weight.shape == (100, 32)
    assert gpt.sample(2).args[0].shape == (2, 16)

    monkeypatch.setenv("MLP_SCALE", "2")
    widths = [m.out_features for m in _load("mlp").build().modules() if isinstance(m, nn.Linear)]
    assert widths == [4096, 512, 2048, 256, 10]

    monkeypatch.setenv("RESNET_WIDTH", "8")
    resnet = _model(_load("resnet"))
    assert resnet.fc.in_features == 64  # 8 → 16 → 32 → 64

    monkeypatch.setenv("UNET_DEPTH", "2")
    monkeypatch.setenv("UNET_RES", "16")
    unet = _load("unet")
    model = _model(unet)
    assert len(model.down) == 2
    assert model(*unet.sample(2).args).shape == (2, 4, 16, 16)

    monkeypatch.setenv("GPT_LAYERS", "two")
    with pytest.raises(Exception, match="GPT_LAYERS='two'"):
        _load("gpt").build()


def test_unet_keeps_the_long_skips() -> None:
    model = _model(_load("unet"))
    exported = torch.export.export(model, (torch.randn(1, 3, 64, 64),), strict=False)
    cats = [n for n in exported.graph.nodes if n.target == torch.ops.aten.cat.default]
    assert len(cats) == len(model.down)
