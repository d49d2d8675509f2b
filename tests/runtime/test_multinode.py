"""Many machines (issue 13, item 10): two torchrun agents, one rendezvous, one plan.

Two ``python -m runtime.agent`` processes stand for two machines: ``--nnodes
2``, one worker each, the same rendezvous endpoint on 127.0.0.1. They train
the MLP example (pp 2) a few steps; both must exit 0, and the losses rank 0
prints must equal those of a one-node ``planner run`` of the same plan.

The README's multi-node recipe is run the same way: its commands are read
from README.md (the three code blocks after the ``multi-node recipe``
marker), with the host names ``node0``/``node1`` replaced by 127.0.0.1 and its
port by a free one, so that the recipe cannot drift from what works.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from repo import ROOT
from runs import RUN_TIMEOUT_S, alive, planner_run
from world import free_port

pytestmark = pytest.mark.multiprocess

README = ROOT / "README.md"
MARKER = "<!-- multi-node recipe"
MLP_ENV = {"MLP_IN": "32", "OMP_NUM_THREADS": "1"}  # a small MLP; one thread a worker


def recipe() -> list[str]:
    """The README's multi-node commands: the plan, node0's agent, node1's agent."""
    text = README.read_text()
    assert MARKER in text, f"{README} lost its multi-node recipe (the {MARKER} marker)"
    blocks = re.findall(r"```\n(.*?)\n```", text.split(MARKER, 1)[1], flags=re.S)[:3]
    commands = [b.strip() for b in blocks]
    assert len(commands) == 3 and all("\n" not in c for c in commands), commands
    return commands


def _argv(command: str, port: int) -> list[str]:
    """A recipe line as this test runs it: node names → 127.0.0.1, its port → ``port``."""
    line = re.sub(r"\bnode[01]\b", "127.0.0.1", command).replace(":29400", f":{port}")
    words = shlex.split(line)
    if words[0] == "planner":
        return [sys.executable, "-m", "planner", *words[1:]]
    assert words[0] == "python", line
    return [sys.executable, *words[1:]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The recipe's plan (in a folder holding examples/), and a one-node run of it."""
    tmp = tmp_path_factory.mktemp("multinode")
    (tmp / "examples").symlink_to(ROOT / "examples")
    env = {**_env(tmp), "FAULT_TOKEN": uuid.uuid4().hex}
    plan_cmd = _argv(recipe()[0], 0)
    done = subprocess.run(
        plan_cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rc, out, _ = planner_run(["examples/mlp.py", "--plan", "plan.yaml", "--steps", "4"], env, tmp)
    assert rc == 0, out
    return {"tmp": tmp, "losses": _losses(out)}


def _env(tmp: Path) -> dict[str, str]:
    return {
        **os.environ,
        **MLP_ENV,
        "PYTHONPATH": str(ROOT),
        "PLANNER_CACHE_DIR": str(tmp / "cache"),
    }


def _losses(out: str) -> dict[str, float]:
    found = {}
    for line in out.splitlines():
        m = re.match(r"step (\d+/\d+)\s+loss (\S+)", line)
        if m:
            found[m.group(1)] = float(m.group(2))
    return found


def _two_agents(tmp: Path, commands: list[list[str]]) -> list[tuple[int, str]]:
    """Start both agents at once; wait for both (killed at RUN_TIMEOUT_S); (status, output)."""
    token = uuid.uuid4().hex
    env = {**_env(tmp), "FAULT_TOKEN": token}
    logs = [tmp / f"agent{i}-{token}.log" for i in range(len(commands))]
    procs = []
    for cmd, log in zip(commands, logs, strict=True):
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(cmd, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT)
            )
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    time.sleep(0.5)  # the workers' own exits
    assert alive(token) == [], f"processes left running: {alive(token)}"
    return [(p.returncode, log.read_text()) for p, log in zip(procs, logs, strict=True)]


def _check_as_one_node(results: list[tuple[int, str]], want: dict[str, float]) -> None:
    outs = "\n".join(f"--- agent {i} (status {rc}):\n{out}" for i, (rc, out) in enumerate(results))
    assert [rc for rc, _ in results] == [0, 0], outs
    got = {k: v for _, out in results for k, v in _losses(out).items()}  # rank 0: either agent
    assert sorted(got) == ["1/4", "2/4", "3/4", "4/4"], outs
    assert got == pytest.approx(want, abs=2e-6), outs  # as printed: 6 decimals


@pytest.mark.timeout(3 * RUN_TIMEOUT_S + 60)
def test_two_agents_on_one_rendezvous_train_as_one_node(setup: dict[str, Any]) -> None:
    port, job = free_port(), uuid.uuid4().hex
    agent = [sys.executable, "-m", "runtime.agent", "--nnodes", "2", "--nproc-per-node", "1"]
    agent += ["--rdzv-backend", "planner-c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    agent += ["--rdzv-id", job, "--local-addr", "127.0.0.1"]
    worker = ["-m", "runtime", "examples/mlp.py", "--plan", "plan.yaml", "--steps", "4"]
    results = _two_agents(setup["tmp"], [agent + worker, agent + worker])
    _check_as_one_node(results, setup["losses"])


@pytest.mark.timeout(3 * RUN_TIMEOUT_S + 60)
def test_the_readme_multi_node_recipe_runs_on_two_agents(setup: dict[str, Any]) -> None:
    port = free_port()
    _, node0, node1 = recipe()
    assert "--local-addr node0" in node0 and "--local-addr node1" in node1
    results = _two_agents(setup["tmp"], [_argv(node0, port), _argv(node1, port)])
    _check_as_one_node(results, setup["losses"])
