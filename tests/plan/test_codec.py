"""The codec (planner.plan.codec): typed records to plain data and back, with key-path errors."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import pytest
import yaml

from planner.plan.codec import FIGURE, SAVED_NOT, Record, decode, describe, encode


@dataclass(frozen=True, kw_only=True)
class Inner(Record):
    name: str
    size: int = 1


@dataclass(frozen=True, kw_only=True)
class Outer(Record):
    count: int
    share: float
    flag: bool
    kind: Literal["a", "b"]
    maybe: float | None
    pair: tuple[int, int]
    items: tuple[Inner, ...]
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    figure: float = field(default=0.0, metadata=FIGURE)
    secret: float | None = field(default=None, metadata=SAVED_NOT)


def _outer(**changes: object) -> Outer:
    base = dict(
        count=3,
        share=0.1 + 0.2,
        flag=True,
        kind="a",
        maybe=None,
        pair=(1, 2),
        items=(Inner(name="x"), Inner(name="y", size=5)),
        shapes={"w": (2, 3)},
        figure=1234.56789,
        secret=9.5,
    )
    return Outer(**{**base, **changes})  # type: ignore[arg-type]


def test_encode_is_plain_data_in_field_order() -> None:
    data = encode(_outer())
    keys = ["count", "share", "flag", "kind", "maybe", "pair", "items", "shapes", "figure"]
    assert list(data) == keys  # the value of this run only (secret) is never encoded
    assert data["pair"] == [1, 2] and data["items"][1] == {"name": "y", "size": 5}
    assert data["shapes"] == {"w": [2, 3]}
    assert data["figure"] == 1234.57  # a figure for people: 6 significant digits
    assert data["share"] == 0.1 + 0.2  # any other float exactly


@pytest.mark.parametrize("text", [json.dumps, yaml.safe_dump])
def test_decode_gives_the_record_back_through_json_and_yaml(text) -> None:
    record = _outer(figure=12.5, secret=None)
    wire = text(encode(record))
    loaded = json.loads(wire) if text is json.dumps else yaml.safe_load(wire)
    assert decode(Outer, loaded, path="r") == record  # floats exactly, tuples as tuples
    assert Outer.from_dict(record.to_dict()) == record


def test_defaults_fill_missing_keys_and_ints_are_numbers() -> None:
    data = encode(_outer())
    del data["shapes"], data["figure"]
    data["share"] = 1  # an int is a number
    got = decode(Outer, data, path="r")
    assert got.shapes == {} and got.figure == 0.0 and got.share == 1.0
    assert isinstance(got.share, float)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(count="3"), "r.count: expected an integer, got str '3'"),
        (lambda d: d.update(count=True), "r.count: expected an integer, got bool True"),
        (lambda d: d.update(share=False), "r.share: expected a number, got bool"),
        (lambda d: d.update(flag=1), "r.flag: expected true/false, got int 1"),
        (lambda d: d.update(kind="c"), "r.kind: expected one of 'a', 'b', got str 'c'"),
        (lambda d: d.update(maybe="x"), "r.maybe: expected a number, got str"),
        (lambda d: d.update(pair=[1]), "r.pair: expected a list of 2 values, got 1"),
        (lambda d: d.update(pair=7), "r.pair: expected a list of an integer, got int 7"),
        (lambda d: d["items"][1].update(size="5"), "r.items[1].size: expected an integer"),
        (lambda d: d["items"][0].pop("name"), "r.items[0].name: missing (expected a string)"),
        (lambda d: d.pop("count"), "r.count: missing (expected an integer)"),
        (lambda d: d.update(colour=1), "r: unknown key(s) colour; allowed: count, share"),
        (lambda d: d.update(secret=1.0), "r: unknown key(s) secret"),
        (lambda d: d["shapes"].update(b=[1, "x"]), "r.shapes.b[1]: expected an integer"),
        (lambda d: d.update(items={"a": 1}), "r.items: expected a list of a mapping, got dict"),
    ],
)
def test_errors_name_the_key_path_and_the_type(change, message) -> None:
    data = encode(_outer())
    change(data)
    with pytest.raises(ValueError) as err:
        decode(Outer, data, path="r")
    assert message in str(err.value)


def test_the_error_class_is_the_callers() -> None:
    class Mine(ValueError):
        pass

    with pytest.raises(Mine, match="r: expected a mapping, got list"):
        decode(Outer, [1], path="r", error=Mine)


def test_describe_names_types_in_words() -> None:
    assert describe(int | None) == "an integer or null"
    assert describe(tuple[float, ...]) == "a list of a number"
    assert describe(Inner) == "a mapping"
