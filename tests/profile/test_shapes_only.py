"""Analytic profiles from shapes alone: the same figures as on real tensors, nothing allocated.

See [Note: analytic profiles from shapes alone] in planner.profile.profiler. The
old path (the real tensors, as given) is ``profiler._profile``; ``profile_model``
with a catalogue device runs on meta twins of the model and the batch.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import Tower, assert_same_state, model_state, tower_loss
from repo import ROOT
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from planner.options import ProfileOptions
from planner.plan.modelfile import load_model_file
from planner.plan.records import ModelProfile
from planner.profile.meta import ShapesOnlyError, meta_twin, sampled_on_meta
from planner.profile.profiler import _profile, profile_model


class RealAllocations(TorchDispatchMode):
    """Records every operator output that owns a new non-meta storage of over ``limit`` bytes."""

    def __init__(self, limit: int = 0) -> None:
        super().__init__()
        self.limit = limit
        self.found: list[tuple[str, tuple[int, ...], int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {
            t.untyped_storage()._cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and not t.is_meta
        }
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            storage = t.untyped_storage()
            if storage._cdata not in given and storage.nbytes() > self.limit:  # not a view
                self.found.append((str(func), tuple(t.shape), storage.nbytes()))
        return out


def _mlp() -> tuple[nn.Module, tuple[Any, ...], Any, Callable[..., torch.Tensor]]:
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)
    )
    return model, (torch.randn(16, 32),), torch.randint(0, 8, (16,)), F.cross_entropy


def _gpt(monkeypatch: pytest.MonkeyPatch) -> tuple[nn.Module, tuple[Any, ...], Any, Any]:
    # The bundled example, small: its sample_batch reads GPT_SEQ and GPT_VOCAB too.
    small = {"GPT_LAYERS": "2", "GPT_DIM": "64", "GPT_SEQ": "32", "GPT_VOCAB": "512"}
    for name, value in small.items():
        monkeypatch.setenv(name, value)
    mf = load_model_file(ROOT / "examples/gpt.py")
    batch = mf.sample(4)
    return mf.build(), batch.args, batch.targets, mf.loss


def _convnet() -> tuple[nn.Module, tuple[Any, ...], Any, Callable[..., torch.Tensor]]:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    return model, (torch.randn(4, 3, 16, 16),), torch.randint(0, 10, (4,)), F.cross_entropy


def _tied() -> tuple[nn.Module, tuple[Any, ...], Any, Callable[..., torch.Tensor]]:
    idx = torch.randint(0, 512, (4, 8))
    return Tower(), (idx,), idx, tower_loss


@pytest.mark.parametrize("dtype", [None, "bf16"])
@pytest.mark.parametrize("name", ["mlp", "gpt", "convnet", "tied"])
def test_shapes_only_profile_equals_the_real_tensor_profile(
    name: str, dtype: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    makers = {"mlp": _mlp, "gpt": lambda: _gpt(monkeypatch), "convnet": _convnet, "tied": _tied}
    model, args, targets, loss_fn = makers[name]()
    options = ProfileOptions(device="h100", dtype=dtype, cache=False)
    before = model_state(model)
    old = _profile(model, args, {}, targets, loss_fn, options, None)  # today's path
    assert_same_state(before, model_state(model))
    guard = RealAllocations()
    with guard:
        new = profile_model(model, args, targets=targets, loss_fn=loss_fn, options=options)
    assert guard.found == []  # not one real tensor made: not even a small one
    assert_same_state(before, model_state(model))  # the model (BN statistics too) untouched
    assert all(not p.is_meta for p in model.parameters())
    # Every figure: block fwd/bwd ms, saved and output bytes, parameter, buffer and
    # boundary bytes, FLOPs, the loss's ms, tied sets, notes.
    assert _fields(new) == _fields(old)
    assert new.to_dict() == old.to_dict()


def _fields(prof: ModelProfile) -> list[dict[str, Any]]:
    return [vars(b) for b in prof.blocks]


def test_the_guard_sees_the_real_tensor_path_allocate() -> None:
    model, args, targets, loss_fn = _mlp()
    guard = RealAllocations()
    with guard:
        _profile(model, args, {}, targets, loss_fn, ProfileOptions(device="h100"), None)
    assert guard.found  # the guard above can fail


def test_meta_twin_keeps_ties_and_leaves_the_model_alone() -> None:
    model = Tower()
    twin = meta_twin(model)
    assert twin is not model and twin.head.weight is twin.emb.weight  # tied stays tied
    assert twin.emb.weight.is_meta and not model.emb.weight.is_meta
    assert twin.emb.weight.requires_grad and isinstance(twin.emb.weight, nn.Parameter)
    assert [n for n, _ in twin.named_parameters()] == [n for n, _ in model.named_parameters()]
    bn = nn.BatchNorm1d(4)
    assert meta_twin(bn).num_batches_tracked.is_meta  # buffers too
    on_meta = nn.Linear(2, 2, device="meta")
    assert meta_twin(on_meta) is on_meta


class DataDependent(nn.Module):
    """Keeps the rows whose first feature is positive: a shape only the values give."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h[torch.nonzero(h[:, 0] > -1e9).squeeze(1)])


def test_a_forward_that_needs_values_falls_back_to_real_tensors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, x = DataDependent(), torch.randn(6, 4)
    options = ProfileOptions(device="h100", cache=False)
    with caplog.at_level(logging.WARNING, logger="planner.profile.profiler"):
        prof = profile_model(model, (x,), options=options)
    assert prof.blocks and "profiling on the real tensors instead" in caplog.text
    assert prof.to_dict() == _profile(model, (x,), {}, None, None, options, None).to_dict()


def test_a_forward_that_needs_values_on_meta_only_says_what_to_do() -> None:
    with torch.device("meta"):
        model, x = DataDependent(), torch.randn(6, 4)
    with pytest.raises(ShapesOnlyError) as err:
        profile_model(model, (x,), options=ProfileOptions(device="h100", cache=False))
    text = str(err.value)
    assert "DataDependent" in text and "meta device" in text
    assert "  why: " in text and "  fix: " in text


def test_a_batch_is_drawn_on_meta_and_again_for_real_when_the_forward_needs_values() -> None:
    drawn: list[bool] = []

    def sampler(b: int) -> torch.Tensor:
        x = torch.randn(b, 4)
        drawn.append(x.is_meta)
        return x

    model = DataDependent()
    options = ProfileOptions(device="h100", cache=False)

    def run(x: torch.Tensor) -> ModelProfile:
        return profile_model(model, (x,), options=options)

    assert sampled_on_meta(sampler, 10**9, lambda x: x.shape) == (10**9, 4)  # no memory
    assert sampled_on_meta(sampler, 3, run).batch_size == 3
    assert drawn == [True, True, False]  # the meta batch failed; the real one ran


def test_a_model_file_builds_on_meta_or_falls_back(tmp_path: Any, caplog: Any) -> None:
    path = tmp_path / "model.py"
    path.write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def build_model():
                model = nn.Linear(4, 2)
                if model.weight.is_meta and FAIL_ON_META:
                    model.weight.data.tolist()  # reads values: impossible on meta
                return model

            def sample_batch(n):
                return torch.randn(n, 4), torch.randn(n, 2)

            FAIL_ON_META = False
            """
        )
    )
    assert load_model_file(path).build(meta=True).weight.is_meta
    assert not load_model_file(path).build().weight.is_meta
    path.write_text(path.read_text().replace("FAIL_ON_META = False", "FAIL_ON_META = True"))
    with caplog.at_level(logging.WARNING, logger="planner.plan.modelfile"):
        model = load_model_file(path).build(meta=True)
    assert not model.weight.is_meta and "on the meta device raised" in caplog.text


_TOO_BIG = """
import resource, sys, time
import torch
from torch import nn
from planner.options import ProfileOptions
from planner.profile.meta import sampled_on_meta
from planner.profile.profiler import profile_model

limit = 4 << 30  # address space: not even one of the model's 2 GiB layers twice over
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
with torch.device("meta"):  # 24 x (32768 x 16384) fp32 = 51.5 GB of parameters
    model = nn.Sequential(*(nn.Linear(16384 if i % 2 else 32768, 32768 if i % 2 else 16384)
                            for i in range(24)))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
# and a batch of 10 million samples (a real one: 1.3 TB), drawn on the meta device
prof = sampled_on_meta(
    lambda b: (torch.randn(b, 32768),),
    10_000_000,
    lambda args: profile_model(model, args, options=ProfileOptions(device="h100", cache=False)),
)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
params = sum(b.param_bytes for b in prof.blocks)
print(params, prof.batch_size, grew, round(time.perf_counter() - started, 1))
"""


def test_a_model_too_big_to_allocate_profiles_in_little_memory() -> None:
    got = subprocess.run(
        [sys.executable, "-c", _TOO_BIG],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    params, batch, grew_kib, _seconds = got.stdout.split()
    assert int(params) == (24 * 32768 * 16384 + 12 * (16384 + 32768)) * 4  # 51.5 GB
    assert int(batch) == 10_000_000
    assert int(grew_kib) < 300 * 1024  # peak RSS growth under 300 MiB
