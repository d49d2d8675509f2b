"""The batch of each step (runtime/data.py), in one process: shards, epochs, determinism.

The worker runs (replicas through ``planner run``, a resume) are in
``test_data_runs.py``.
"""

from __future__ import annotations

import itertools
import re
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from repo import EXAMPLES, ROOT

from planner.plan import Plan
from planner.plan.modelfile import load_model_file
from runtime.data import Feed, Sharding, replica_of


def _plan(global_batch: int, dp: int = 1, pp: int = 1) -> Plan:
    """What a Feed reads of a plan: its global batch, dp and rank order."""
    ranks = [[s * dp + r for s in range(pp)] for r in range(dp)]
    return cast(
        Plan,
        SimpleNamespace(
            global_batch=global_batch, dp=dp, pp=pp, world_size=pp * dp, ranks=lambda: ranks
        ),
    )


# --------------------------------------------------------------------------- sharding


@pytest.mark.parametrize(("n", "batch", "dp"), [(40, 8, 2), (37, 12, 4), (16, 16, 1), (9, 3, 3)])
def test_replicas_read_disjoint_shards_that_make_the_global_batch(n: int, batch: int, dp: int):
    shards = [
        Sharding(n_samples=n, global_batch=batch, dp=dp, replica=r, seed=5) for r in range(dp)
    ]
    one = Sharding(n_samples=n, global_batch=batch, dp=1, replica=0, seed=5)
    for step in range(3 * one.steps_per_epoch):
        parts = [s.indices(step) for s in shards]
        assert all(len(p) == batch // dp for p in parts)
        joined = [i for part in parts for i in part]
        assert joined == one.global_indices(step) == shards[0].global_indices(step)
        assert len(set(joined)) == batch  # disjoint


def test_an_epoch_reads_each_sample_at_most_once_and_skips_only_the_tail() -> None:
    s = Sharding(n_samples=37, global_batch=12, dp=4, replica=0, seed=1)
    assert s.steps_per_epoch == 3
    for epoch in range(3):
        steps = range(epoch * 3, epoch * 3 + 3)
        read = [i for step in steps for r in range(4) for i in _replica(s, r).indices(step)]
        assert len(read) == len(set(read)) == 36 and set(read) <= set(range(37))


def _replica(s: Sharding, r: int) -> Sharding:
    return Sharding(
        n_samples=s.n_samples, global_batch=s.global_batch, dp=s.dp, replica=r, seed=s.seed
    )


def test_the_order_is_seeded_by_the_seed_and_the_epoch_only() -> None:
    a = Sharding(n_samples=64, global_batch=8, dp=2, replica=1, seed=3)
    b = Sharding(n_samples=64, global_batch=8, dp=2, replica=1, seed=3)
    assert [b.indices(k) for k in (17, 2, 9)] == [a.indices(k) for k in (17, 2, 9)]  # any order
    epoch0 = [i for k in range(8) for i in a.global_indices(k)]
    epoch1 = [i for k in range(8, 16) for i in a.global_indices(k)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(64)) and epoch0 != epoch1
    other = Sharding(n_samples=64, global_batch=8, dp=2, replica=1, seed=4)
    assert [other.indices(k) for k in range(8)] != [a.indices(k) for k in range(8)]
    g = torch.Generator().manual_seed(3 + 1)  # [Note: the data order]: randperm under s + e
    assert a.global_indices(8) == torch.randperm(64, generator=g)[:8].tolist()


def test_a_dataset_smaller_than_a_global_batch_is_refused() -> None:
    with pytest.raises(ValueError, match=r"the dataset has 5 samples, fewer than one global batch"):
        Sharding(n_samples=5, global_batch=8, dp=2, replica=0, seed=0)


def test_replica_of_follows_the_plans_rank_order() -> None:
    plan = _plan(8, dp=2, pp=2)  # ranks [[0, 2], [1, 3]]
    assert [replica_of(plan, r) for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="rank 4 runs no stage of the plan"):
        replica_of(plan, 4)


# --------------------------------------------------------------------------- the feed

DATA_FILE = """
import torch
from torch import nn
from torch.utils.data import Dataset

READ = []

class Numbers(Dataset):
    def __init__(self):
        self.noise = torch.randn(20)  # drawn at random: the same for the same seed
    def __len__(self):
        return 20
    def __getitem__(self, i):
        READ.append(i)
        return torch.tensor([float(i), float(self.noise[i])]), i % 3

def build_model():
    return nn.Linear(2, 3)

def sample_batch(batch_size):
    return torch.randn(batch_size, 2), torch.randint(0, 3, (batch_size,))

def dataset():
    return Numbers()
"""


def test_a_feed_reads_only_its_replicas_shard_and_keeps_the_last_batch(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text(DATA_FILE)
    mf = load_model_file(tmp_path / "model.py")
    read = mf.module.READ
    feed = Feed.of(mf, _plan(8, dp=2), replica=1, seed=7)
    assert (
        feed.sharding is not None
        and "dataset() of 20 samples, 2 steps per epoch" in feed.describe()
    )
    for step in (0, 1, 2):
        read.clear()
        batch = feed.batch(step)
        want = feed.sharding.indices(step)
        assert read == want and len(want) == 4  # its shard only, in order
        assert batch.args[0][:, 0].tolist() == [float(i) for i in want]
        assert batch.targets.tolist() == [i % 3 for i in want]
    read.clear()
    assert feed.batch(2) is batch and read == []  # kept: step 1's trace read is not repeated
    again = Feed.of(mf, _plan(8, dp=2), replica=1, seed=7)
    assert torch.equal(again.batch(0).args[0], feed.batch(0).args[0])  # the noise too


def test_every_stage_of_a_replica_reads_the_same_samples(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text(DATA_FILE)
    mf = load_model_file(tmp_path / "model.py")
    plan = _plan(8, dp=2, pp=2)  # ranks [[0, 2], [1, 3]]: rank = stage · dp + replica
    feeds = [Feed.of(mf, plan, replica=replica_of(plan, rank), seed=3) for rank in range(4)]
    for step in (0, 1, 4):
        batches = [f.batch(step).args[0] for f in feeds]
        assert torch.equal(batches[0], batches[2]) and torch.equal(batches[1], batches[3])
        assert not torch.equal(batches[0], batches[1])


def test_a_feed_without_a_dataset_keeps_a_copy_of_its_replicas_slice() -> None:
    mf = load_model_file(EXAMPLES / "mlp.py")
    feed = Feed.of(mf, _plan(4, dp=2), replica=1, seed=0)
    rng = torch.random.get_rng_state()
    first, second = feed.batch(0), feed.batch(1)
    assert torch.equal(torch.random.get_rng_state(), rng)  # the training RNG untouched
    assert first.size == second.size == 2  # its replica's half of the global batch of 4
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0 + 1)  # seed + step: sample_batch's global batch of step 1
        whole = mf.sample(4)
    other = Feed.of(mf, _plan(4, dp=2), replica=0, seed=0).batch(1)
    assert torch.equal(other.args[0], whole.args[0][:2]) and torch.equal(
        second.args[0], whole.args[0][2:]
    )
    assert torch.equal(second.targets, whole.targets[2:])
    x = second.args[0]  # a copy: the global batch is not kept alive behind a view of it
    assert x.untyped_storage().nbytes() == x.numel() * x.element_size()
    one = Feed.of(mf, _plan(4), replica=0, seed=0).batch(1)  # dp 1: the global batch as it is
    assert torch.equal(one.args[0], whole.args[0])


def _readme_model() -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(# model\.py\n.*?)```", text, re.S)
    assert block is not None, "README.md has no ```python block starting with # model.py"
    return textwrap.dedent(block.group(1))


def _steps_differ(mf: Any, size: int) -> None:
    feed = Feed.of(mf, _plan(size), replica=0, seed=0)
    batches = [feed.batch(step) for step in range(3)]
    for a, b in itertools.pairwise(batches):
        assert not torch.equal(a.args[0], b.args[0]), "two steps trained on the same inputs"
    replay = Feed.of(mf, _plan(size), replica=0, seed=0)
    assert torch.equal(replay.batch(2).args[0], batches[2].args[0])  # and reproducibly so


def test_the_readme_pattern_gives_every_step_new_data(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text(_readme_model())
    _steps_differ(load_model_file(tmp_path / "model.py"), 4)


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet", "unet"])  # hf_gpt2: torch's RNG
def test_every_example_gives_every_step_new_data(name: str, monkeypatch: pytest.MonkeyPatch):
    for key, value in {"GPT_SEQ": "8", "UNET_RES": "16", "RESNET_RES": "8"}.items():
        monkeypatch.setenv(key, value)
    _steps_differ(load_model_file(EXAMPLES / f"{name}.py"), 2)
