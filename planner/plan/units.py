"""Byte units the planner and the runtime share (binary: a GiB is 2**30 bytes)."""

from __future__ import annotations

__all__ = ["GIB", "KIB", "MIB"]

KIB = 2**10
MIB = 2**20
GIB = 2**30
