"""Bad-input case 9 of issue 15: a damaged profile-cache entry is never fatal.

An entry of the right ``_format`` but the wrong structure, types or numbers (a
NaN or negative time), or not a file at all, is ignored with a warning naming
it and why, removed, and rebuilt: the plan is the one a clean cache gives. A
read-only cache keeps the bad entry, says so, and plans all the same.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from bad_input_kit import A100, MLP, Env

from planner import cache

ARGS = ("--gpus", 2, *A100, "--pp", 2)


def _clean(env: Env) -> tuple[str, list[Path]]:
    """The plan file a clean cache gives, and the cache's entries (the plan is removed)."""
    env.planned(env.write(MLP), *ARGS)
    text = env.out.read_text()
    env.out.unlink()
    return text, sorted(env.cache.glob("profile-*.json"))


def _replan(env: Env, caplog: pytest.LogCaptureFixture) -> list[str]:
    """``planner plan`` again (it must succeed); the cache's warnings."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="planner.cache"):
        env.planned(env.write(MLP), *ARGS)
    return [r.getMessage() for r in caplog.records if r.name == "planner.cache"]


def _damaged(entry: dict[str, Any], damage: Callable[[dict[str, Any]], object]) -> str:
    data = json.loads(json.dumps(entry))
    damage(data)
    return json.dumps(data)


def _emptied(data: dict[str, Any]) -> None:
    data.clear()
    data["_format"] = 1


DAMAGE: list[tuple[Callable[[dict[str, Any]], object], str]] = [
    (lambda d: d.update(blocks="none"), "blocks: expected a list of a mapping, got str 'none'"),
    (
        lambda d: [d.pop(k) for k in ("fingerprint", "source", "device", "blocks")],
        ".fingerprint: missing (expected a string)",
    ),
    (lambda d: d["blocks"][0].update(fwd_ms="fast"), "blocks[0].fwd_ms: expected a number"),
    (lambda d: d["blocks"][1].update(bwd_ms=float("nan")), "blocks[1].bwd_ms is nan, not a"),
    (lambda d: d["blocks"][0].update(fwd_ms=-3.5), "blocks[0].fwd_ms is -3.5, not a finite"),
    (lambda d: d.update(loss_fwd_ms=float("inf")), "loss_fwd_ms is inf, not a finite number"),
    (_emptied, "holds neither a profile nor the local CPU"),
]


@pytest.mark.parametrize(("damage", "why"), DAMAGE, ids=[w.split(":")[0] for _, w in DAMAGE])
def test_case9_a_damaged_entry_is_ignored_removed_and_rebuilt(
    env: Env, caplog: pytest.LogCaptureFixture, damage: Any, why: str
) -> None:
    clean, entries = _clean(env)
    entry = entries[0]
    good = json.loads(entry.read_text())
    entry.write_text(_damaged(good, damage))
    warnings = _replan(env, caplog)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"ignoring the profile cache entry {entry}: "), warnings
    assert why in warnings[0], (why, warnings[0])
    assert warnings[0].endswith("removed it; it will be rebuilt")
    assert env.out.read_text() == clean  # priced on the rebuilt profile, not the damaged one
    assert json.loads(entry.read_text()) == good


def test_case9_an_entry_that_is_not_a_file_or_not_json_is_ignored(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    clean, entries = _clean(env)
    entries[0].unlink()
    os.mkfifo(entries[0])  # reading it would block until a writer came
    entries[1].write_text("[" * 100_000)  # json.loads: a RecursionError
    warnings = sorted(_replan(env, caplog))
    assert len(warnings) == 2, warnings
    whys = {entries[0]: "it is not a regular file", entries[1]: "nested too deep"}
    for entry, why in whys.items():
        assert any(f"entry {entry}: " in w and why in w for w in warnings), (why, warnings)
    assert env.out.read_text() == clean
    assert all(e.is_file() for e in entries)


def test_case9_a_read_only_cache_with_a_bad_entry_warns_and_plans(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    clean, entries = _clean(env)
    entries[0].write_text(_damaged(json.loads(entries[0].read_text()), DAMAGE[3][0]))
    bad = entries[0].read_text()
    denied = PermissionError(13, "Permission denied")

    def unlink(self: Path, missing_ok: bool = False) -> None:
        raise denied  # as in a read-only cache (chmod stops no one running as root)

    def write(*_: object, **__: object) -> None:
        raise denied

    env.monkeypatch.setattr(Path, "unlink", unlink)
    env.monkeypatch.setattr(cache, "atomic_write", write)
    os.chmod(env.cache, 0o555)
    try:
        warnings = _replan(env, caplog)
    finally:
        os.chmod(env.cache, 0o755)
    ignored = [w for w in warnings if w.startswith("ignoring")]
    assert ignored == [
        f"ignoring the profile cache entry {entries[0]}: it is not a whole profile: "
        f"{entries[0].name}.blocks[1].bwd_ms is nan, not a finite number ≥ 0; could not remove "
        f"it (Permission denied), so it is ignored on every run: remove it by hand (rm "
        f"{entries[0]})"
    ], warnings
    assert any(w.startswith("could not write the profile cache at") for w in warnings), warnings
    assert env.out.read_text() == clean
    assert entries[0].read_text() == bad  # kept, and ignored again next time
