"""Where the repository's files are, for every test."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CLUSTERS", "EXAMPLES", "ROOT"]

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
CLUSTERS = EXAMPLES / "clusters"
