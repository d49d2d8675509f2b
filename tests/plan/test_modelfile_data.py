"""The model file's data source (planner.plan.modelfile): ``dataset()`` and ``collate``."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from planner.plan.modelfile import ModelFile, ModelFileError, load_model_file

HEAD = """
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

def build_model():
    return nn.Linear(4, 2)

def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))

class Pairs(Dataset):
    def __init__(self, n=6):
        self.n = n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return torch.full((4,), float(i)), i % 2
"""


def _load(tmp_path: Path, body: str) -> ModelFile:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(HEAD) + textwrap.dedent(body))
    return load_model_file(path)


def _error(fn: Callable[..., Any], *args: Any) -> str:
    with pytest.raises(ModelFileError) as info:
        fn(*args)
    return str(info.value)


def test_a_file_without_a_dataset_has_none(tmp_path: Path) -> None:
    mf = _load(tmp_path, "")
    assert not mf.has_dataset
    assert "defines no dataset()" in _error(mf.dataset)


def test_default_collate_stacks_one_sample_items_batch_first(tmp_path: Path) -> None:
    mf = _load(tmp_path, "def dataset():\n    return Pairs()\n")
    assert mf.has_dataset
    ds = mf.dataset()
    batch = mf.collate([ds[i] for i in (4, 1, 2)])
    assert batch.size == 3 and batch.kwargs == {}
    assert torch.equal(batch.args[0][:, 0], torch.tensor([4.0, 1.0, 2.0]))
    assert torch.equal(batch.targets, torch.tensor([0, 1, 0]))


def test_dict_inputs_collate_into_keyword_arguments(tmp_path: Path) -> None:
    mf = _load(
        tmp_path,
        """
        class Named(Pairs):
            def __getitem__(self, i):
                x, y = super().__getitem__(i)
                return {"x": x, "mask": torch.ones(4)}, y

        def dataset():
            return Named()
        """,
    )
    ds = mf.dataset()
    batch = mf.collate([ds[0], ds[1]])
    assert batch.args == () and set(batch.kwargs) == {"x", "mask"}
    assert batch.kwargs["mask"].shape == (2, 4) and batch.size == 2


def test_the_files_own_collate_is_used(tmp_path: Path) -> None:
    mf = _load(
        tmp_path,
        """
        def dataset():
            return Pairs()

        def collate(samples):
            xs = torch.stack([x for x, _ in samples]) * 10
            return xs, torch.tensor([y for _, y in samples])
        """,
    )
    ds = mf.dataset()
    assert torch.equal(mf.collate([ds[3]]).args[0], torch.full((1, 4), 30.0))


def test_a_collate_that_loses_samples_is_refused(tmp_path: Path) -> None:
    mf = _load(
        tmp_path,
        """
        def dataset():
            return Pairs()

        def collate(samples):
            return torch.stack([x for x, _ in samples[:1]]), torch.tensor([0])
        """,
    )
    ds = mf.dataset()
    text = _error(mf.collate, [ds[0], ds[1]])
    assert "collate(<2 samples>) returned inputs with batch dimension 1; dim 0 should be 2" in text
    assert "collate must give one sample per item, stacked batch first" in text


def test_items_that_are_not_pairs_are_refused(tmp_path: Path) -> None:
    mf = _load(
        tmp_path,
        """
        class Bare(Pairs):
            def __getitem__(self, i):
                return torch.zeros(4)

        def dataset():
            return Bare()
        """,
    )
    ds = mf.dataset()
    text = _error(mf.collate, [ds[0], ds[1]])
    assert "default_collate(<2 samples>) returned a Tensor, not a pair (inputs, targets)" in text
    assert "each item of the dataset is one sample's pair" in text


def test_an_iterable_dataset_is_refused_with_the_reason(tmp_path: Path) -> None:
    mf = _load(
        tmp_path,
        """
        class Stream(IterableDataset):
            def __iter__(self):
                yield torch.zeros(4), 0

        def dataset():
            return Stream()
        """,
    )
    text = _error(mf.dataset)
    assert "dataset() returned a Stream, which has no len() and [i]" in text
    assert "shards each step's samples over the replicas by index" in text
    assert "return a map-style torch.utils.data.Dataset" in text


def test_an_empty_dataset_and_one_that_raises_are_refused(tmp_path: Path) -> None:
    empty = _load(tmp_path, "def dataset():\n    return Pairs(0)\n")
    assert "dataset() returned an empty Pairs (len 0)" in _error(empty.dataset)
    raising = _load(tmp_path, "def dataset():\n    raise FileNotFoundError('/data/train')\n")
    text = _error(raising.dataset)
    assert "dataset() raised FileNotFoundError at line" in text and "/data/train" in text


@pytest.mark.parametrize("name", ["dataset", "collate"])
def test_a_dataset_or_collate_that_is_not_callable_is_refused_at_load(
    tmp_path: Path, name: str
) -> None:
    with pytest.raises(ModelFileError) as info:
        _load(tmp_path, f"{name} = Pairs()\n")
    text = str(info.value)
    assert f"not callable: {name}" in text
    assert "dataset() -> map-style Dataset of (inputs, targets) samples (optional)" in text
