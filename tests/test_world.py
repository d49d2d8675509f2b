"""The tests' own multi-process helper (tests/world.py): a failing rank never hangs a test."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from world import WorldFailed, run_world

pytestmark = pytest.mark.multiprocess


def _one_rank_raises() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if dist.get_rank() == 1:
        raise RuntimeError("injected failure on rank 1")
    dist.barrier()  # rank 0 waits here for a peer that never comes


@pytest.mark.timeout(90)
def test_a_failing_rank_fails_the_test_with_its_traceback_and_nothing_hangs() -> None:
    start = time.monotonic()
    with pytest.raises(WorldFailed, match="injected failure on rank 1"):
        run_world(_one_rank_raises, 2, timeout_s=60, grace_s=3)
    assert time.monotonic() - start < 45
