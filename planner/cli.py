"""The ``planner`` command line: ``planner profile|plan|show|run|calibrate|init-weights``.

The flags of every knob are generated from the option dataclasses
(:mod:`planner.options`, :mod:`runtime.options`): the CLI parses into the same
dataclasses the Python API takes, calls the API, and prints. Only what is the
command line's own is declared here (the model file, where to write, the
cluster flags). Errors a user can fix print one message (what, why, how to
fix) and exit with status 1; no traceback (``-v`` adds the original one). Any
other error (a model's RuntimeError, MemoryError, a planner bug) and a
``sys.exit`` in the model's code are named the same way (``planner.plan.unexpected``),
with the original type and message. A
failed ``planner plan`` leaves no files behind: no plan, and no profile-cache
entry.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from planner import __version__
from planner.options import PlanOptions, ProfileOptions, SearchOptions, Training
from planner.plan.fields import add_options, from_namespace

if TYPE_CHECKING:
    from planner.plan.schema import Plan

__all__ = ["main"]

log = logging.getLogger("planner")

_MODEL_FILE = "a model.py defining build_model() and sample_batch(n)"
# the profile knobs `plan` takes
_PLAN_PROFILE = ("repeats", "warmup", "target_blocks", "cache", "calibration")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``planner`` console script."""
    parser = build_parser()
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
    except SystemExit as exc:  # nothing of ours exits inside a command: the model's code did
        _print_error(_exited(exc, getattr(ns, "model_file", None)), exc, ns.verbose)
        return 1
    except Exception as exc:  # RuntimeError, MemoryError, a bug: named, never swallowed
        from planner.plan.unexpected import explain

        _print_error(explain(exc, getattr(ns, "model_file", None)), exc, ns.verbose)
        return 1


def _exited(exc: SystemExit, model_file: str | None) -> str:
    """The error for a ``sys.exit`` inside a command (a model's forward, say)."""
    from planner.plan.modelimport import exit_site

    call, where, mine = exit_site(exc, model_file)
    who = f"the model file {model_file}" if mine else "code the planner called"
    return (
        f"{who} called {call} at {where}\n"
        "  why: a model file's code must return or raise, not exit: the planner cannot "
        "finish the plan, or say why it stopped, when the process is ended under it\n"
        "  fix: return normally (or raise an exception that says what is wrong) instead of "
        "calling sys.exit"
    )


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors a user fixes: bad input, a missing solver. (Evaluated only when something
    is raised, so PuLP, slow to import, is not loaded by ``planner --version``.)"""
    from planner.solve.problem import SolverUnavailable

    return (ValueError, SolverUnavailable)


def _print_error(message: str, cause: BaseException | None, verbose: bool) -> None:
    print(f"error: {message}", file=sys.stderr)
    if cause is not None and verbose:
        import traceback

        traceback.print_exception(cause)
    elif cause is not None:
        print("(run with -v for the original traceback)", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    """The `planner` command line, every subcommand."""
    parser = argparse.ArgumentParser(
        prog="planner",
        description="Automatic pipeline + data-parallel partitioning for PyTorch models.",
    )
    parser.add_argument("--version", action="version", version=f"planner {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_profile_parser(sub)
    _add_plan_parser(sub)
    _add_show_parser(sub)
    from runtime.launch import add_run_parser

    add_run_parser(sub)
    from planner.calibrate.command import add_calibrate_parser

    add_calibrate_parser(sub, _run_plan)
    _add_init_weights_parser(sub)
    return parser


def _run_plan(model_file: str, plan_file: str, steps: int, measurements: str) -> int:
    """``planner run`` of a plan for ``planner calibrate``, its measurements saved."""
    from runtime.launch import cmd_run

    argv = ["run", model_file, "--plan", plan_file, "--steps", str(steps)]
    argv += ["--no-memory", "--measurements", measurements]  # the times alone, untracked
    return int(cmd_run(build_parser().parse_args(argv)))


def _add_profile_parser(sub: Any) -> None:
    p = sub.add_parser(
        "profile",
        help="per-block forward/backward time and memory of a model file",
        description=(
            "Trace MODEL_FILE, cut it into blocks and profile each: forward and "
            "backward time, parameter, activation and boundary bytes. Loading "
            "the model file runs its code."
        ),
    )
    p.add_argument("model_file", help=_MODEL_FILE)
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="micro-batch size to profile at (default: the file's BATCH_SIZE)",
    )
    add_options(p, ProfileOptions)
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=_cmd_profile)


def _add_plan_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="find the fastest pipeline × data-parallel placement and write a plan file",
        description=(
            "Trace and profile MODEL_FILE, then search pipeline depth, data-parallel width, "
            "micro-batches and schedule, placing blocks on stages with an ILP. Writes the "
            "plan (YAML) and prints the placement report. Loading the model file runs its code."
        ),
    )
    p.add_argument("model_file", help=_MODEL_FILE)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="N devices: N of the local GPU, N of --device-type, or N local CPU devices",
    )
    where.add_argument("--cluster", default=None, help="a cluster YAML (nodes, types, links)")
    p.add_argument("--device-type", default=None, help="catalogue device for --gpus (e.g. h100)")
    add_options(p, Training)
    add_options(p, SearchOptions)
    add_options(p, ProfileOptions, only=_PLAN_PROFILE)
    p.add_argument("--out", default="plan.yaml", help="plan file to write (default plan.yaml)")
    p.add_argument("--report", default=None, help="also write an HTML report here")
    p.add_argument("--trace", default=None, help="also write a Chrome/Perfetto trace here")
    p.set_defaults(func=_cmd_plan)


def _add_show_parser(sub: Any) -> None:
    p = sub.add_parser("show", help="re-render a saved plan's report")
    p.add_argument("plan_file")
    p.add_argument("--report", default=None, help="also write an HTML report here")
    p.add_argument("--trace", default=None, help="also write a Chrome/Perfetto trace here")
    p.set_defaults(func=_cmd_show)


def _add_init_weights_parser(sub: Any) -> None:
    from runtime.options import RunOptions

    p = sub.add_parser(
        "init-weights",
        help="write a model's initial weights (as a run with --seed starts) for --init-from",
        description=(
            "Build MODEL_FILE once, with torch's seed set as `planner run --seed` sets it, and "
            "write every parameter and buffer to a safetensors file. `planner run ... "
            "--init-from FILE` then builds only each rank's stage and trains the same losses. "
            "Loading the model file runs its code."
        ),
    )
    p.add_argument("model_file", help=_MODEL_FILE)
    p.add_argument("--out", required=True, help="the safetensors file to write")
    add_options(p, RunOptions, only=("seed",))
    p.set_defaults(func=_cmd_init_weights)


def _cmd_init_weights(ns: argparse.Namespace) -> int:
    from runtime.materialize import save_initial_weights

    path = save_initial_weights(ns.model_file, ns.out, seed=ns.seed)
    print(f"initial weights (seed {ns.seed}) written to {path}")
    return 0


def _cmd_plan(ns: argparse.Namespace) -> int:
    from planner import cache

    for flag, value in (("--out", ns.out), ("--report", ns.report), ("--trace", ns.trace)):
        _check_writable(flag, value)
    # Cache entries (profiles, the local CPU's measured speed) are written only if
    # the plan is written too.
    with cache.deferred():
        return _plan_with(ns)


def _plan_with(ns: argparse.Namespace) -> int:
    from planner.plan.files import save_plan
    from planner.report.progress import progress_bar

    started = time.perf_counter()
    with progress_bar() as progress:  # closed before the report is printed
        plan = _planned(ns, progress)
    _print_report(plan)
    path = save_plan(plan, ns.out)
    # Wall-clock times are printed, never saved: [Note: reproducible plan files].
    took = f"planning took {time.perf_counter() - started:.1f} s"
    if plan.solver.solve_s is not None:
        took += f", the chosen placement's solve {plan.solver.solve_s:.2f} s"
    print(f"plan written to {path} ({took})")
    _write_extras(plan, ns)
    return 0


def _planned(ns: argparse.Namespace, progress: Any) -> Plan:
    """The plan ``planner plan`` asks for; each phase reported to ``progress``."""
    if progress is not None:  # seconds of imports (torch) and the model file's own
        progress(f"loading torch and {ns.model_file}", 0, 0, "")
    from planner.devices.build import from_gpus
    from planner.devices.cluster_file import load_cluster
    from planner.plan.modelfile import ModelFile
    from planner.planning import plan_model_file

    if ns.cluster:
        cluster = load_cluster(ns.cluster)
        if ns.device_type:
            raise ValueError("--device-type goes with --gpus; a cluster file names its devices")
    else:
        cluster = from_gpus(ns.gpus, ns.device_type)

    def options(mf: ModelFile) -> PlanOptions:
        return PlanOptions(
            training=from_namespace(Training, ns, global_batch=ns.global_batch or mf.batch_size),
            search=from_namespace(SearchOptions, ns),
            profile=from_namespace(ProfileOptions, ns),
        )

    return plan_model_file(ns.model_file, cluster, options, progress)


def _check_writable(flag: str, value: str | None) -> None:
    """Refuse an output path that cannot be written, before minutes of profiling."""
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
    from planner.plan.files import load_plan

    plan = load_plan(ns.plan_file)
    _print_report(plan)
    _write_extras(plan, ns)
    return 0


def _console() -> Console:
    """A rich console: the terminal's width, or to a file or pipe ``COLUMNS`` (default
    100); the tables fold to it (``planner.plan.fold``)."""
    from planner.plan.fold import output_width

    return Console(width=None if sys.stdout.isatty() else output_width(False))


def _print_report(plan: Plan) -> None:
    from planner.report.terminal import print_plan

    print_plan(plan, console=_console())


def _write_extras(plan: Plan, ns: argparse.Namespace) -> None:
    """The HTML report and the trace, when asked for."""
    from planner.report.html import write_html
    from planner.report.trace import write_trace

    if ns.report:
        print(f"report written to {write_html(plan, ns.report)}")
    if ns.trace:
        print(f"trace written to {write_trace(plan, ns.trace)}")


def _cmd_profile(ns: argparse.Namespace) -> int:
    import contextlib

    import torch

    from planner.plan.modelfile import load_model_file
    from planner.plan.records import ModelProfile
    from planner.plan.text import first_line
    from planner.profile.meta import ShapesOnlyError
    from planner.profile.profiler import profile_model
    from planner.report.profile_table import print_profile
    from planner.report.progress import progress_bar

    options = from_namespace(ProfileOptions, ns)
    mf = load_model_file(ns.model_file)
    batch_size = ns.batch_size or mf.batch_size
    if batch_size < 1:
        raise ValueError(f"--batch-size must be ≥ 1, got {batch_size}")

    def profiled(meta: bool, progress: Any) -> ModelProfile:
        if progress is not None:  # until the timing starts (or the priced profile is done)
            progress(f"building and tracing the model at micro-batch {batch_size}", 0, 0, "")
        # An analytic profile needs shapes only: model and batch made on the meta device.
        model = mf.build(meta=meta)
        with torch.device("meta") if meta else contextlib.nullcontext():
            batch = mf.sample(batch_size)
        return profile_model(
            model,
            batch.args,
            batch.kwargs,
            targets=batch.targets,
            loss_fn=mf.loss,
            options=options,
            progress=progress,
        )

    with progress_bar(enabled=not ns.json) as progress:
        try:
            prof = profiled(options.analytic, progress)
        except ShapesOnlyError as exc:  # the forward reads values: profile real tensors
            log.warning("%s; profiling the model with real tensors", first_line(exc))
            prof = profiled(False, progress)
    if ns.json:
        json.dump(prof.to_dict(), sys.stdout, indent=1)
        print()
    else:
        print_profile(prof, title=f"{ns.model_file} · micro-batch {batch_size}", console=_console())
    return 0
