"""ZeRO-1 (``dp_mode: zero1``): the shares the runtime makes, how they are priced, and searched.

The runtime gives whole tensors to replicas (planner.plan.shares.owners); the cost
model prices a replica's share by the bound that assignment guarantees
([Note: ZeRO-1 shares] in planner.cost.basis); the search tries every mode
with ``--dp-mode auto`` (FSDP too: tests/search/test_fsdp_mode.py) and picks a
sharded one where DDP's whole optimizer state does not fit.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from models import chain_profiles

from planner.cost.basis import Layout
from planner.cost.model import CostModel
from planner.devices import from_gpus
from planner.options import SearchOptions, Training
from planner.plan.shares import owners
from planner.search import search

GIB = 2**30


@pytest.mark.parametrize("replicas", [1, 2, 3, 8])
def test_owners_keep_every_share_within_the_priced_bound(replicas: int) -> None:
    rng = random.Random(replicas)
    for _ in range(50):
        sizes = [rng.choice([1, 4, 16, 256, 4096]) * rng.randint(1, 9) for _ in range(40)]
        who = owners(sizes, replicas)
        loads = [sum(s for s, r in zip(sizes, who, strict=True) if r == k) for k in range(replicas)]
        bound = sum(sizes) / replicas + (1 - 1 / replicas) * max(sizes)
        assert sum(loads) == sum(sizes) and max(loads) <= bound + 1e-9
    assert owners([4, 1, 3, 2], 2) == [0, 0, 1, 1]  # deterministic: every replica agrees


def _cost(dp_mode: str, dp: int = 4, tensors: tuple[int, ...] = ()) -> CostModel:
    profile_for = chain_profiles(n_blocks=8, param_bytes=256 * 2**20)

    def profiles(device: str, b: int):  # type: ignore[no-untyped-def]
        prof = profile_for(device, b)
        blocks = tuple(replace(x, param_tensors=tensors) for x in prof.blocks)
        return replace(prof, blocks=blocks)

    layout = Layout(
        pp=2, dp=dp, micro_batches=4, schedule="1f1b",
        ranks=tuple(tuple(r * 2 + s for r in range(dp)) for s in range(2)), dp_mode=dp_mode,
    )  # fmt: skip
    training = Training(global_batch=16 * dp)
    return CostModel({"h100": profiles("h100", 4)}, from_gpus(2 * dp, "h100"), training, layout)


def test_a_share_is_priced_at_its_bound_and_the_weights_are_sent() -> None:
    mib = 2**20
    ddp, zero = _cost("ddp"), _cost("zero1", tensors=(128 * mib, 64 * mib, 32 * mib, 32 * mib))
    whole = _cost("zero1")  # an older profile: no tensors listed
    n = 4 * 256 * mib / 4  # stage 0: blocks 0-3, fp32 parameters
    assert ddp.memory(0, 0, 4, False).optimizer == pytest.approx(8 * n)  # Adam: two moments
    # The runtime's assignment: each replica one 128, one 64 and two 32 MiB tensors.
    assert zero.memory(0, 0, 4, False).optimizer == pytest.approx(8 * n / 4)
    # Blocks 0-2 (3 × 128, 3 × 64, 6 × 32 MiB on 4 replicas, largest first to the least
    # loaded): 128+64, 128+32+32, 128+32+32, 64+64+32+32: 192 MiB each, where Graham's
    # bound says 768 / 4 + 0.75 × 128 = 288.
    assert zero.basis.stepped(0, 0, 3) == pytest.approx(192 * mib / 4)
    # Without the tensors, Graham's bound: a block's whole parameters stand for the largest.
    assert whole.memory(0, 0, 4, False).optimizer == pytest.approx(8 * (n / 4 + 0.75 * n / 4))
    assert zero.time.gather_ms(0, 0, 4) > 0 == ddp.time.gather_ms(0, 0, 4)
    assert zero.time.optimizer_ms(0, 0, 4) < ddp.time.optimizer_ms(0, 0, 4)
    assert zero.time.reduce_ms(0, 0, 4) == ddp.time.reduce_ms(0, 0, 4)  # gradients stay whole
    for i in range(8):  # the floor the search prunes with stays below every peak
        for j in range(i + 1, 9):
            s = 0 if j <= 4 else 1
            assert zero.memory_floor(s, i, j) <= zero.memory(s, i, j, True).total


def test_zero1_needs_replicas() -> None:
    with pytest.raises(ValueError, match="needs dp ≥ 2"):
        _cost("zero1", dp=1)
    with pytest.raises(ValueError, match="dp_mode"):
        SearchOptions(dp_mode="zero3")
    with pytest.raises(ValueError, match="no replicas to share the optimizer state"):
        _search(SearchOptions(dp=1, dp_mode="zero1"))


def _search(options: SearchOptions):  # type: ignore[no-untyped-def]
    # 4 blocks of 1.125 Gi fp32 parameters (4.5 Gi in all; tensors of 0.14 Gi) on 8 H100
    # (71.6 GiB usable): at pp 1, DDP holds 20 bytes a parameter (weights, gradients, its
    # buckets, Adam's moments: 90 GiB), ZeRO-1 12 and a share of the moments (about 62 GiB).
    chain = chain_profiles(n_blocks=4, param_bytes=int(4.5 * GIB), heavy_ends=False)

    def profile_for(device: str, b: int):  # type: ignore[no-untyped-def]
        prof = chain(device, b)
        blocks = tuple(replace(x, param_tensors=(x.param_bytes // 8,) * 8) for x in prof.blocks)
        return replace(prof, blocks=blocks)

    return search(
        profile_for,
        from_gpus(8, "h100"),
        Training(global_batch=8),
        options,
        n_blocks=4,
    )


def test_auto_searches_every_mode_and_takes_a_sharded_one_where_ddp_does_not_fit() -> None:
    pinned = {"pp": 1, "dp": 8, "micro_batches": 1}
    with pytest.raises(ValueError, match="no configuration fits") as err:
        _search(SearchOptions(**pinned))
    assert "--dp-mode auto (ZeRO-1" in str(err.value)
    zero = _search(SearchOptions(**pinned, dp_mode="zero1"))
    assert zero.layout.dp_mode == "zero1" and zero.prediction.fits
    res = _search(SearchOptions(**pinned, dp_mode="auto"))
    modes = {c.dp_mode for c in res.candidates}
    assert modes == {"ddp", "zero1", "fsdp"}
    # FSDP fits too and moves fewer bytes (a gather and a scatter, no broadcasts after
    # the step): faster by more than the robust band, so it is chosen over ZeRO-1.
    assert res.layout.dp_mode == "fsdp" and res.prediction.fits
    assert res.prediction.step_ms * 1.08 < zero.prediction.step_ms
    chosen = [c for c in res.candidates if c.status == "chosen"]
    assert chosen[0].dp_mode == "fsdp"
