"""Plan format versions: which are read, and how an older file becomes the current form.

Version 3 is written now. Versions 1 and 2 are read by :func:`upgrade`, which
rewrites their plain data into version 3's shape before it is checked:

* the model was identified by a hash of its traced graph, which nothing
  computes any more: the fingerprint becomes None (the runtime then checks the
  parameter names and shapes the file records, and says to re-plan);
* ``parameter_shapes`` moves from the top level into the model section;
* there are no simulation inputs (``step``): reports re-simulate from the
  per-stage figures, and say so;
* their solver's status, bound and gap are of the closed form the solver
  minimised then, not of the printed step (``solver.quantity``);
* version 1 also recorded the solve's wall time (``solver.solve_s``), which
  must be there and is kept in memory only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["PLAN_VERSION", "SUPPORTED_VERSIONS", "upgrade"]

PLAN_VERSION = 3
SUPPORTED_VERSIONS = (1, 2, 3)

_MODEL_KEYS = ("file", "parameters", "capture", "blocks")


def upgrade(data: Any, source: str, error: type[ValueError]) -> tuple[Any, float | None]:
    """``data`` in the current format, and a version 1 file's solve time (else None).

    Data that is not a mapping is returned as it is (the schema check names it).

    Raises:
        error: the version is missing or not supported; a version 1 file lacks
            ``solver.solve_s``.
    """
    if not isinstance(data, Mapping):
        return data, None
    version = data.get("version")
    # bool is an int in Python: `version: true` is not version 1.
    if isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
        *older, newest = map(str, SUPPORTED_VERSIONS)
        supported = f"versions {', '.join(older)} and {newest}" if older else f"version {newest}"
        found = "no version" if "version" not in data else f"version {version!r}"
        raise error(
            f"{source}.version: plan format {found} is not supported (this planner reads "
            f"{supported}; it writes version {PLAN_VERSION}).\n"
            "  fix: regenerate the plan with `planner plan`, or use the planner version that "
            "wrote it"
        )
    if version == PLAN_VERSION:
        return data, None
    out = dict(data)
    solve_s = _solve_time(out, source, error) if version == 1 else None
    model = out.get("model")
    if isinstance(model, Mapping):
        shapes = out.pop("parameter_shapes", None) or {}
        kept = {k: model[k] for k in _MODEL_KEYS if k in model}
        out["model"] = {"fingerprint": None, **kept, "parameter_shapes": shapes}
    for key in ("candidates", "warnings", "profiles"):  # optional, null allowed then
        if out.get(key, ()) is None:
            del out[key]
    solver = out.get("solver")
    if isinstance(solver, Mapping):  # their proof was of the closed form
        out["solver"] = {
            **solver,
            "note": solver.get("note") or "",
            "quantity": "predicted.closed_form_ms",
        }
    return out, solve_s


def _solve_time(data: dict[str, Any], source: str, error: type[ValueError]) -> float | None:
    solver = data.get("solver")
    if not isinstance(solver, Mapping):
        return None  # the schema check names it
    where = f"{source}.solver.solve_s"
    if "solve_s" not in solver:
        raise error(f"{where}: missing (expected a number)")
    value = solver["solve_s"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise error(f"{where}: expected a number, got {type(value).__name__} {value!r}")
    data["solver"] = {k: v for k, v in solver.items() if k != "solve_s"}
    return float(value)
