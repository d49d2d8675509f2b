"""CPU workers keep to cores of their own (runtime.launch.pin_cores), each check in a fresh
process: pinning this one would slow the rest of the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _pinned(
    threads: int, local_rank: int, local_world: int, world: int | None = None
) -> tuple[object, list[int]]:
    code = (
        "import json, os; from runtime.launch import pin_cores; "
        f"got = pin_cores({threads}, {local_rank}, {local_world}, {world}); "
        "print(json.dumps([got, sorted(os.sched_getaffinity(0))]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    got, now = json.loads(out.stdout)
    return got, now


@pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores and sched_setaffinity (Linux)")
def test_each_local_worker_keeps_to_its_own_cores() -> None:
    assert _pinned(1, 0, 2) == ([CORES[0]], [CORES[0]])
    assert _pinned(1, 1, 2) == ([CORES[1]], [CORES[1]])
    two = len(CORES) // 2
    assert _pinned(two, 1, 2) == (CORES[two : 2 * two], CORES[two : 2 * two])


@pytest.mark.skipif(not CORES, reason="needs sched_setaffinity (Linux)")
def test_nothing_is_pinned_when_the_workers_would_share_cores() -> None:
    assert _pinned(1, 0, len(CORES) + 1) == (None, CORES)
    assert _pinned(len(CORES), 0, 2) == (None, CORES)


@pytest.mark.skipif(not CORES, reason="needs sched_setaffinity (Linux)")
def test_nothing_is_pinned_for_a_worker_alone_or_a_job_over_several_machines() -> None:
    assert _pinned(1, 0, 1) == (None, CORES)
    assert _pinned(1, 0, 2, 4) == (None, CORES)  # its agent may share the machine
