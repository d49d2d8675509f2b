"""Typed records to plain data and back, checked against their type hints: one codec for all.

Every record a file holds (the plan and its sections, the profiles, the
cluster) is a frozen dataclass. :func:`encode` turns one into plain data
(dicts, lists, numbers, strings, booleans, None) in field order;
:func:`decode` checks plain data against the dataclass's type hints and
builds it, naming the key path of anything wrong::

    >>> @dataclass(frozen=True)
    ... class Point:
    ...     x: int
    ...     tags: tuple[str, ...] = ()
    >>> decode(Point, {"x": 1, "tags": ["a"]}, path="p")
    Point(x=1, tags=('a',))
    >>> decode(Point, {"x": "one"}, path="p")
    Traceback (most recent call last):
    ValueError: p.x: expected an integer, got str 'one'

Types understood: ``int``, ``float`` (an int is accepted), ``str``, ``bool``
(never taken for a number), ``Any``, ``X | None``, ``tuple[X, ...]``,
``tuple[X, Y]``, ``Mapping[str, X]`` / ``dict[str, X]``, ``Literal[...]`` and
nested dataclasses. A field with a default may be missing; a key the
dataclass does not have is refused, with the allowed ones listed.

Field metadata (``dataclasses.field(metadata=...)``):

* ``SAVED_NOT``: kept in memory, never encoded (and refused when read back);
* ``FIGURE``: a float figure for people, rounded to 6 significant digits when
  encoded (readable, and stable in the last bits); other floats are encoded
  exactly (YAML and JSON give them back bit for bit).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union

__all__ = ["FIGURE", "SAVED_NOT", "Record", "decode", "describe", "encode", "round_figure"]

T = TypeVar("T")
R = TypeVar("R", bound="Record")

FIGURE: Mapping[str, Any] = types.MappingProxyType({"figure": True})
"""Field metadata: a float for people, rounded to 6 significant digits when encoded."""
SAVED_NOT: Mapping[str, Any] = types.MappingProxyType({"saved": False})
"""Field metadata: a value of this run only, never encoded."""


def round_figure(x: float | None) -> float | None:
    """``x`` to 6 significant digits (None, inf and nan as they are).

    >>> round_figure(1234.56789)
    1234.57
    """
    if x is None or not math.isfinite(x):
        return x
    return float(f"{x:.6g}")


class Record:
    """A dataclass mixin: ``to_dict`` and ``from_dict`` through this codec."""

    def to_dict(self) -> dict[str, Any]:
        """The record as plain data (see :func:`encode`)."""
        out = encode(self)
        assert isinstance(out, dict)
        return out

    @classmethod
    def from_dict(cls: type[R], data: Any, *, path: str | None = None) -> R:
        """The record from plain data, checked (see :func:`decode`)."""
        return decode(cls, data, path=path or cls.__name__)


# --------------------------------------------------------------------------- encode


def encode(value: Any) -> Any:
    """Plain data for ``value``: dataclasses become dicts (field order), tuples lists.

    Fields marked ``SAVED_NOT`` are left out; ``FIGURE`` floats are rounded.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            if not f.metadata.get("saved", True):
                continue
            item = getattr(value, f.name)
            out[f.name] = _rounded(item) if f.metadata.get("figure") else encode(item)
        return out
    if isinstance(value, (tuple, list)):
        return [encode(x) for x in value]
    if isinstance(value, Mapping):
        return {k: encode(v) for k, v in value.items()}
    return value


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round_figure(value)
    if isinstance(value, (tuple, list)):
        return [_rounded(x) for x in value]
    return encode(value)


# --------------------------------------------------------------------------- decode


def decode(cls: type[T], data: Any, *, path: str, error: type[ValueError] = ValueError) -> T:
    """Check ``data`` against ``cls`` (a dataclass) and build it.

    Args:
        cls: the dataclass.
        data: plain data, as :func:`encode` writes it.
        path: the key path of ``data``, to start error messages with.
        error: the exception raised on a mismatch (a ``ValueError`` subclass).

    Raises:
        error: the first mismatch, as ``"<path>: expected <type>, got <value>"``,
            ``"<path>.<key>: missing (expected <type>)"`` or ``"<path>:
            unknown key(s) <keys>; allowed: <keys>"``.
    """
    return _decode(cls, data, path, error)


def describe(tp: Any) -> str:
    """A type in words, as errors name it: "an integer", "a list of numbers", ..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_optional(tp):
        inner = [a for a in args if a is not type(None)]
        return f"{describe(inner[0])} or null"
    if dataclasses.is_dataclass(tp) or origin in (dict, Mapping) or tp in (dict, Mapping):
        return "a mapping"
    if origin is tuple:
        return f"a list of {describe(args[0])}" if args else "a list"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    names = {int: "an integer", float: "a number", str: "a string", bool: "true/false"}
    return names.get(tp, "any value")


def _decode(tp: Any, value: Any, path: str, error: type[ValueError]) -> Any:
    if tp is Any or tp is object:
        return value
    if _is_optional(tp):
        if value is None:
            return None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if dataclasses.is_dataclass(tp):
        return _decode_record(tp, value, path, error)  # type: ignore[arg-type]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise error(f"{path}: expected {describe(tp)}, got {_show(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], x, f"{path}[{k}]", error) for k, x in enumerate(value))
        if len(value) != len(args):
            raise error(f"{path}: expected a list of {len(args)} values, got {len(value)}")
        pairs = enumerate(zip(args, value, strict=True))
        return tuple(_decode(a, x, f"{path}[{k}]", error) for k, (a, x) in pairs)
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise error(f"{path}: expected a mapping, got {_show(value)}")
        item = args[1] if args else Any
        return {str(k): _decode(item, v, f"{path}.{k}", error) for k, v in value.items()}
    if origin is Literal:
        if value not in args or isinstance(value, bool):
            raise error(f"{path}: expected {describe(tp)}, got {_show(value)}")
        return value
    return _scalar(tp, value, path, error)


def _scalar(tp: Any, value: Any, path: str, error: type[ValueError]) -> Any:
    # bool is an int in Python; a number in a record is never a boolean.
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif tp in (int, str):
        ok = isinstance(value, tp) and not isinstance(value, bool)
    else:
        raise TypeError(f"the codec has no rule for {tp!r} (at {path})")
    if not ok:
        raise error(f"{path}: expected {describe(tp)}, got {_show(value)}")
    return value


def _decode_record(cls: type, value: Any, path: str, error: type[ValueError]) -> Any:
    if not isinstance(value, Mapping):
        raise error(f"{path}: expected a mapping, got {_show(value)}")
    hints = _hints(cls)
    known = [f for f in dataclasses.fields(cls) if f.metadata.get("saved", True)]
    names = [f.name for f in known]
    unknown = sorted(str(k) for k in value if k not in names)
    if unknown:
        raise error(f"{path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(names)}")
    kwargs = {}
    for f in known:
        if f.name not in value:
            no_default = f.default is dataclasses.MISSING
            if no_default and f.default_factory is dataclasses.MISSING:
                raise error(f"{path}.{f.name}: missing (expected {describe(hints[f.name])})")
            continue
        kwargs[f.name] = _decode(hints[f.name], value[f.name], f"{path}.{f.name}", error)
    try:
        return cls(**kwargs)
    except ValueError as exc:  # a record's own check (__post_init__)
        raise error(f"{path}: {exc}") from exc


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_optional(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    union = origin is Union or origin is types.UnionType
    return union and type(None) in typing.get_args(tp)


def _show(value: Any) -> str:
    return f"{type(value).__name__} {repr(value)[:40]}"
