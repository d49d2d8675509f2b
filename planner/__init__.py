"""Automatic pipeline + data-parallel partitioning for PyTorch models.

``planner profile model.py`` profiles a model block by block; the planner and
runtime build on these profiles. Public names are imported lazily so that
``import planner`` stays cheap (torch loads on first use).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["ModelProfile", "ProfileOptions", "__version__", "profile_model"]


def __getattr__(name: str) -> Any:
    if name in ("profile_model", "ProfileOptions"):
        from planner import profile

        return getattr(profile, name)
    if name == "ModelProfile":
        from planner.records import ModelProfile

        return ModelProfile
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
