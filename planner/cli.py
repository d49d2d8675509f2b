"""The ``planner`` command line: ``planner profile model.py`` (and, as they land, plan/show/run).

The CLI only parses arguments into the same option dataclasses the Python API
takes, calls the API, and prints. Errors a user can fix print one message
(what, why, how to fix) and exit with status 1; no traceback (``-v`` adds the
original one). A failed ``planner plan`` leaves no files behind: no plan, and
no profile-cache entry.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console

from planner import __version__

if TYPE_CHECKING:
    from planner.plan import Plan

__all__ = ["main"]

log = logging.getLogger("planner")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``planner`` console script."""
    parser = _parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if ns.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(ns.func(ns))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except _user_errors() as exc:  # what, why, how to fix
        _print_error(str(exc), exc.__cause__, ns.verbose)
        return 1
    except OSError as exc:  # a file we could not read or write
        where = f" {exc.filename}" if exc.filename else ""
        _print_error(
            f"cannot access{where}: {exc.strerror or exc}; check the path and its permissions",
            exc,
            ns.verbose,
        )
        return 1


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors a user fixes: bad input, a missing solver. (Evaluated only when something
    is raised, so PuLP, slow to import, is not loaded by ``planner --version``.)"""
    from planner.solve import SolverUnavailable

    return (ValueError, SolverUnavailable)


def _print_error(message: str, cause: BaseException | None, verbose: bool) -> None:
    print(f"error: {message}", file=sys.stderr)
    if cause is not None and verbose:
        import traceback

        traceback.print_exception(cause)
    elif cause is not None:
        print("(run with -v for the original traceback)", file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="planner",
        description="Automatic pipeline + data-parallel partitioning for PyTorch models.",
    )
    parser.add_argument("--version", action="version", version=f"planner {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "profile",
        help="per-block forward/backward time and memory of a model file",
        description=(
            "Trace MODEL_FILE, cut it into blocks and profile each: forward and "
            "backward time, parameter, activation and boundary bytes. Loading "
            "the model file runs its code."
        ),
    )
    p.add_argument("model_file", help="a model.py defining build_model() and sample_batch(n)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="micro-batch size to profile at (default: the file's BATCH_SIZE)",
    )
    p.add_argument(
        "--device-type",
        default="local",
        help="'local' to measure here (default), or a catalogue device for analytic costs "
        "(h100, h200, a100-80gb, a100-40gb, v100-32gb, v100-16gb, l4)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["fp32", "bf16", "fp16"],
        help="analytic only: cost the model as if it ran in this dtype",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (median kept)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=None, help="torch threads while measuring")
    p.add_argument(
        "--max-stages",
        type=int,
        default=64,
        help="granularity: blocks fine enough to balance this many stages (default 64)",
    )
    p.add_argument("--no-cache", action="store_true", help="ignore and do not write the cache")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=_cmd_profile)
    _add_plan_parser(sub)
    _add_show_parser(sub)
    from runtime.launch import add_run_parser

    add_run_parser(sub)
    return parser


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="find the fastest pipeline × data-parallel placement and write a plan file",
        description=(
            "Trace and profile MODEL_FILE, then search pipeline depth, data-parallel width, "
            "micro-batches and schedule, placing blocks on stages with an ILP. Writes the "
            "plan (YAML) and prints the placement report. Loading the model file runs its code."
        ),
    )
    p.add_argument("model_file", help="a model.py defining build_model() and sample_batch(n)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="N devices: N of the local GPU, N of --device-type, or N local CPU devices",
    )
    where.add_argument("--cluster", default=None, help="a cluster YAML (nodes, types, links)")
    p.add_argument("--device-type", default=None, help="catalogue device for --gpus (e.g. h100)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="global batch per optimizer step (default: the file's BATCH_SIZE)",
    )
    p.add_argument("--pp", type=int, default=None, help="pin the pipeline depth")
    p.add_argument("--dp", type=int, default=None, help="pin the data-parallel width")
    p.add_argument("--micro-batches", type=int, default=None, help="pin the micro-batch count")
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default=None, help="pin the schedule")
    p.add_argument("--optimizer", choices=["adam", "adamw", "sgd"], default="adam")
    p.add_argument("--precision", choices=["fp32", "bf16-mixed"], default="fp32")
    p.add_argument(
        "--memory-headroom",
        type=float,
        default=0.1,
        help="share of device memory kept free (default 0.1)",
    )
    p.add_argument("--solver", choices=["highs", "cbc", "auto"], default="highs")
    p.add_argument(
        "--time-limit", type=float, default=60.0, help="seconds per ILP solve (default 60)"
    )
    p.add_argument("--max-stages", type=int, default=64, help="granularity (as in profile)")
    p.add_argument("--repeats", type=int, default=5, help="profiling rounds (median kept)")
    p.add_argument("--warmup", type=int, default=2, help="untimed profiling rounds")
    p.add_argument("--no-cache", action="store_true", help="ignore and do not write the cache")
    p.add_argument("--out", default="plan.yaml", help="plan file to write (default plan.yaml)")
    p.add_argument("--report", default=None, help="also write an HTML report here")
    p.add_argument("--trace", default=None, help="also write a Chrome/Perfetto trace here")
    p.set_defaults(func=_cmd_plan)


def _add_show_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="re-render a saved plan's report")
    p.add_argument("plan_file")
    p.add_argument("--report", default=None, help="also write an HTML report here")
    p.add_argument("--trace", default=None, help="also write a Chrome/Perfetto trace here")
    p.set_defaults(func=_cmd_show)


def _cmd_plan(ns: argparse.Namespace) -> int:
    from planner import cache

    for flag, value in (("--out", ns.out), ("--report", ns.report), ("--trace", ns.trace)):
        _check_writable(flag, value)
    # Cache entries (profiles, the local CPU's measured speed) are written only if
    # the plan is written too.
    with cache.deferred():
        return _plan_with(ns)


def _plan_with(ns: argparse.Namespace) -> int:
    from planner import cache
    from planner.api import PlanOptions, plan_model
    from planner.cluster import from_gpus, load_cluster
    from planner.cost import Training
    from planner.modelfile import load_model_file
    from planner.plan import save_plan
    from planner.profile import ProfileOptions
    from planner.report_profile import progress_bar
    from planner.search import SearchOptions

    if ns.cluster:
        cluster = load_cluster(ns.cluster)
        if ns.device_type:
            raise ValueError("--device-type goes with --gpus; a cluster file names its devices")
    else:
        gpus = ns.gpus
        if gpus < 1:
            raise ValueError(f"--gpus must be ≥ 1, got {gpus}")
        cluster = from_gpus(gpus, ns.device_type)
    mf = load_model_file(ns.model_file)
    batch = ns.batch_size or mf.batch_size
    options = PlanOptions(
        training=Training(
            global_batch=batch,
            optimizer=ns.optimizer,
            precision=ns.precision,
            memory_headroom=ns.memory_headroom,
        ),
        search=SearchOptions(
            pp=ns.pp,
            dp=ns.dp,
            micro_batches=ns.micro_batches,
            schedule=ns.schedule,
            solver=ns.solver,
            time_limit_s=ns.time_limit,
        ),
        profile=ProfileOptions(
            repeats=ns.repeats,
            warmup=ns.warmup,
            target_blocks=ns.max_stages,
            cache=not ns.no_cache,
        ),
    )
    model = mf.build()

    def sampler(b: int) -> tuple[Any, Any, Any]:
        bt = mf.sample(b)
        return bt.args, bt.kwargs, bt.targets

    started = time.perf_counter()
    # Profiles enter the cache only if the plan is written too.
    with cache.deferred():
        with progress_bar() as progress:
            plan = plan_model(
                model,
                sampler,
                cluster=cluster,
                loss_fn=mf.loss,
                options=options,
                model_file=str(ns.model_file),
                progress=progress,
            )
        _print_report(plan)
        path = save_plan(plan, ns.out)
    # Wall-clock times are printed, never saved: [Note: reproducible plan files].
    took = f"planning took {time.perf_counter() - started:.1f} s"
    if plan.solver.solve_s is not None:
        took += f", the chosen placement's solve {plan.solver.solve_s:.2f} s"
    print(f"plan written to {path} ({took})")
    _write_extras(plan, ns)
    return 0


def _check_writable(flag: str, value: str | None) -> None:
    """Refuse an output path that cannot be written, before minutes of profiling."""
    import os
    from pathlib import Path

    if value is None:
        return
    path = Path(value)
    folder = next((p for p in path.absolute().parents if p.exists()), None)
    if path.is_dir():
        problem = "is a folder"
    elif folder is not None and not folder.is_dir():
        problem = f"lies under {folder}, which is a file"
    elif folder is not None and not os.access(folder, os.W_OK | os.X_OK):
        problem = f"cannot be created: {folder} is not writable"
    else:
        return
    raise ValueError(f"{flag} {value} {problem}; give a file path in a folder you can write to")


def _cmd_show(ns: argparse.Namespace) -> int:
    from planner.plan import load_plan

    plan = load_plan(ns.plan_file)
    _print_report(plan)
    _write_extras(plan, ns)
    return 0


def _console() -> Console:
    """A rich console; wide when the output is a file or pipe (tables stay readable)."""
    return Console(width=None if sys.stdout.isatty() else 150)


def _print_report(plan: Plan) -> None:
    from planner.report import print_plan

    print_plan(plan, console=_console())


def _write_extras(plan: Plan, ns: argparse.Namespace) -> None:
    """The HTML report and the trace, when asked for."""
    from planner.report import write_html, write_trace

    if ns.report:
        print(f"report written to {write_html(plan, ns.report)}")
    if ns.trace:
        print(f"trace written to {write_trace(plan, ns.trace)}")


def _cmd_profile(ns: argparse.Namespace) -> int:
    from planner.modelfile import load_model_file
    from planner.profile import ProfileOptions, profile_model
    from planner.report_profile import print_profile, progress_bar

    options = ProfileOptions(
        device=ns.device_type,
        dtype=ns.dtype,
        repeats=ns.repeats,
        warmup=ns.warmup,
        threads=ns.threads,
        target_blocks=ns.max_stages,
        cache=not ns.no_cache,
    )
    mf = load_model_file(ns.model_file)
    batch_size = ns.batch_size or mf.batch_size
    if batch_size < 1:
        raise ValueError(f"--batch-size must be ≥ 1, got {batch_size}")
    model = mf.build()
    batch = mf.sample(batch_size)
    with progress_bar(enabled=not ns.json) as progress:
        prof = profile_model(
            model,
            batch.args,
            batch.kwargs,
            targets=batch.targets,
            loss_fn=mf.loss,
            options=options,
            progress=progress,
        )
    if ns.json:
        json.dump(prof.to_dict(), sys.stdout, indent=1)
        print()
    else:
        print_profile(prof, title=f"{ns.model_file} · micro-batch {batch_size}", console=_console())
    return 0
