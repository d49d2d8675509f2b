"""The ``planner`` command line: ``planner profile model.py`` (and, as they land, plan/show/run).

The CLI only parses arguments into the same option dataclasses the Python API
takes, calls the API, and prints. Errors a user can fix print one message
(what, why, how to fix) and exit with status 1; no traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from planner import __version__

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
    except ValueError as exc:  # user errors: what, why, how to fix
        print(f"error: {exc}", file=sys.stderr)
        cause = exc.__cause__
        if cause is not None and ns.verbose:
            import traceback

            traceback.print_exception(cause)
        elif cause is not None:
            print("(run with -v for the original traceback)", file=sys.stderr)
        return 1


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
    return parser


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
        print_profile(prof, title=f"{ns.model_file} · micro-batch {batch_size}")
    return 0
