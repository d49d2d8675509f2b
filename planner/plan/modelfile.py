"""Load a user's ``model.py``: the model, a sample batch and the loss, behind one contract.

The model-file contract
=======================

A model file is a plain Python file. The planner *imports* it as a module (its
top-level code runs, as ``import`` would run it) and calls the names below;
nothing is executed into the planner's globals. It defines:

``build_model(**overrides) -> torch.nn.Module`` (required)
    Builds the model. The planner calls it with no arguments, so every keyword
    needs a default; keywords are for programmatic use (tests, sweeps).
``sample_batch(batch_size: int) -> (inputs, targets)`` (required)
    One batch. ``inputs`` is a Tensor (the forward's one positional argument),
    a tuple or list (its positional arguments) or a dict (its keyword
    arguments); ``targets`` is whatever the loss takes. The first tensor of
    ``inputs`` and every tensor of ``targets`` (0-d ones excepted) have
    ``batch_size`` as dim 0: the dimension cut into micro-batches. The planner
    traces and profiles on it; ``planner run`` trains on it when there is no
    ``dataset``, calling it with torch's RNG seeded to ``seed + step``: draw
    from torch's RNG (``torch.randn(batch_size, 512)``), or from a generator
    seeded with ``torch.initial_seed()``, so that every step gets new data.
    (A generator seeded with a constant, or with ``batch_size``, trains every
    step on one batch.)
``dataset() -> torch.utils.data.Dataset`` (optional)
    The training data of ``planner run``: a map-style dataset (``len(ds)`` and
    ``ds[i]``), each item ``(inputs, targets)`` of ONE sample, no batch
    dimension. Each data-parallel replica reads only its shard of each step's
    global batch (``runtime.data``: an epoch permutation seeded by ``--seed``
    and the epoch, the same on every rank, so a resumed run reads what an
    uninterrupted one would). It is called once per worker: open files there,
    do not load them all (``ds[i]`` reads one sample).
``collate(samples: list) -> (inputs, targets)`` (optional)
    Stacks a list of ``dataset`` items into one batch, as ``sample_batch``
    returns it; default ``torch.utils.data.default_collate`` (tensors stacked
    along a new dim 0, numbers made tensors, tuples and dicts entry by entry).
``loss_fn(outputs, targets) -> Tensor`` (optional)
    The scalar training loss, a mean over the batch. ``outputs`` is exactly
    what the model returns (a tensor, tuple, dict or a library's
    ``ModelOutput``): the same object in profiling, planning, ``planner run``
    and ``auto_parallel`` (the runtime rebuilds it on the last stage from the
    stage's tensors). Without it, :func:`default_loss` is used.
``BATCH_SIZE: int`` (optional, default 8)
    The default global batch size.

The module is registered in ``sys.modules`` as ``_planner_model_<hash>`` (a hash
of the absolute path), so it never shadows a module of the user's own and its
``if __name__ == "__main__":`` block does not run. Loading a path again re-reads
the file (no bytecode cache), so edits take effect. During the import the
file's folder is first on ``sys.path`` so it can import sibling modules; those
are imported the ordinary way (cached under their own names, not reloaded with
the model file). ``sys.path`` is restored afterwards. Loading edits ``sys.path``
and ``sys.modules``: load from one thread at a time.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import os
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import IterableDataset, default_collate

from planner.plan.batch import Batch, normalize_inputs, tensors_in
from planner.plan.default_loss import default_loss
from planner.plan.modelimport import ModelFileError, call_error, contract_error, import_fresh
from planner.plan.text import first_line

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "MODULE_PREFIX",
    "ModelFile",
    "ModelFileError",
    "load_model_file",
]

DEFAULT_BATCH_SIZE = 8
"""The global batch size when a model file sets no ``BATCH_SIZE``."""

MODULE_PREFIX = "_planner_model_"
"""The start of a loaded model file's module name (then a hash of its path)."""

log = logging.getLogger(__name__)

_REQUIRED = ("build_model", "sample_batch")
_OPTIONAL = ("loss_fn", "BATCH_SIZE", "dataset", "collate")
_FUNCTIONS = (*_REQUIRED, "loss_fn", "dataset", "collate")


# ----------------------------------------------------------------------------- the model file


@dataclass(frozen=True)
class ModelFile:
    """A loaded model file: call its functions through here.

    Example::

        >>> mf = load_model_file("examples/mlp.py")  # doctest: +SKIP
        >>> model, batch = mf.build(), mf.sample(mf.batch_size)  # doctest: +SKIP
        >>> mf.loss(model(*batch.args, **batch.kwargs), batch.targets).backward()  # doctest: +SKIP

    Attributes:
        path: the file's absolute path.
        module: the imported module.
        batch_size: ``BATCH_SIZE`` from the file, or ``DEFAULT_BATCH_SIZE``.
    """

    path: Path
    module: types.ModuleType
    batch_size: int = DEFAULT_BATCH_SIZE

    @property
    def has_loss_fn(self) -> bool:
        """Whether the file defines its own ``loss_fn``."""
        return callable(getattr(self.module, "loss_fn", None))

    @property
    def has_dataset(self) -> bool:
        """Whether the file defines ``dataset()``: ``planner run`` then trains on it."""
        return callable(getattr(self.module, "dataset", None))

    def _raised(self, call: str, exc: BaseException, why: str = "") -> ModelFileError:
        return call_error(self.path, call, exc, why)

    def build(self, *, meta: bool = False) -> nn.Module:
        """Call ``build_model()`` and check that it returned an ``nn.Module``.

        Example::

            >>> mf.build(meta=True).head.weight.is_meta  # doctest: +SKIP
            True

        Args:
            meta: build under ``torch.device("meta")``: parameters get shapes and
                no memory (what an analytic plan needs; a 70 B model builds in
                seconds). When that build raises (a file that loads weights, say),
                the model is built as usual and the reason logged.

        Raises:
            ModelFileError: ``build_model`` raised, or returned something else.
        """
        model = self._build_on_meta() if meta else None
        try:
            model = self.module.build_model() if model is None else model
        except Exception as exc:
            raise self._raised("build_model()", exc) from exc
        if not isinstance(model, nn.Module):
            raise contract_error(
                self.path,
                f"build_model() returned {type(model).__name__}, not a torch.nn.Module",
                "the planner traces, profiles and splits an nn.Module",
                "return the model itself, e.g. `return MyModel()`",
            )
        return model

    def _build_on_meta(self) -> Any:
        try:
            with torch.device("meta"):
                return self.module.build_model()
        except Exception as exc:
            log.warning(
                "build_model() on the meta device raised %s: %s; building it with real "
                "tensors (this allocates its parameters)",
                type(exc).__name__,
                first_line(exc),
            )
            return None

    def sample(self, batch_size: int) -> Batch:
        """Call ``sample_batch(batch_size)``, normalize it and check its batch dimension.

        Raises:
            ValueError: ``batch_size`` is not a positive int.
            ModelFileError: ``sample_batch`` raised, did not return
                ``(inputs, targets)``, or returned a batch of another size.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        call = f"sample_batch({batch_size})"
        try:
            result = self.module.sample_batch(batch_size)
        except Exception as exc:
            raise self._raised(call, exc) from exc
        return self._checked(call, result, batch_size, "sample_batch")

    def dataset(self) -> Any:
        """Call ``dataset()`` and check that it is a map-style dataset with samples.

        Example::

            >>> ds = mf.dataset()  # doctest: +SKIP
            >>> batch = mf.collate([ds[i] for i in range(4)])  # doctest: +SKIP

        Raises:
            ModelFileError: the file has no ``dataset``; it raised; or it returned
                something without ``len()`` and ``[i]`` (an iterable dataset),
                or an empty one.
        """
        if not self.has_dataset:
            raise contract_error(
                self.path,
                "defines no dataset()",
                "only a file that defines dataset() has one to read",
                "define `def dataset(): return MyDataset(...)`, or train on sample_batch",
            )
        try:
            ds = self.module.dataset()
        except Exception as exc:
            raise self._raised("dataset()", exc) from exc
        kind = type(ds).__name__
        if isinstance(ds, IterableDataset) or not (
            hasattr(ds, "__len__") and hasattr(ds, "__getitem__")
        ):
            raise contract_error(
                self.path,
                f"dataset() returned a {kind}, which has no len() and [i]",
                "the runtime shards each step's samples over the replicas by index, so that "
                "every replica reads only its own and a resumed run reads the same ones",
                "return a map-style torch.utils.data.Dataset (__len__ and __getitem__); wrap a "
                "stream by reading it into a list, or index its files",
            )
        if len(ds) < 1:
            raise contract_error(
                self.path,
                f"dataset() returned an empty {kind} (len 0)",
                "the runtime trains on its samples",
                "return the dataset with its samples (is its path right?)",
            )
        return ds

    def collate(self, samples: list[Any]) -> Batch:
        """Stack ``dataset`` items into a batch: the file's ``collate``, or ``default_collate``.

        Raises:
            ModelFileError: collating raised, or gave a batch that is not
                ``(inputs, targets)`` with ``len(samples)`` as dim 0.
        """
        own = callable(getattr(self.module, "collate", None))
        call = f"{'collate' if own else 'default_collate'}(<{len(samples)} samples>)"
        try:
            result = self.module.collate(samples) if own else default_collate(samples)
        except Exception as exc:
            raise self._raised(call, exc) from exc
        return self._checked(call, result, len(samples), "collate" if own else "dataset")

    def _checked(self, call: str, result: Any, batch_size: int, fn: str) -> Batch:
        """``result`` as a Batch, if it is ``(inputs, targets)`` batch first, of ``batch_size``."""
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            n = f" of length {len(result)}" if isinstance(result, (tuple, list)) else ""
            raise contract_error(
                self.path,
                f"{call} returned a {type(result).__name__}{n}, not a pair (inputs, targets)",
                "the planner feeds `inputs` to the model's forward and `targets` to the loss",
                f"end {fn} with `return inputs, targets`"
                + (" (each item of the dataset is one sample's pair)" if fn == "dataset" else ""),
            )
        inputs, targets = result
        try:
            args, kwargs = normalize_inputs(inputs)
            batch = Batch(args=args, kwargs=kwargs, targets=targets)
            size = batch.size
        except (TypeError, ValueError) as exc:
            raise contract_error(
                self.path,
                f"{call} returned unusable inputs: {exc}",
                "the planner calls model(*args, **kwargs) and cuts dim 0 into micro-batches",
                "return a Tensor, a tuple/list or a dict of tensors, batch first",
            ) from exc
        bad = [tuple(t.shape) for t in tensors_in(targets) if t.dim() > 0 and t.shape[0] != size]
        if size != batch_size or bad:
            got = f"inputs with batch dimension {size}" if size != batch_size else ""
            got += " and " if got and bad else ""
            got += f"targets of shape(s) {bad}" if bad else ""
            raise contract_error(
                self.path,
                f"{call} returned {got}; dim 0 should be {batch_size}",
                "the planner cuts dim 0 of the inputs and targets into micro-batches, and "
                "needs the batch size it asked for",
                "build the batch from the `batch_size` argument, batch first: (batch_size, ...)"
                if fn == "sample_batch"
                else f"{fn} must give one sample per item, stacked batch first",
            )
        return batch

    def loss(self, outputs: Any, targets: Any) -> Tensor:
        """The training loss: the file's ``loss_fn``, or :func:`default_loss`.

        Raises:
            ModelFileError: ``loss_fn`` raised, or returned
                anything but a one-element tensor.
        """
        if not self.has_loss_fn:
            return default_loss(outputs, targets)
        try:
            value = self.module.loss_fn(outputs, targets)
        except Exception as exc:
            raise self._raised(
                "loss_fn(outputs, targets)",
                exc,
                "the planner times the loss on the model's output of the sample batch, as a "
                "training step computes it",
            ) from exc
        if not isinstance(value, Tensor) or value.numel() != 1:
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise contract_error(
                self.path,
                f"loss_fn returned {got}, not a scalar tensor",
                "the planner calls backward() on the loss",
                "reduce the loss to one value, e.g. with .mean()",
            )
        return value


# ----------------------------------------------------------------------------- loading


def load_model_file(path: str | os.PathLike[str]) -> ModelFile:
    """Import a model file and check that it follows the contract (module docstring).

    Loading runs the file's top-level code: load only files you trust.

    Example::

        >>> mf = load_model_file("examples/gpt.py")  # doctest: +SKIP
        >>> mf.batch_size, mf.has_loss_fn  # doctest: +SKIP
        (8, True)

    Args:
        path: the model file, a ``.py`` file.

    Raises:
        ModelFileError: the file is missing or not a ``.py`` file; importing it
            raised (chained as ``__cause__``); ``build_model`` or ``sample_batch``
            is missing or not callable; ``loss_fn`` is not callable; or
            ``BATCH_SIZE`` is not a positive int.
    """
    given = Path(path).expanduser()
    problem = ""
    if not given.exists():
        problem = "no such file"
    elif given.is_dir():
        problem = "is a directory, not a model file"
    elif given.suffix != ".py":
        problem = f"is not a Python file (suffix {given.suffix!r}, expected '.py')"
    if problem:
        raise contract_error(
            given,
            problem,
            "the planner imports one Python file to build the model and a sample batch",
            f"pass the path of a .py file (relative to {Path.cwd()}) that follows the contract",
        )
    resolved = given.resolve()
    name = MODULE_PREFIX + hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    module = import_fresh(resolved, name)
    _check_names(resolved, module)
    batch_size = getattr(module, "BATCH_SIZE", DEFAULT_BATCH_SIZE)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise contract_error(
            resolved,
            f"BATCH_SIZE is {batch_size!r}, not a positive int",
            "it is the default global batch size the planner plans for",
            f"set e.g. `BATCH_SIZE = 32`, or delete it for the default ({DEFAULT_BATCH_SIZE})",
        )
    return ModelFile(path=resolved, module=module, batch_size=batch_size)


def _check_names(path: Path, module: types.ModuleType) -> None:
    missing = [n for n in _REQUIRED if not hasattr(module, n)]
    uncallable = [n for n in _FUNCTIONS if hasattr(module, n) and not callable(getattr(module, n))]
    if not missing and not uncallable:
        return
    present = [n for n in (*_REQUIRED, *_OPTIONAL) if hasattr(module, n)]
    problems = [f"missing {', '.join(missing)}"] if missing else []
    problems += [f"not callable: {', '.join(uncallable)}"] if uncallable else []
    public = [n for n in vars(module) if not n.startswith("_")]
    hints = [
        f"{n} (did you mean {' or '.join(close)}?)"
        for n in missing
        if (close := difflib.get_close_matches(n, public, n=2, cutoff=0.6))
    ]
    raise contract_error(
        path,
        f"breaks the model-file contract: {'; '.join(problems)} "
        f"(present: {', '.join(present) or 'none of the expected names'})",
        "the planner calls build_model() and sample_batch(batch_size), and loss_fn if defined",
        "define build_model and sample_batch (and loss_fn, dataset, collate, if used) as "
        "top-level functions" + (f"; close names found: {', '.join(hints)}" if hints else ""),
    )
