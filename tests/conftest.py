"""What every test shares: its own profile cache, and the helpers' folder on the path.

The tests' helper modules (``repo``, ``world``, ``models``) sit in this folder,
which pytest puts on ``sys.path`` for this file; the test folders mirror the
packages (``tests/cost`` tests ``planner.cost`` ...).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

__all__ = ["cache_dir"]


def pytest_configure(config: pytest.Config) -> None:
    """No test reads or writes the user's own profile cache."""
    if "PLANNER_CACHE_DIR" not in os.environ:
        os.environ["PLANNER_CACHE_DIR"] = tempfile.mkdtemp(prefix="planner-test-cache-")


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty profile cache for this test (``PLANNER_CACHE_DIR``)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(path))
    return path
