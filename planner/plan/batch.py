"""Batches: the forward's arguments and the targets, their batch dimension, and slices of it.

One rule everywhere (planning, profiling, the runtime): a batch's size is dim 0
of its first tensor that has a dim 0, searching the positional arguments, then
the keyword arguments, into tuples, lists and dicts; slicing a batch cuts every
tensor whose dim 0 is that size and leaves the rest (masks, scalars) whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["Batch", "batch_size_of", "normalize_inputs", "slice_batch", "tensors_in"]


def tensors_in(obj: Any) -> list[Tensor]:
    """Every tensor in ``obj``, searching tuples, lists and dict values in order."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in tensors_in(item)]
    return []


def batch_size_of(*parts: Any) -> int:
    """Dim 0 of the first tensor in ``parts`` that has one (see the module docstring).

    >>> import torch
    >>> batch_size_of((torch.tensor(1.0), torch.zeros(5, 2)), {})
    5

    Raises:
        ValueError: no tensor with a dim 0.
    """
    for t in tensors_in(list(parts)):
        if t.dim() > 0:
            return int(t.shape[0])
    raise ValueError(
        "the inputs have no batch dimension (no tensor among them has a dim 0); give at least "
        "one tensor shaped (batch, ...)"
    )


def slice_batch(obj: Any, lo: int, hi: int, size: int) -> Any:
    """``obj`` with every tensor of dim 0 ``size`` cut to ``[lo, hi)`` (the rest as it is)."""

    def cut(t: Any) -> Any:
        if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == size:
            return t[lo:hi]
        return t

    return pytree.tree_map(cut, obj)


def normalize_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Turn a model file's ``inputs`` into the forward's ``(args, kwargs)``.

    Example::

        >>> x = torch.zeros(2, 3)
        >>> normalize_inputs(x) == ((x,), {})
        True
        >>> normalize_inputs({"idx": x})[1]["idx"] is x
        True

    Args:
        inputs: a Tensor (one positional argument), a tuple or list (positional
            arguments) or a dict with string keys (keyword arguments).

    Returns:
        ``(args, kwargs)`` such that ``model(*args, **kwargs)`` runs the forward.

    Raises:
        TypeError: ``inputs`` is of another type, or a dict key is not a string.
    """
    if isinstance(inputs, Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    if isinstance(inputs, Mapping):
        bad = [k for k in inputs if not isinstance(k, str)]
        if bad:
            raise TypeError(
                f"dict inputs are the forward's keyword arguments, but keys {bad!r} are not "
                "strings; use the parameter names of forward() as keys"
            )
        return (), dict(inputs)
    raise TypeError(
        f"inputs is a {type(inputs).__name__}; expected a Tensor (one positional argument), "
        "a tuple or list (positional arguments) or a dict (keyword arguments) of the forward"
    )


@dataclass(frozen=True)
class Batch:
    """One batch in normalized form: the forward's arguments, and the targets.

    Example::

        >>> b = Batch(args=(torch.zeros(4, 3),), kwargs={}, targets=torch.zeros(4))
        >>> b.size
        4
        >>> loss = loss_fn(model(*b.args, **b.kwargs), b.targets)  # doctest: +SKIP

    Attributes:
        args: positional arguments of the model's forward.
        kwargs: keyword arguments of the model's forward.
        targets: what the loss takes besides the outputs.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    targets: Any = None

    @property
    def size(self) -> int:
        """The batch dimension of the inputs (:func:`batch_size_of`).

        Raises:
            ValueError: no tensor with a dim 0 among the inputs.
        """
        return batch_size_of(self.args, self.kwargs)

    def inputs(self) -> Any:
        """The forward's inputs as ``ParallelModel.step`` takes them: the keyword arguments
        (a dict), else the positional ones (a tuple).

        Raises:
            ValueError: both kinds at once (the runtime passes one).
        """
        if self.args and self.kwargs:
            raise ValueError(
                "the batch's inputs hold both positional and keyword arguments; the runtime "
                "passes one kind: make sample_batch (or collate) return a tuple or a dict"
            )
        return dict(self.kwargs) if self.kwargs else self.args
