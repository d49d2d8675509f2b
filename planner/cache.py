"""The on-disk profile cache: one JSON file per key, written atomically.

Location: ``$PLANNER_CACHE_DIR``, else ``$XDG_CACHE_HOME/planner``, else
``~/.cache/planner``. A file is written to a temporary name and renamed into
place, so a crash never leaves a half-written entry.

[Note: a bad cache entry is never fatal] An entry is checked whole before it is
used: a regular file of at most ``MAX_ENTRY_BYTES``, JSON of this format, and a
record of one of the kinds the planner stores (a ``ModelProfile``, typed, with
every number finite and ≥ 0; a ``Calibration``, the same; or the local CPU's
speed). An entry that is not is
ignored with a warning naming the file and why, and removed, so that it is
rebuilt; where it cannot be removed (a read-only cache) the warning says so and
planning goes on without it.

Inside :func:`deferred` (``planner plan`` runs in one), entries are held in
memory and written only when the block succeeds: a plan that fails leaves
nothing behind, not even the profiles it measured on the way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.plan.files import atomic_write

if TYPE_CHECKING:
    from planner.plan.records import Calibration

__all__ = [
    "MAX_ENTRY_BYTES",
    "cache_dir",
    "calibration_key",
    "deferred",
    "entry_path",
    "key",
    "load",
    "load_calibration",
    "store",
    "store_calibration",
]

log = logging.getLogger(__name__)

# Bump when the profile's meaning changes, so old entries are not reused.
_FORMAT = 1

MAX_ENTRY_BYTES = 64 * 2**20
"""The largest cache entry read (a profile of 1,000 blocks is about 1 MiB)."""

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


def entry_path(k: str) -> Path:
    """The file that holds (or will hold) the entry of key ``k``."""
    return cache_dir() / f"profile-{k}.json"


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
    """The entry of key ``k``, checked whole; None when there is none or it is bad.

    Example::

        hit = cache.load(cache.key("local-cpu-speed", cpu, threads))

    A bad entry is ignored with a warning and removed (see [Note: a bad cache
    entry is never fatal]); this never raises.
    """
    held = _pending.get()
    if held is not None and k in held:
        return json.loads(json.dumps(held[k]))  # a copy, as a read from disk would give
    path = entry_path(k)
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        _ignore(path, f"it cannot be read ({exc.strerror or exc})")
        return None
    try:
        data = _read(path, st)
    except _BadEntry as exc:
        _ignore(path, str(exc))
        return None
    data.pop("_format")
    return data


class _BadEntry(ValueError):
    """Why a cache entry cannot be used."""


def _read(path: Path, st: os.stat_result) -> dict[str, Any]:
    if not stat.S_ISREG(st.st_mode):
        raise _BadEntry("it is not a regular file")
    if st.st_size > MAX_ENTRY_BYTES:
        raise _BadEntry(f"it has {st.st_size} bytes, more than the {MAX_ENTRY_BYTES} an entry may")
    try:
        with path.open("rb") as f:
            data = json.loads(f.read(MAX_ENTRY_BYTES + 1))
    except OSError as exc:
        raise _BadEntry(f"it cannot be read ({exc.strerror or exc})") from exc
    except RecursionError as exc:  # json's own bound on nesting
        raise _BadEntry("it is not JSON of a cache entry (nested too deep)") from exc
    except ValueError as exc:  # not JSON, not UTF-8, an integer over Python's limit
        raise _BadEntry(f"it is not JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("_format") != _FORMAT:
        got = data.get("_format") if isinstance(data, dict) else type(data).__name__
        raise _BadEntry(f"it is not a cache entry of format {_FORMAT} (got {got!r})")
    _check(path.name, {k: v for k, v in data.items() if k != "_format"})
    return data


def _check(name: str, data: dict[str, Any]) -> None:
    """Raise ``_BadEntry`` unless ``data`` is a whole record of a kind the planner stores."""
    from planner.plan.records import Calibration, ModelProfile

    if set(data) == {"calibration"}:
        try:
            cal = Calibration.from_dict(data["calibration"], path=name)
            cal.check_figures(name)
        except ValueError as exc:
            raise _BadEntry(f"it is not a whole calibration: {exc}") from exc
        return

    profile_keys = {f.name for f in dataclasses.fields(ModelProfile)}
    if len(profile_keys & set(data)) >= len(_CPU_KEYS & set(data)) and data:
        try:
            ModelProfile.from_dict(data, path=name).check_figures(name)
        except ValueError as exc:
            raise _BadEntry(f"it is not a whole profile: {exc}") from exc
        return
    if set(data) != _CPU_KEYS:
        raise _BadEntry(
            f"it holds neither a profile nor the local CPU's speed (keys: "
            f"{', '.join(sorted(data)) or 'none'})"
        )
    peaks = data["peak_flops"]
    figures = list(peaks.items()) if isinstance(peaks, dict) else [("", peaks)]
    figures = [(f"peak_flops.{d}", v) for d, v in figures]
    figures += [(k, data[k]) for k in ("memory_bandwidth", "op_overhead_s")]
    figures += [("cache_bandwidth", data["cache_bandwidth"])]  # 0: the cache is unknown
    for where, v in figures:
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        zero = where == "cache_bandwidth"  # may be 0
        if not (number and math.isfinite(v) and (v >= 0 if zero else v > 0)):
            least = "≥ 0" if zero else "> 0"
            raise _BadEntry(f"{name}.{where} is {v!r}, not a finite number {least}")


_CPU_KEYS = {"peak_flops", "memory_bandwidth", "op_overhead_s", "cache_bandwidth"}
"""The local CPU's speed entry (``planner.devices.local``)."""


def _ignore(path: Path, why: str) -> None:
    try:
        path.unlink(missing_ok=True)
        done = "removed it; it will be rebuilt"
    except OSError as exc:
        done = (
            f"could not remove it ({exc.strerror or exc}), so it is ignored on every run: "
            f"remove it by hand (rm {path})"
        )
    log.warning("ignoring the profile cache entry %s: %s; %s", path, why, done)


def store(k: str, data: dict[str, Any]) -> Path | None:
    """Write an entry atomically (inside :func:`deferred`: when the block succeeds).

    A cache that cannot be written is skipped with a warning.
    """
    held = _pending.get()
    if held is not None:
        held[k] = data
        return entry_path(k)
    return _write(k, data)


def _write(k: str, data: dict[str, Any]) -> Path | None:
    path = entry_path(k)
    try:
        atomic_write(path, json.dumps({"_format": _FORMAT, **data}), durable=True)
    except OSError as exc:
        log.warning(
            "could not write the profile cache at %s (%s); continuing without it", path, exc
        )
        return None
    return path


# --------------------------------------------------------------------------- calibrations


def calibration_key(fingerprint: str, device: str, threads: int, precision: str) -> str:
    """The key of the calibration of a model (by fingerprint) on a device type, with
    ``threads`` torch threads per process (a local CPU; 0 elsewhere), at a precision.

    By thread count too: the compute a run measures with one thread per process says
    little of a process with two (bench calibration: a scale fitted on 1-thread
    processes put a 2-thread single process off by +22 to +55 %)."""
    return key("calibration", fingerprint, device, threads, precision)


def load_calibration(
    fingerprint: str, device: str, threads: int, precision: str
) -> Calibration | None:
    """The calibration ``planner calibrate`` stored for these, or None."""
    from planner.plan.records import Calibration

    data = load(calibration_key(fingerprint, device, threads, precision))
    if data is None or set(data) != {"calibration"}:
        return None
    return Calibration.from_dict(data["calibration"], path="calibration")


def store_calibration(
    calibration: Calibration, fingerprint: str, device: str, threads: int, precision: str
) -> Path | None:
    """Keep ``calibration`` for these (replacing any there); its path, None when the cache
    cannot be written."""
    k = calibration_key(fingerprint, device, threads, precision)
    return store(k, {"calibration": calibration.to_dict()})
