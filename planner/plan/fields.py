"""Option fields declared once: default, help text and flag, for the dataclass and the CLI.

An options dataclass declares each knob with :func:`option`; the command line
is built from those declarations (:func:`add_options`) and parsed back into
the same dataclass (:func:`from_namespace`), so a default or a help text is
written in one place. :func:`option_error` names a field and its flag in a
validation error, for callers from Python and from the shell alike::

    @dataclass(frozen=True, kw_only=True)
    class Knobs:
        repeats: int = option(5, help="timed rounds (median kept)")

        def __post_init__(self) -> None:
            if self.repeats < 1:
                raise option_error(Knobs, "repeats", f"must be ≥ 1, got {self.repeats}")

    add_options(parser, Knobs)          # --repeats N (default: 5)
    knobs = from_namespace(Knobs, parser.parse_args())

Both sides use it: ``planner.options`` (planning) and ``runtime.options``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import typing
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

__all__ = ["add_options", "flag_of", "from_namespace", "option", "option_error", "to_argv"]

T = TypeVar("T")


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    flag: str | None = None,
    choices: Sequence[Any] | None = None,
    metavar: str | None = None,
    unset: str | None = None,
    positional: bool = False,
    cli: bool = True,
) -> Any:
    """A dataclass field that is also a command-line option.

    Args:
        default: the default (none: the field is required from Python).
        help: what the knob does, and advice on choosing it; the CLI's help text.
        flag: the command-line flag (default: ``--`` and the name with dashes).
            A boolean defaulting to True is turned off by its flag (``--no-cache``).
        choices: the values allowed on the command line.
        metavar: the value's name in the help.
        unset: for a required field: what the CLI uses when the flag is not
            given (e.g. "the model file's BATCH_SIZE"); the flag's default is
            None. A required field without it is a required flag.
        positional: a positional argument (``planner run MODEL_FILE``), not a flag.
        cli: False keeps the field off the command line (Python only).
    """
    meta: dict[str, Any] = {"help": help, "flag": flag, "choices": choices, "metavar": metavar}
    meta |= {"unset": unset, "positional": positional, "cli": cli}
    return dataclasses.field(default=default, metadata=meta)


def flag_of(cls: type, name: str) -> str:
    """The command-line flag of field ``name`` of options class ``cls``."""
    f = _fields(cls)[name]
    return f.metadata.get("flag") or "--" + name.replace("_", "-")


def option_error(cls: type, name: str, message: str) -> ValueError:
    """``ValueError("<name> (<flag>) <message>")``: the field, as Python and the CLI name it."""
    f = _fields(cls)[name]
    if not f.metadata.get("cli", False):
        return ValueError(f"{name} {message}")
    return ValueError(f"{name} ({flag_of(cls, name)}) {message}")


def add_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    only: Collection[str] | None = None,
    skip: Collection[str] = (),
) -> None:
    """Add the command-line options of ``cls``'s fields (``only`` those, less ``skip``)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not meta.get("cli") or f.name in skip or (only is not None and f.name not in only):
            continue
        text = meta["help"]
        kind = _base(hints[f.name])
        has_default = f.default is not dataclasses.MISSING
        if meta.get("positional"):
            parser.add_argument(f.name, type=kind, metavar=meta.get("metavar"), help=text)
            continue
        if kind is bool:
            on = has_default and f.default is True
            action = "store_false" if on else "store_true"
            parser.add_argument(flag_of(cls, f.name), dest=f.name, action=action, help=text)
            continue
        default = f.default if has_default else None
        if default is not None:
            text += f" (default: {default})"
        elif meta.get("unset"):
            text += f" (default: {meta['unset']})"
        parser.add_argument(
            flag_of(cls, f.name),
            dest=f.name,
            type=kind,
            default=default,
            required=not has_default and not meta.get("unset"),
            choices=meta.get("choices"),
            metavar=meta.get("metavar"),
            help=text,
        )


def from_namespace(cls: Callable[..., T], ns: argparse.Namespace, **values: Any) -> T:
    """``cls`` from the parsed options it declared (those present in ``ns``) and ``values``."""
    assert isinstance(cls, type)
    kwargs = {
        name: getattr(ns, name)
        for name, f in _fields(cls).items()
        if f.metadata.get("cli") and hasattr(ns, name) and name not in values
    }
    # A required field whose flag was not given stays out (the caller fills it in).
    kwargs = {k: v for k, v in kwargs.items() if not (v is None and _required(cls, k))}
    return cls(**kwargs, **values)


def to_argv(obj: Any, *, skip: Collection[str] = ()) -> list[str]:
    """The command-line arguments that parse back into ``obj``'s options (None ones left out).

    Positional arguments first, then the flags in field order; a boolean flag
    appears when its value differs from its default.
    """
    cls = type(obj)
    hints = typing.get_type_hints(cls)
    positional: list[str] = []
    flags: list[str] = []
    for f in dataclasses.fields(obj):
        if not f.metadata.get("cli") or f.name in skip:
            continue
        value = getattr(obj, f.name)
        if f.metadata.get("positional"):
            positional.append(str(value))
        elif _base(hints[f.name]) is bool:
            if value != f.default:
                flags.append(flag_of(cls, f.name))
        elif value is not None:
            flags += [flag_of(cls, f.name), str(value)]
    return positional + flags


@functools.cache
def _fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _required(cls: type, name: str) -> bool:
    f = _fields(cls)[name]
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _base(tp: Any) -> Any:
    """The scalar type argparse converts to: ``int | None`` → ``int``."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args and typing.get_origin(tp) is not None else tp
