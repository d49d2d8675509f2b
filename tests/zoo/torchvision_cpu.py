"""Make PyPI's torchvision importable beside a CPU build of torch (the test machines' setup).

PyPI's torchvision wheel is built against the CUDA build of torch: beside the
CPU build its compiled operators (``torchvision/_C.so``) cannot load, and
``import torchvision`` then stops at ``operator torchvision::nms does not
exist`` (its fake-tensor registrations for ``nms`` and ``qnms`` are not
guarded). transformers and timm import torchvision whenever it is installed,
so with it broken neither imports.

The proper fix on a user's machine is a matching pair: torchvision from the
index torch came from (``pip install torchvision --index-url
https://download.pytorch.org/whl/cpu``). The test machines reach only PyPI,
so the zoo imports this module first: when (and only when) torchvision fails
this way, it declares the two operator schemas, the same ones ``_C.so`` would
have declared, and imports torchvision again. Models, layers and transforms
then work; torchvision's compiled operators (``nms``, ``roi_align``,
``deform_conv2d``, image decoding) stay unavailable and raise torchvision's
own "Couldn't load custom C++ ops" error, which classification models never
reach.
"""

from __future__ import annotations

import importlib
import sys

import torch

__all__ = ["SCHEMAS", "import_torchvision"]

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
"""The operators torchvision's import registers fake kernels for unconditionally."""

_LIBRARY: list[torch.library.Library] = []  # kept alive: a dropped Library undoes its schemas


def import_torchvision() -> object:
    """Import torchvision, declaring its two schemas first if its compiled part cannot load."""
    try:
        return importlib.import_module("torchvision")
    except RuntimeError as exc:
        if "torchvision::nms does not exist" not in str(exc):
            raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]  # the half-imported package
    library = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        library.define(schema)
    _LIBRARY.append(library)
    return importlib.import_module("torchvision")


import_torchvision()
