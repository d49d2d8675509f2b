"""runtime.failure.die_with_parent: a launched process dies with its parent (issue 13).

A parent starts a child that calls ``die_with_parent`` and then exits without
waiting for it; the child must be gone within seconds, through Linux's
``PR_SET_PDEATHSIG`` and through the portable ``os.getppid()`` watchdog.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from repo import ROOT

ORPHAN = """
import os, signal, sys, time
import runtime.failure as failure
if sys.argv[1] == "watchdog":  # as where there is no prctl: the getppid() thread
    failure._prctl_pdeathsig = lambda sig: False
failure.die_with_parent(signal.SIGKILL)
with open(sys.argv[2], "w") as f:
    f.write(str(os.getpid()))
time.sleep(60)
"""

PARENT = """
import os, subprocess, sys, time
env = {**os.environ, "PLANNER_PARENT_PID": str(os.getpid())}
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], env=env)
while not os.path.exists(sys.argv[3]):
    time.sleep(0.02)
os._exit(0)  # dies, leaving its child behind
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")  # dead; its new parent may not have reaped it yet


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["prctl", "watchdog"])
def test_a_process_dies_with_its_parent(tmp_path: Path, how: str) -> None:
    if how == "prctl" and not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    pidfile = tmp_path / "child.pid"
    subprocess.run(
        [sys.executable, "-c", PARENT, ORPHAN, how, str(pidfile)], timeout=90, check=True
    )
    child, start = int(pidfile.read_text()), time.monotonic()
    while not _gone(child) and time.monotonic() - start < 10:
        time.sleep(0.05)
    assert _gone(child), f"{how}: pid {child} outlived its parent by 10 s"


@pytest.mark.timeout(60)
def test_a_process_whose_parent_is_already_gone_dies_at_once(tmp_path: Path) -> None:
    env = {**os.environ, "PLANNER_PARENT_PID": "1"}  # not its parent: that one died before
    done = subprocess.run(
        [sys.executable, "-c", ORPHAN, "prctl", str(tmp_path / "pid")],
        cwd=ROOT,
        env=env,
        timeout=50,
    )
    assert done.returncode == -signal.SIGKILL
    assert not (tmp_path / "pid").exists()
