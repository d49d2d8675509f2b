"""Running ``planner run`` from the tests, and looking at the processes and sockets it leaves."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from repo import ROOT

__all__ = [
    "MLP",
    "RUN_TIMEOUT_S",
    "alive",
    "listening_addresses",
    "mlp_plan",
    "planner_command",
    "planner_run",
    "sockets",
]

RUN_TIMEOUT_S = 120
"""The longest one ``planner run`` of a test may take."""


MLP = ROOT / "examples" / "mlp.py"


def mlp_plan(tmp: Path, global_batch: int) -> tuple[Any, dict[str, str]]:
    """The MLP example (32 features) planned for 2 local CPU processes (pp 2, GPipe, 2
    micro-batches), saved as ``tmp/plan.yaml``; returns it and the run's environment."""
    import pytest

    from planner.devices import from_gpus
    from planner.options import PlanOptions, ProfileOptions, SearchOptions, Training
    from planner.plan import save_plan
    from planner.plan.modelfile import load_model_file
    from planner.planning import plan_model

    env = {"MLP_IN": "32", "PLANNER_CACHE_DIR": str(tmp / "cache")}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mf = load_model_file(MLP)
        plan = plan_model(
            mf.build(),
            lambda b: (mf.sample(b).args, {}, mf.sample(b).targets),
            cluster=from_gpus(2),
            loss_fn=mf.loss,
            options=PlanOptions(
                training=Training(global_batch=global_batch),
                search=SearchOptions(pp=2, micro_batches=2, schedule="gpipe"),
                profile=ProfileOptions(repeats=2, warmup=1),
            ),
            model_file="examples/mlp.py",
        )
    save_plan(plan, tmp / "plan.yaml")
    return plan, env


def planner_command(args: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``planner run ARGS``."""
    return [sys.executable, "-m", "planner", "run", *args], {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        **env,
    }


def planner_run(args: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, float]:
    """Run ``planner run ARGS``; returns (exit status, stdout + stderr, seconds)."""
    cmd, full_env = planner_command(args, env)
    start = time.monotonic()
    proc = subprocess.run(
        cmd, env=full_env, cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def listening_addresses(port: int | None = None, inodes: set[int] | None = None) -> list[str]:
    """Local addresses of this machine's listening TCP sockets (of ``port``, or these inodes)."""
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            hexaddr, hexport = fields[1].split(":")
            if port is not None and int(hexport, 16) != port:
                continue
            if inodes is not None and int(fields[9]) not in inodes:
                continue
            raw = bytes.fromhex(hexaddr)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            ip = ipaddress.ip_address(raw) if v6 else ipaddress.IPv4Address(raw)
            mapped = getattr(ip, "ipv4_mapped", None)
            found.append(str(mapped or ip))
    return sorted(found)


def alive(token: str) -> list[int]:
    """Processes still running with FAULT_TOKEN=token in their environment."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        if f"FAULT_TOKEN={token}".encode() in env.split(b"\0"):
            found.append(int(proc.name))
    return found


def sockets(pids: list[int]) -> set[int]:
    """The inodes of the sockets these processes hold open."""
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        inodes |= {int(x[8:-1]) for x in links if x.startswith("socket:[")}
    return inodes
