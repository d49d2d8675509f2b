"""Each training step's batch: the model file's dataset sharded over replicas, or sample_batch.

[Note: the data order] With ``dataset()`` (N samples), global batch B, dp
replicas and seed s, step n (0-based; ``planner run`` prints it as n + 1)::

    E       = N // B                  steps per epoch (each epoch skips its last N mod B)
    e, j    = n // E, n mod E         the epoch of step n, and the step within it
    order_e = randperm(N) under torch.Generator().manual_seed(s + e)
    batch_n = order_e[j·B : (j+1)·B]                          the global batch
    shard_r = order_e[j·B + r·B/dp : j·B + (r+1)·B/dp]        what replica r reads

(``DistributedSampler``'s seeding, ``drop_last=True``; but each replica reads a
contiguous slice of the global batch, the slice ``ParallelModel.step`` takes of
a global batch, rather than every dp-th sample.) Every stage of a replica reads
the same shard: the first stage feeds its inputs, the last its targets. The
order depends on (s, n, N, B) alone, not on what ran before: a run resumed at
step k reads at step k + 1 what an uninterrupted run reads, and one resumed at
another dp (``--reshard``) still trains step n on the same global batch.

Without ``dataset()``, step n's batch is ``sample_batch(B)`` called with
torch's RNG seeded to ``s + n`` (the training RNG untouched), the same global
batch on every rank; each rank keeps a copy of its replica's slice of it (the
slice ``ParallelModel.step`` would take) and lets the global batch go: held
whole, every rank would keep dp times the batch its replica trains on (on a CPU
device that is the stage's memory: [Note: the batch a process holds] in
``planner.cost.stage_memory``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
from torch.utils import _pytree as pytree

from planner.plan.batch import Batch, slice_batch
from planner.plan.modelfile import ModelFile
from planner.plan.schema import Plan

__all__ = ["Feed", "Sharding", "replica_of"]


@lru_cache(maxsize=2)  # the current epoch's order, and the last one's around a boundary
def _epoch_order(n_samples: int, epoch: int, seed: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed + epoch)
    return tuple(torch.randperm(n_samples, generator=gen).tolist())


@dataclass(frozen=True, kw_only=True)
class Sharding:
    """Which samples of a dataset replica ``replica`` reads at each step ([Note: the data order]).

    ``planner run`` uses it for a model file's ``dataset()``; a training loop of
    ``auto_parallel``'s can feed ``ParallelModel.step`` the same shards:
    ``collate([ds[i] for i in sharding.indices(step)])``.

    Example::

        >>> s = Sharding(n_samples=10, global_batch=4, dp=2, replica=1, seed=0)
        >>> s.steps_per_epoch, len(s.indices(0))
        (2, 2)
        >>> s.indices(0) == s.global_indices(0)[2:]
        True

    Raises:
        ValueError: fewer samples than one global batch, or a global batch
            that the replicas cannot share evenly.
    """

    n_samples: int
    global_batch: int
    dp: int
    replica: int
    seed: int

    def __post_init__(self) -> None:
        if self.n_samples < self.global_batch:
            raise ValueError(
                f"the dataset has {self.n_samples} samples, fewer than one global batch "
                f"({self.global_batch}): a step would have nothing to read. fix: a larger "
                f"dataset, or re-plan for a global batch ≤ {self.n_samples} "
                "(planner plan --batch-size N)"
            )
        if self.global_batch % self.dp or not 0 <= self.replica < self.dp:
            raise ValueError(
                f"global batch {self.global_batch} over dp {self.dp} replicas (replica "
                f"{self.replica}): the plan must give every replica B/dp samples"
            )

    @property
    def steps_per_epoch(self) -> int:
        """E = N // B: steps until every sample was read once (the last N mod B skipped)."""
        return self.n_samples // self.global_batch

    @property
    def shard_size(self) -> int:
        """B / dp: the samples one replica reads per step."""
        return self.global_batch // self.dp

    def epoch(self, step: int) -> int:
        """The epoch of ``step`` (0-based)."""
        return step // self.steps_per_epoch

    def global_indices(self, step: int) -> list[int]:
        """The dataset indices of step ``step``'s global batch (0-based step), in order."""
        if step < 0:
            raise ValueError(f"steps count from 0, got {step}")
        order = _epoch_order(self.n_samples, self.epoch(step), self.seed)
        lo = (step % self.steps_per_epoch) * self.global_batch
        return list(order[lo : lo + self.global_batch])

    def indices(self, step: int) -> list[int]:
        """The dataset indices this replica reads at ``step``: its slice of the global batch."""
        lo = self.replica * self.shard_size
        return self.global_indices(step)[lo : lo + self.shard_size]


@dataclass(kw_only=True, eq=False)
class Feed:
    """The batch of each step for one replica: what ``planner run``'s worker trains on.

    Example::

        feed = Feed.of(load_model_file("model.py"), plan, replica=0, seed=0)
        batch = feed.batch(step)   # this replica's shard of the step's global batch
        loss = pmodel.step(batch.inputs(), batch.targets)

    Attributes:
        model_file: the loaded model file.
        plan: the plan (its global batch, dp).
        seed: ``--seed``.
        replica: which replica's shard of ``sample_batch``'s global batch to keep.
        dataset: the file's ``dataset()``, or None (``sample_batch`` then).
        sharding: which samples this replica reads, with a dataset.
    """

    model_file: ModelFile
    plan: Plan
    seed: int
    replica: int = 0
    dataset: Any = None
    sharding: Sharding | None = None
    _last: tuple[int, Batch] | None = field(default=None, init=False, repr=False)

    @classmethod
    def of(cls, mf: ModelFile, plan: Plan, *, replica: int, seed: int) -> Feed:
        """The feed of replica ``replica``: the file's dataset when it has one.

        ``dataset()`` is called once, with torch's RNG seeded to ``seed`` (and
        restored after), so a dataset drawn at random is the same on every rank.

        Raises:
            ModelFileError: ``dataset()`` breaks the contract.
            ValueError: the dataset is smaller than one global batch.
        """
        if not mf.has_dataset:
            return cls(model_file=mf, plan=plan, seed=seed, replica=replica)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # a dataset drawn at random is the same on every rank
            ds = mf.dataset()
        sharding = Sharding(
            n_samples=len(ds),
            global_batch=plan.global_batch,
            dp=plan.dp,
            replica=replica,
            seed=seed,
        )
        return cls(
            model_file=mf, plan=plan, seed=seed, replica=replica, dataset=ds, sharding=sharding
        )

    def batch(self, step: int) -> Batch:
        """Step ``step``'s batch (0-based): this replica's B/dp samples of the global batch.

        The last batch read is kept: the first step's, read for tracing the
        stage, is not read again for training it.
        """
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        if self.sharding is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed + step)
                batch = self._own_shard(self.model_file.sample(self.plan.global_batch))
        else:
            batch = self.model_file.collate([self.dataset[i] for i in self.sharding.indices(step)])
        self._last = (step, batch)
        return batch

    def _own_shard(self, batch: Batch) -> Batch:
        """This replica's slice of the global ``batch``, copied, so that the global one is freed
        (a batch of another size is left whole: ``ParallelModel.step`` explains it)."""
        dp, size = self.plan.dp, self.plan.global_batch
        if dp == 1 or batch.size != size:
            return batch
        lo = self.replica * (size // dp)
        cut = slice_batch((batch.args, batch.kwargs, batch.targets), lo, lo + size // dp, size)
        args, kwargs, targets = pytree.tree_map(
            lambda t: t.clone() if isinstance(t, torch.Tensor) else t, cut
        )
        return Batch(args=args, kwargs=kwargs, targets=targets)

    def describe(self) -> str:
        """One line for the log: where the data comes from."""
        if self.sharding is None:
            return (
                f"data: sample_batch({self.plan.global_batch}), torch's RNG seeded to "
                f"{self.seed} + step"
            )
        sh = self.sharding
        return (
            f"data: dataset() of {sh.n_samples} samples, {sh.steps_per_epoch} steps per epoch, "
            f"{sh.shard_size} samples per replica per step (seed {sh.seed})"
        )


def replica_of(plan: Plan, rank: int) -> int:
    """The replica that global rank ``rank`` runs a stage of, in the plan's rank order.

    >>> replica_of(plan, int(os.environ["RANK"]))  # doctest: +SKIP
    1

    Raises:
        ValueError: the plan has no such rank.
    """
    for replica, row in enumerate(plan.ranks()):
        if rank in row:
            return replica
    raise ValueError(
        f"rank {rank} runs no stage of the plan (ranks 0..{plan.world_size - 1}, pp {plan.pp} × "
        f"dp {plan.dp}); start pp × dp workers"
    )
