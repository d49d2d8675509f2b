"""The loss used when a model file defines no ``loss_fn``, read from the shapes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from planner.plan.batch import tensors_in

__all__ = ["default_loss"]

_OWN_LOSS = "define loss_fn(outputs, targets) in the model file"


def default_loss(outputs: Any, targets: Any) -> Tensor:
    """The loss used when a model file defines no ``loss_fn``.

    Example::

        >>> default_loss(torch.randn(4, 10), torch.tensor([1, 2, 3, 4])).dim()
        0

    The rule:

    * Outputs: a Tensor as is; from a dict, the value at ``"logits"`` if present,
      else the first value; from a tuple or list, the first element (if that is
      a container, the first tensor in it).
    * Integer targets: cross-entropy, with the class dimension read from the
      shapes. *Class last* when ``outputs.shape[:-1] == targets.shape``: outputs
      reshaped to ``(-1, C)``, targets to ``(-1,)`` ((B, C) classifiers, (B, T, V)
      language models). *Class at dim 1* when ``outputs.dim() == targets.dim() + 1``
      and the shapes agree without dim 1 of the outputs: ``F.cross_entropy``
      directly ((B, C, H, W) segmentation with (B, H, W) targets). When both fit
      (sizes that coincide), outputs of 4+ dims are read channels-first (torch's
      image layout), others class-last.
    * Floating-point targets: mean-squared error; the shapes must be equal.

    Raises:
        TypeError: no tensor in ``outputs``, or targets not an integer or float tensor.
        ValueError: the shapes fit none of the rules.
    """
    out = outputs
    if isinstance(out, Mapping):
        out = out["logits"] if "logits" in out else next(iter(out.values()), None)
    elif isinstance(out, (tuple, list)):
        out = out[0] if out else None
    found = tensors_in(out)
    if not found:
        raise TypeError(
            f"the default loss needs a tensor output, got {type(outputs).__name__}; {_OWN_LOSS}"
        )
    out = found[0]
    if not isinstance(targets, Tensor) or targets.is_complex() or targets.dtype == torch.bool:
        got = targets.dtype if isinstance(targets, Tensor) else type(targets).__name__
        raise TypeError(
            f"the default loss takes integer (class) or floating-point tensor targets, "
            f"got {got}; {_OWN_LOSS}"
        )
    if targets.is_floating_point():
        if out.shape != targets.shape:
            raise ValueError(
                f"float targets mean mean-squared error, which needs equal shapes, but outputs "
                f"are {tuple(out.shape)} and targets {tuple(targets.shape)}; {_OWN_LOSS}"
            )
        return F.mse_loss(out, targets)
    class_last = out.dim() >= 1 and out.shape[:-1] == targets.shape
    class_first = (
        out.dim() == targets.dim() + 1 >= 2
        and out.shape[0] == targets.shape[0]
        and out.shape[2:] == targets.shape[1:]
    )
    if class_first and (out.dim() >= 4 or not class_last):
        return F.cross_entropy(out, targets)
    if class_last:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
    raise ValueError(
        f"integer targets mean cross-entropy, but outputs {tuple(out.shape)} and targets "
        f"{tuple(targets.shape)} fit neither (..., C) with (...) nor (B, C, ...) with (B, ...); "
        f"{_OWN_LOSS}"
    )
