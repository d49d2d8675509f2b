"""The on-disk profile cache: one JSON file per key, written atomically.

Location: ``$PLANNER_CACHE_DIR``, else ``$XDG_CACHE_HOME/planner``, else
``~/.cache/planner``. A file is written to a temporary name and renamed into
place, so a crash never leaves a half-written entry; an unreadable entry is
ignored (and removed) with a warning.

Inside :func:`deferred` (``planner plan`` runs in one), entries are held in
memory and written only when the block succeeds: a plan that fails leaves
nothing behind, not even the profiles it measured on the way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from planner.plan.files import atomic_write

__all__ = ["cache_dir", "deferred", "key", "load", "store"]

log = logging.getLogger(__name__)

# Bump when the profile's meaning changes, so old entries are not reused.
_FORMAT = 1

# Entries stored inside `deferred()`, by key; None outside it.
_pending: ContextVar[dict[str, dict[str, Any]] | None] = ContextVar("_pending", default=None)


def cache_dir() -> Path:
    """The directory profiles are cached in."""
    env = os.environ.get("PLANNER_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "planner"


def key(*parts: Any) -> str:
    """A stable key for the given parts (the torch version is always included)."""
    import torch

    text = "\x1f".join(repr(p) for p in (_FORMAT, torch.__version__, *parts))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@contextmanager
def deferred() -> Iterator[None]:
    """Hold the entries stored inside the block; write them when it succeeds, drop them if not.

    Example::

        with cache.deferred():
            plan = plan_model(...)      # profiles land in the cache only if this returns

    Nested blocks hand their entries to the outer one; only the outermost writes.
    """
    outer = _pending.get()
    held: dict[str, dict[str, Any]] = {}
    token = _pending.set(held)
    try:
        yield
    finally:
        _pending.reset(token)
    # Reached only when the block did not raise.
    if outer is not None:
        outer.update(held)
        return
    for k, data in held.items():
        _write(k, data)


def load(k: str) -> dict[str, Any] | None:
    held = _pending.get()
    if held is not None and k in held:
        return json.loads(json.dumps(held[k]))  # a copy, as a read from disk would give
    path = cache_dir() / f"profile-{k}.json"
    if not path.exists():
        return None
    try:
        with path.open() as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.get("_format") != _FORMAT:
            raise ValueError("not a profile of this format")
    except (OSError, ValueError) as exc:
        log.warning(
            "ignoring unreadable profile cache entry %s (%s); it will be rebuilt", path, exc
        )
        path.unlink(missing_ok=True)
        return None
    data.pop("_format")
    return data


def store(k: str, data: dict[str, Any]) -> Path | None:
    """Write an entry atomically (inside :func:`deferred`: when the block succeeds).

    A cache that cannot be written is skipped with a warning.
    """
    held = _pending.get()
    if held is not None:
        held[k] = data
        return cache_dir() / f"profile-{k}.json"
    return _write(k, data)


def _write(k: str, data: dict[str, Any]) -> Path | None:
    path = cache_dir() / f"profile-{k}.json"
    try:
        atomic_write(path, json.dumps({"_format": _FORMAT, **data}), durable=True)
    except OSError as exc:
        log.warning(
            "could not write the profile cache at %s (%s); continuing without it", path, exc
        )
        return None
    return path
