"""Plan files (versioned YAML, ``yaml.safe_load`` only), and the one atomic file write.

Every file the planner and the runtime write (plans, reports, traces, cache
entries, checkpoint markers) goes through :func:`atomic_write`: a temporary
file beside the target, renamed into place, so that a crash never leaves half
a file under the real name.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from planner.plan.schema import Plan, PlanError

__all__ = ["atomic_write", "load_plan", "plan_text", "save_plan"]


def atomic_write(
    path: str | os.PathLike[str], content: str | bytes, *, durable: bool = False
) -> Path:
    """Write ``content`` to ``path`` through a temporary file renamed into place.

    Example::

        atomic_write("report.html", page)

    The folder is created when missing; the file is readable by everyone
    (mode 0644), like any file a person reads. ``durable``: flush it to the
    disk (``fsync``) before the rename, for files a later run must find whole
    (cache entries, checkpoint markers).

    Raises:
        OSError: the file cannot be written; no temporary file is left.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content.encode("utf-8") if isinstance(content, str) else content)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Write ``plan`` as YAML, atomically.

    The same plan always gives the same bytes: see [Note: reproducible plan files]
    in :mod:`planner.plan.schema`.

    Raises:
        PlanError: the file cannot be written (the message says why and what to do).
    """
    text = plan_text(plan)
    try:
        return atomic_write(path, text)
    except OSError as exc:
        raise PlanError(
            f"cannot write the plan to {path}: {exc.strerror or exc}; "
            "choose another --out path (a file in a folder you can write to)"
        ) from exc


def plan_text(plan: Plan) -> str:
    """The plan file's text (what :func:`save_plan` writes)."""
    body = yaml.dump(plan.to_dict(), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)
    return _HEADER + body


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read and validate a plan file.

    Example::

        plan = load_plan("plan.yaml")
        print(plan.pp, plan.dp, plan.split_points)

    Raises:
        PlanError: the file is missing, not YAML, uses Python tags, is of an
            unknown version, or does not match the schema (the message names
            the key path and the expected type).
    """
    path = Path(path)
    if not path.is_file():
        raise PlanError(
            f"plan file {path} not found; create one with `planner plan model.py --out {path}`"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(
            f"cannot read the plan file {path}: {exc}; check its permissions, or regenerate "
            "it with `planner plan`"
        ) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PlanError(
            f"{path} is not a valid plan file: {exc}\n"
            "Plan files are plain YAML (no Python tags); regenerate it with `planner plan`."
        ) from exc
    return Plan.from_dict(data, source=str(path))


class _Dumper(yaml.SafeDumper):
    """Safe YAML with short lists of numbers/strings on one line ("ranks: [0, 2]")."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flat = all(isinstance(x, (int, float, str, bool)) or x is None for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_Dumper.add_representer(list, _represent_list)


_HEADER = (
    "# Placement plan written by `planner plan`. Human-readable and editable;\n"
    "# `planner show` re-renders it, `planner run` executes it.\n"
)
