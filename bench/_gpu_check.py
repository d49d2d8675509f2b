"""The Python steps of bench/gpu_check.sh, one subcommand each.

    python -m bench._gpu_check device cuda        # (a) the GPU; prints gpu-key=K last
    python -m bench._gpu_check measure MODEL_FILE WHERE MICRO_BATCH ANALYTIC OUT COMPARE
    python -m bench._gpu_check summary --mode cpu --where cpu --scratch DIR --out FILE \\
        --wall 70 a-device=0:2 b-analytic=0:4 ...

The script runs them under its time limits and keeps what they print; ``measure`` loads
torch and the model file (:mod:`bench._gpu_measure`), ``summary`` reads text and JSON
only (:mod:`bench._gpu_summary`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["FALLBACK_GPU", "device", "main", "parser"]

# The catalogue GPU whose figures stand in for a GPU the catalogue does not know, and
# the one the dry run's two-GPU plan (step c) is for.
FALLBACK_GPU = "h100"


def device(mode: str) -> int:
    """Step (a): the GPU as torch and the planner's catalogue see it. The last line is
    ``gpu-key=K`` (``gpu-key=K unknown`` when K stands in for a GPU the catalogue lacks).

    Returns:
        0; 1 (with the error on stderr) when ``mode`` is "cuda" and torch sees no GPU.
    """
    import torch

    from planner.devices.catalogue import default_catalogue

    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    if mode == "cpu":
        print("dry run: analytic figures for the local CPU's measured roofline (catalogue: cpu)")
        print(f"gpu-key={FALLBACK_GPU}")
        return 0
    if not torch.cuda.is_available():
        print(
            "error: torch sees no CUDA GPU here; run this on the GPU machine, or "
            "`bench/gpu_check.sh --dry-run` to check the steps on the CPU",
            file=sys.stderr,
        )
        return 1
    name = torch.cuda.get_device_name(0)
    props = torch.cuda.get_device_properties(0)
    print(
        f"cuda:0 {name}: {props.total_memory / 2**30:.1f} GiB, "
        f"{props.multi_processor_count} SMs; {torch.cuda.device_count()} GPU(s) visible"
    )
    key = default_catalogue().cuda_names.get(name.strip().lower())
    if key is None:
        print(
            f"catalogue: no entry for {name!r}; the analytic figures are for {FALLBACK_GPU} "
            f"instead (add `cuda_names: [{name}]` to a planner/data/devices.yaml entry to "
            "match it)"
        )
        print(f"gpu-key={FALLBACK_GPU} unknown")
    else:
        print(f"catalogue: {name!r} is {key!r}")
        print(f"gpu-key={key}")
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per step of the script that runs Python."""
    p = argparse.ArgumentParser(
        prog="python -m bench._gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("device", help="(a) the GPU, torch's name for it, its catalogue entry")
    d.add_argument("mode", choices=("cuda", "cpu"))
    m = sub.add_parser("measure", help="(b) the analytic profile's blocks timed on WHERE")
    m.add_argument("model_file", help="the model file profiled (examples/gpt.py)")
    m.add_argument("where", help="the torch device to time on: cuda:0 or cpu")
    m.add_argument("micro_batch", type=int, help="samples per micro-batch, as profiled")
    m.add_argument("analytic", help="the analytic profile (planner profile --json)")
    m.add_argument("out", help="where to write the measured profile (JSON)")
    m.add_argument("compare", help="where to write the totals compared, for the summary")
    s = sub.add_parser("summary", help="(e) predicted against measured; summary.json")
    s.add_argument("--mode", required=True, choices=("cuda", "cpu"))
    s.add_argument("--where", required=True, help="the device the runs measured: cuda:0, cpu")
    s.add_argument("--scratch", required=True, type=Path, help="the steps' captured output")
    s.add_argument("--out", required=True, type=Path, help="summary.json")
    s.add_argument("--wall", required=True, type=int, help="seconds the script has run")
    s.add_argument("status", nargs="*", help="each step as NAME=STATUS:SECONDS")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; its exit status."""
    args = parser().parse_args(argv)
    if args.command == "device":
        return device(args.mode)
    if args.command == "measure":
        from bench._gpu_measure import measure

        measure(
            args.model_file, args.where, args.micro_batch, args.analytic, args.out, args.compare
        )
        return 0
    from bench._gpu_summary import summarize

    summarize(
        mode=args.mode,
        where=args.where,
        scratch=args.scratch,
        out_path=args.out,
        wall=args.wall,
        status=args.status,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
