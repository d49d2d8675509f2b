"""Profile: figures per block, the model left unchanged, analytic FLOPs, the cache."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from models import Net, model_state
from repo import EXAMPLES
from torch import nn

from planner import cache
from planner.options import ProfileOptions
from planner.plan.records import ModelProfile
from planner.profile import profile_model

FAST = ProfileOptions(repeats=1, warmup=0, cache=False)


@pytest.fixture(autouse=True)
def _empty_cache(cache_dir):
    """Every test profiles into an empty cache."""


def test_profiling_leaves_the_model_unchanged() -> None:
    torch.manual_seed(0)
    model = Net().train()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model(x).sum().backward()  # some existing .grad to keep
    before = model_state(model)
    prof = profile_model(model, (x,), targets=y, loss_fn=F.cross_entropy, options=FAST)
    after = model_state(model)
    assert prof.blocks
    for k, v in before["tensors"].items():
        assert torch.equal(v, after["tensors"][k]), k  # BN statistics included
    for k, g in before["grads"].items():
        assert torch.equal(g, after["grads"][k]), k
    assert before["training"] == after["training"]
    assert torch.equal(before["rng"], after["rng"])


def test_measured_profile_figures() -> None:
    model = Net()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    prof = profile_model(model, (x,), targets=y, loss_fn=F.cross_entropy, options=FAST)
    names = [b.name for b in prof.blocks]
    assert names == ["inp", "bn", "drop", "mid", "out"]
    assert prof.source == "measured" and prof.device == "cpu" and prof.batch_size == 8
    assert prof.threads == torch.get_num_threads()
    # Parameters: inp 16·32+32, bn 32+32 (+ buffers), mid 32·32+32, out 32·4+4; fp32.
    assert [b.param_bytes for b in prof.blocks] == [
        4 * (16 * 32 + 32),
        4 * 64,
        0,
        4 * (32 * 32 + 32),
        4 * (32 * 4 + 4),
    ]
    assert prof.blocks[1].buffer_bytes == 4 * 64 + 8  # running mean/var + num_batches_tracked
    # h (8×32 fp32 = 1024 B) skips over bn, drop and mid; `y + h` runs before `out`
    # is called, so only the sum crosses out's split point.
    assert [b.boundary_bytes for b in prof.blocks] == [0, 1024, 2048, 2048, 1024]
    assert all(b.fwd_ms > 0 and b.bwd_ms > 0 for b in prof.blocks)
    # h (1024 B) is saved by bn and charged to inp, which made it; x, saved by inp
    # for its weight's gradient, is the batch and charged to no block.
    assert prof.blocks[0].activation_bytes == 1024
    assert prof.whole_fwd_ms and prof.whole_bwd_ms and prof.loss_fwd_ms > 0
    assert sum(b.fwd_flops for b in prof.blocks) == 2 * 8 * (16 * 32 + 32 * 32 + 32 * 4)


def _distinct_saved(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages ``model``'s forward on ``x`` saves for the backward,
    but the batch's, the weights' and the buffers' (they exist whatever it saves)."""
    skip = {t.untyped_storage().data_ptr() for t in [x, *model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(saved.values())


def test_saved_bytes_count_each_tensor_once() -> None:
    # ReLU saves its output and the next Linear saves the same tensor as its input:
    # the backward keeps it once, so the blocks' figures sum to the model's own.
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )
    x = torch.randn(8, 16)
    prof = profile_model(model, (x,), options=FAST)
    assert sum(b.activation_bytes for b in prof.blocks) == _distinct_saved(model, x)
    assert prof.blocks[-1].activation_bytes == 0  # its input was made (and saved) earlier


def test_analytic_flops_of_a_linear_block_match_the_textbook() -> None:
    b, n_in, n_out = 32, 256, 512
    model = nn.Sequential(nn.Linear(n_in, n_out), nn.Linear(n_out, n_out))
    prof = profile_model(
        model, (torch.randn(b, n_in),), options=ProfileOptions(device="h100", cache=False)
    )
    first, second = prof.blocks
    assert prof.source == "analytic" and prof.device == "h100"
    assert first.fwd_flops == 2 * b * n_in * n_out
    # The first layer's input needs no gradient: only the weight gradient.
    assert first.bwd_flops == 2 * b * n_in * n_out
    assert second.bwd_flops == 4 * b * n_out * n_out
    assert prof.whole_fwd_ms is None
    assert 0 < first.fwd_ms < 1.0  # microseconds on an H100


def test_analytic_bf16_halves_activation_bytes() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    x = torch.randn(16, 64)
    fp32 = profile_model(model, (x,), options=ProfileOptions(device="a100-80gb", cache=False))
    bf16 = profile_model(
        model, (x,), options=ProfileOptions(device="a100-80gb", dtype="bf16", cache=False)
    )
    assert [b.boundary_bytes // 2 for b in fp32.blocks] == [b.boundary_bytes for b in bf16.blocks]
    # Parameters too: bytes ÷ the profile's dtype size is the parameter count in both.
    assert [b.param_bytes // 2 for b in fp32.blocks] == [b.param_bytes for b in bf16.blocks]
    assert bf16.dtype == "bf16"
    assert sum(b.fwd_ms for b in bf16.blocks) < sum(b.fwd_ms for b in fp32.blocks)


def test_profiles_are_cached_and_a_broken_entry_is_rebuilt() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    x = torch.randn(4, 8)
    opts = ProfileOptions(repeats=1, warmup=0)
    first = profile_model(model, (x,), options=opts)
    files = list(cache.cache_dir().glob("profile-*.json"))
    assert len(files) == 1
    again = profile_model(model, (x,), options=opts)
    assert again == first  # read back, not re-measured (times would differ)
    # Another batch size is another entry.
    profile_model(model, (torch.randn(2, 8),), options=opts)
    assert len(list(cache.cache_dir().glob("profile-*.json"))) == 2
    # A truncated entry is ignored and replaced.
    files[0].write_text(files[0].read_text()[:20])
    rebuilt = profile_model(model, (x,), options=opts)
    assert rebuilt.blocks and json.loads(files[0].read_text())["fingerprint"] == first.fingerprint
    assert not list(cache.cache_dir().glob(".profile-*"))  # no temporary files left


def test_profile_round_trips_through_a_dict() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    prof = profile_model(model, (torch.randn(4, 8),), options=FAST)
    assert ModelProfile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="repeats"):
        ProfileOptions(repeats=0)
    with pytest.raises(ValueError, match="analytic"):
        ProfileOptions(dtype="bf16")


def test_unknown_device_type_lists_the_catalogue() -> None:
    with pytest.raises(ValueError, match="h100"):
        profile_model(
            nn.Linear(2, 2), (torch.randn(1, 2),), options=ProfileOptions(device="tpu", cache=False)
        )


def test_examples_profile_dir_exists() -> None:
    assert (EXAMPLES / "gpt.py").exists()


def test_loaded_rounds_are_left_out() -> None:
    from planner.profile.timing import RoundLoad

    load = RoundLoad()
    load.shares = [0.5, 0.0, 0.02, 0.0, 0.6]  # others' share of the cores, per round
    assert load.selection() == [1, 2, 3]
    busy = RoundLoad()
    busy.shares = [0.5, 0.3, 0.9, 0.4]  # none quiet: the least loaded half
    assert busy.selection() == [1, 3]


def test_rounds_in_a_slow_spell_are_left_out() -> None:
    """[Note: a slow spell in the rounds]: a round whose probe took 1.4 times the machine's
    time per op (the least of its figure and every probe) counts as loaded, though no
    other process ran."""
    from planner.profile.timing import RoundLoad

    load = RoundLoad(probe=(lambda: 0.0, 1e-6))
    load.shares = [0.0] * 5
    load.probes = [1.1e-6, 1.0e-6, 2.3e-6, 1.3e-6, 1.5e-6]
    assert load.selection() == [0, 1, 3] and load.quiet() == 3
    fast = RoundLoad(probe=(lambda: 0.0, 2e-6))  # a figure kept from a slow day: the probes'
    fast.shares, fast.probes = [0.0] * 4, [1.0e-6, 1.1e-6, 2.2e-6, 1.05e-6]
    assert fast.selection() == [0, 1, 3]
    spell = RoundLoad(probe=(lambda: 0.0, 1e-6))  # every round slow: the least loaded half
    spell.shares, spell.probes = [0.0, 0.05, 0.0, 0.0], [2e-6] * 4
    assert spell.quiet() == 0 and spell.selection() == [0, 1]


def test_a_profile_in_a_slow_spell_goes_on_for_quiet_rounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every probe twice the machine's time per op: no round is quiet, so the timed rounds
    go on to their most (``MAX_REPEATS``) and the profile says so."""
    from planner.profile import timing

    monkeypatch.setattr(timing, "_probe", lambda model: (lambda: 2e-6, 1e-6))
    model = Net()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    prof = profile_model(model, (x,), targets=y, loss_fn=F.cross_entropy, options=FAST)
    check = prof.split_check
    assert check is not None and check.quiet == 0
    assert check.rounds == timing.MAX_REPEATS


def test_analytic_profiles_of_a_meta_model_equal_those_of_cpu_tensors() -> None:
    # A model too big for RAM is profiled on the meta device: every storage's data_ptr()
    # is 0 there, so saved tensors must be told apart another way, and the backward's
    # seed must not be counted as the block's work.
    from bench.bench_plan import meta_profiling_problem

    assert meta_profiling_problem() == ""


class InPlaceStarts(nn.Module):
    """Blocks that begin by writing into their input: an in-place ReLU, a residual ``+=``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.act = nn.ReLU(inplace=True)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.a(x))
        out = self.b(h)
        out += h
        return self.c(torch.relu_(out))


def test_blocks_that_write_into_their_input_are_profiled_without_changing_it() -> None:
    torch.manual_seed(0)
    model = InPlaceStarts()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    prof = profile_model(model, (x,), targets=y, loss_fn=F.cross_entropy, options=FAST)
    names = [b.name for b in prof.blocks]
    assert "act" in names and "c" in names  # relu_ and += open blocks
    assert all(b.fwd_ms > 0 and b.bwd_ms > 0 for b in prof.blocks)


class _Positions(nn.Module):
    """Block 0 slices a buffer of position ids (a view); block 1 embeds them, saving them."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pos", torch.arange(16).unsqueeze(0))
        self.inp = nn.Linear(8, 8)
        self.emb = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = self.pos[:, : x.shape[1]]
        h = self.inp(x)
        return self.out(h + self.emb(pos))


def test_views_of_buffers_are_no_activations_and_integer_tensors_carry_no_gradient() -> None:
    """The embedding saves its indices, a view of a buffer the model holds anyway: charged
    to no block (as the batch is not). They cross the split point before ``emb`` with the
    linear layer's output, but only that one's gradient comes back."""
    model = _Positions()
    x = torch.randn(2, 12, 8)
    prof = profile_model(model, (x,), options=FAST)
    assert sum(b.activation_bytes for b in prof.blocks) == _distinct_saved(model, x)
    emb = next(b for b in prof.blocks if b.name == "emb")
    assert any("int64" in c for c in emb.crossing)  # the position ids cross here
    assert emb.boundary_grad_bytes == 2 * 12 * 8 * 4  # h's alone: [2, 12, 8] fp32
    assert emb.boundary_bytes == emb.boundary_grad_bytes + 12 * 8  # and pos: [1, 12] int64
