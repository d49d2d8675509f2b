"""The bad-input matrix's fixture: one case's folder, cache and CLI (``bad_input_kit.Env``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bad_input_kit import Env

__all__ = ["env"]


@pytest.fixture()
def env(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Env:
    """A case's folder, with its own empty profile cache."""
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "cache"))
    return Env(tmp_path, capsys, monkeypatch)
