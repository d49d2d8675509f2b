"""``planner run`` end to end (runtime/launch.py, runtime/measure/): 2 workers through torchrun.

The MLP example (32 input features) planned for 2 local CPU devices (pp = 2,
2 micro-batches) trains 4 steps with checkpoints every 2 steps and a
measured trace; a second ``planner run`` resumes from the step-4 checkpoint
and trains steps 5 and 6. The launcher runs as a subprocess, as a user runs it.

Without processes: the torchrun command ``planner run`` builds rendezvous on
127.0.0.1 unless told another address (multi-node needs an explicit one), and
a store made by ``runtime.rendezvous`` listens on the loopback address only
(torch's own TCPStore listens on every interface, whatever its host name).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from runs import MLP, RUN_TIMEOUT_S, listening_addresses, mlp_plan, planner_run

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("run")
    plan, env = mlp_plan(tmp, global_batch=32)
    common = [str(MLP), "--plan", "plan.yaml", "--checkpoint-dir", "ckpt"]
    first = planner_run(
        [*common, "--steps", "4", "--checkpoint-every", "2", "--trace", "trace.json"], env, tmp
    )
    second = planner_run([*common, "--steps", "6"], env, tmp)
    return {"tmp": tmp, "plan": plan, "first": first, "second": second}


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_planner_run_trains_and_prints_each_step(runs: dict[str, Any]) -> None:
    rc, out, _ = runs["first"]
    assert rc == 0, out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["1/4", "2/4", "3/4", "4/4"], out
    for line in steps:
        fields = line.split()
        assert fields[2] == "loss" and float(fields[3]) > 0, line
        assert fields[5] == "ms" and fields[7] == "samples/s", line
    losses = [float(s.split()[3]) for s in steps]
    assert losses[-1] < losses[0], losses  # it trains
    assert "checkpoint saved: " in out and "step-00000004" in out
    for step in (2, 4):
        assert (runs["tmp"] / "ckpt" / f"step-{step:08d}" / "COMPLETE").is_file()


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_planner_run_prints_predicted_beside_measured(runs: dict[str, Any]) -> None:
    rc, out, _ = runs["first"]
    assert rc == 0, out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("predicted vs measured"))
    # Step 1 warms up, 2–3 measure the memory (tracked, so slower), 4 is timed.
    assert "pp 2 × dp 1" in lines[head] and "medians over step(s) 4" in lines[head], lines[head]
    assert "step(s) 2–3: memory measured (tracked, slower), not timed" in out, out
    columns = lines[head + 1].split()
    assert columns[:5] == ["stage", "ranks", "fwd", "ms", "meas"], columns
    plan = runs["plan"]
    for k in range(2):
        cells = lines[head + 2 + k].split()
        assert cells[0] == str(k) and cells[1] == str(k)
        assert float(cells[2]) == pytest.approx(plan.stages[k].fwd_ms, abs=0.01)
        assert float(cells[3]) > 0 and cells[4].endswith("%")  # measured, and its error
    assert lines[head + 4].startswith("step: predicted"), lines[head + 4]


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_planner_run_writes_a_measured_trace_one_process_per_rank(runs: dict[str, Any]) -> None:
    rc, out, _ = runs["first"]
    assert rc == 0, out
    data = json.loads((runs["tmp"] / "trace.json").read_text())
    names = {
        e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"
    }
    assert names == {0: "rank 0: replica 0, stage 0", 1: "rank 1: replica 0, stage 1"}
    boxes = [e for e in data["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        mine = {(e["args"]["step"], e["name"]) for e in boxes if e["pid"] == rank}
        for step in range(1, 5):
            assert {(step, "F0"), (step, "F1"), (step, "B0"), (step, "B1")} <= mine, (rank, step)
            assert (step, f"step {step}") in mine
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in boxes)


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_planner_run_resumes_from_the_last_complete_checkpoint(runs: dict[str, Any]) -> None:
    rc, out, _ = runs["second"]
    assert rc == 0, out
    assert "resumed from ckpt/step-00000004 (step 4)" in out, out
    steps = [line.split()[1] for line in out.splitlines() if line.startswith("step ")]
    assert steps == ["5/6", "6/6"], out
    assert (runs["tmp"] / "ckpt" / "step-00000006" / "COMPLETE").is_file()


def test_run_options_are_checked_before_launching(tmp_path: Path) -> None:
    from runtime.launch import add_run_parser, cmd_run

    parser = argparse.ArgumentParser(prog="planner")
    add_run_parser(parser.add_subparsers())
    ns = parser.parse_args(["run", str(MLP), "--plan", str(tmp_path / "missing.yaml")])
    with pytest.raises(ValueError, match="not found"):
        cmd_run(ns)
    ns = parser.parse_args(["run", str(MLP), "--plan", "p.yaml", "--checkpoint-every", "2"])
    with pytest.raises(ValueError, match="needs --checkpoint-dir"):
        cmd_run(ns)


def _run_options(*args: str) -> tuple[Any, Any]:
    """``planner run``'s options (the worker's, the launch's) from its command line."""
    from planner.plan.fields import from_namespace
    from runtime.launch import add_run_parser
    from runtime.options import LaunchOptions, RunOptions

    parser = argparse.ArgumentParser(prog="planner")
    add_run_parser(parser.add_subparsers())
    ns = parser.parse_args(["run", str(MLP), "--plan", "plan.yaml", *args])
    return from_namespace(RunOptions, ns), from_namespace(LaunchOptions, ns)


def _option(cmd: list[str], flag: str) -> str:
    """The value of torchrun's ``flag`` in ``cmd`` (before the worker's own arguments)."""
    agent = cmd[: cmd.index("runtime")]
    return agent[agent.index(flag) + 1]


def test_a_local_run_rendezvous_on_the_loopback_address() -> None:
    from runtime.launch import torchrun_command
    from runtime.rendezvous import BACKEND

    cmd = torchrun_command(*_run_options(), 4, 29555)
    assert cmd[1:3] == ["-m", "runtime.agent"]
    assert _option(cmd, "--nnodes") == "1" and _option(cmd, "--nproc-per-node") == "4"
    assert _option(cmd, "--rdzv-endpoint") == "127.0.0.1:29555"
    assert _option(cmd, "--local-addr") == "127.0.0.1"  # the workers' MASTER_ADDR
    assert _option(cmd, "--rdzv-backend") == BACKEND  # its store bound to loopback only
    # another address is an explicit choice (the machines must reach each other)
    cmd = torchrun_command(*_run_options("--master-addr", "10.1.2.3"), 4, 29555)
    assert _option(cmd, "--rdzv-endpoint") == "10.1.2.3:29555"
    assert _option(cmd, "--local-addr") == "10.1.2.3"


def test_a_loopback_store_listens_on_the_loopback_address_only() -> None:
    from runtime.rendezvous import is_loopback, listening_store

    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("10.1.2.3") and not is_loopback("node-1")
    port = _free_tcp_port()
    store = listening_store("127.0.0.1", port, world_size=1, timeout_s=10)
    store.set("key", "value")
    assert listening_addresses(port) == ["127.0.0.1"]  # torch's own would say "::"
    del store


def _free_tcp_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_peers_hang_up_is_never_the_root_cause(tmp_path: Path) -> None:
    """Rank 0 recorded a communication error (marked secondary, stamped t + 1); rank 1 was
    killed and torchrun stamped it when it noticed, in that same next second: a tie that
    torchrun breaks towards rank 0. The agent puts the hang-up after it."""
    import time

    from torch.distributed.elastic.multiprocessing import errors

    from runtime.agent import root_first, verdict
    from runtime.failure import SECONDARY

    stamp = int(time.time()) + 1
    path = tmp_path / "error.json"
    info = {"py_callstack": "hang-up", "timestamp": str(stamp), SECONDARY: True}
    path.write_text(json.dumps({"message": {"message": "DistError: reset", "extraInfo": info}}))
    hung_up = errors.ProcessFailure(local_rank=0, pid=40, exitcode=1, error_file=str(path))
    killed = errors.ProcessFailure(local_rank=1, pid=41, exitcode=-9, error_file="")
    killed.timestamp = stamp  # noticed in the next second
    exc = errors.ChildFailedError("runtime", {0: hung_up, 1: killed})
    assert exc.get_first_failure()[0] == 0  # torchrun alone blames the hang-up
    root_first(exc)
    assert exc.get_first_failure()[0] == 1
    assert verdict(exc).startswith("planner run: rank 1 (local rank 1, pid 41) was killed")
    # A failure of a rank's own is left where it is, even when a hang-up came first.
    own = errors.ProcessFailure(local_rank=1, pid=41, exitcode=1, error_file="")
    own.timestamp = stamp + 5
    exc = errors.ChildFailedError("runtime", {0: hung_up, 1: own})
    root_first(exc)
    assert (own.timestamp, exc.get_first_failure()[0]) == (stamp + 5, 1)
