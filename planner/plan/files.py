"""Plan files (versioned YAML, safe and bounded), and the one atomic file write.

Every file the planner and the runtime write (plans, reports, traces, cache
entries, checkpoint markers) goes through :func:`atomic_write`: a temporary
file beside the target, renamed into place, so that a crash never leaves half
a file under the real name.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from planner.plan.schema import Plan, PlanError

__all__ = [
    "MAX_INT_DIGITS",
    "MAX_NESTING",
    "MAX_PLAN_BYTES",
    "MAX_VALUES",
    "atomic_write",
    "load_plan",
    "plan_text",
    "save_plan",
]

# [Note: bounded plan files]
# A plan file is read whole and parsed by PyYAML's pure-Python safe loader; a
# crafted one must not exhaust the stack, the memory or the time. So it is
# refused, with its key path, when it is larger than MAX_PLAN_BYTES (checked
# before reading), nests deeper than MAX_NESTING (checked while composing: the
# composer recurses once per level, and 100,000 "[" would overflow the stack),
# holds an integer longer than MAX_INT_DIGITS (Python refuses to convert one
# over 4,300 digits, with a message that names neither the file nor the key), or
# stands for more than MAX_VALUES values once its YAML aliases are expanded (a
# few lines of nested aliases stand for billions of values, which every check
# that walks the plan would visit; an alias to a deep value counts its depth
# too). The planner writes plans of a few hundred KiB, nested 6 levels deep.
MAX_PLAN_BYTES = 32 * 2**20
"""The largest plan file read (32 MiB)."""
MAX_NESTING = 64
"""The deepest nesting of lists and mappings a plan file may have."""
MAX_VALUES = 4_000_000
"""The most values (scalars, lists and mappings, aliases expanded) a plan file may hold."""
MAX_INT_DIGITS = 40
"""The longest integer a plan file may hold (a 64-bit count has 19 digits)."""


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
    try:
        st = path.stat()
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        what = "not found" if st is None else "is not a regular file"
        raise PlanError(
            f"plan file {path} {what}; create one with `planner plan model.py --out {path}`"
        )
    too_big = PlanError(
        f"plan file {path} has {st.st_size} bytes, more than the {MAX_PLAN_BYTES} a plan may "
        "have (the planner writes plans of a few hundred KiB); it is not a plan: regenerate "
        "it with `planner plan`"
    )
    if st.st_size > MAX_PLAN_BYTES:
        raise too_big
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_PLAN_BYTES + 1)  # bounded, should the file grow meanwhile
        if len(raw) > MAX_PLAN_BYTES:
            raise too_big
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(
            f"cannot read the plan file {path}: {exc}; check its permissions, or regenerate "
            "it with `planner plan`"
        ) from exc
    try:
        data = _parse(text, str(path))
    except yaml.YAMLError as exc:
        raise PlanError(
            f"{path} is not a valid plan file: {exc}\n"
            "Plan files are plain YAML (no Python tags); regenerate it with `planner plan`."
        ) from exc
    return Plan.from_dict(data, source=str(path))


def _parse(text: str, source: str) -> Any:
    """The plain data of a plan file's text, within [Note: bounded plan files].

    Raises:
        PlanError: it is too deep, holds a too-long integer or too many values (through
            aliases): the message names the key path, the line and the bound.
        yaml.YAMLError: it is not YAML, or uses a Python tag.
    """
    loader = _BoundedLoader(text, source)
    try:
        return loader.get_single_data()
    except ValueError as exc:  # a constructor's own check (a date out of range, ...)
        if isinstance(exc, PlanError):
            raise
        raise PlanError(
            f"{source} is not a valid plan file: {exc}; regenerate it with `planner plan`"
        ) from exc
    finally:
        loader.dispose()


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that knows each node's key path and enforces the bounds."""

    def __init__(self, text: str, source: str) -> None:
        super().__init__(text)
        self._source = source
        self._keys: list[str] = []
        self._sizes: dict[int, tuple[int, int]] = {}  # id(node): (values, levels) under it

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        if isinstance(parent, SequenceNode):
            self._keys.append(f"[{index}]")
        elif isinstance(parent, MappingNode):
            self._keys.append(f".{index.value}" if isinstance(index, ScalarNode) else ".<key>")
        else:
            self._keys.append("")
        try:
            mark = self.peek_event().start_mark
            if len(self._keys) > MAX_NESTING:
                raise self._too_deep(mark)
            node = super().compose_node(parent, index)
            if node is not None:
                self._bound(node, mark)
            return node
        finally:
            self._keys.pop()

    def _bound(self, node: Node, mark: yaml.Mark) -> None:
        """Check ``node`` (just composed, or an alias's target) against the bounds."""
        if id(node) in self._sizes:  # an alias: its target's values count again, here
            size, height = self._sizes[id(node)]
        elif isinstance(node, ScalarNode):
            size, height = 1, 0
            if node.tag == "tag:yaml.org,2002:int":
                digits = len(node.value.lstrip("+-").replace("_", ""))
                if digits > MAX_INT_DIGITS:
                    raise self._refuse(
                        f"an integer of {digits} digits, more than the {MAX_INT_DIGITS} "
                        "a plan's counts and sizes need; fix the value or regenerate the plan "
                        "with `planner plan`",
                        mark,
                    )
        else:
            kids = node.value if isinstance(node, SequenceNode) else sum(node.value, ())
            figures = [self._sizes[id(k)] for k in kids]
            size = 1 + sum(f[0] for f in figures)
            height = 1 + max((f[1] for f in figures), default=0)
        self._sizes[id(node)] = (size, height)
        if len(self._keys) - 1 + height > MAX_NESTING:  # an alias to a deep value
            raise self._too_deep(mark)
        if size > MAX_VALUES:
            raise self._refuse(
                f"stands for {size} values (through YAML aliases), more than the "
                f"{MAX_VALUES} a plan may hold; write the values out, or regenerate the plan "
                "with `planner plan`",
                mark,
            )

    def _too_deep(self, mark: yaml.Mark) -> PlanError:
        return self._refuse(
            f"lists and mappings nested more than {MAX_NESTING} levels deep (a plan nests 6); "
            "it is not a plan: regenerate it with `planner plan`",
            mark,
        )

    def _refuse(self, what: str, mark: yaml.Mark) -> PlanError:
        keys = self._keys
        if len(keys) > 8:  # a path as deep as the limit: its ends, and how deep
            keys = [*keys[:4], f"…({len(keys)} levels)…", *keys[-2:]]
        where = "".join(keys) or " (the whole file)"
        line = f" (line {mark.line + 1}, column {mark.column + 1})"
        return PlanError(f"{self._source}{where}{line}: {what}")


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
