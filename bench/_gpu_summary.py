"""Step (e) of bench/gpu_check.sh: predicted against measured, from the runs' tables and
the profiles' comparison, printed and written to ``summary.json``.

Pure text and numbers (no torch). A run's figures are read back from what `planner run`
printed: its predicted-vs-measured table (``runtime.measure.compare.comparison_table``,
one header line, columns in groups of predicted, "meas", "err"), its "step: predicted
... ms, measured ... ms" line and its "step i/n  loss x" lines.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from planner.plan.text import ERROR_CONVENTION, fmt_error, rel_error

__all__ = [
    "number",
    "plain",
    "profile_lines",
    "row",
    "run_lines",
    "run_table",
    "step_lines",
    "summarize",
]

# The figures the summary reads from a run's table: its key -> the column group's head.
_GROUPS = (("fwd_ms", "fwd ms"), ("bwd_ms", "bwd ms"), ("mem_mib", "mem MiB"))


def number(cell: str) -> float:
    """A table cell as a number; NaN for "—" (not measured).

    >>> number("—") != number("—")
    True
    """
    try:
        return float(cell)
    except ValueError:
        return math.nan


def _stage_rows(lines: list[str], head_at: int) -> list[dict[str, Any]]:
    head = re.split(r"\s{2,}", lines[head_at].strip())
    stages = []
    for line in lines[head_at + 1 :]:
        cells = line.split()
        if len(cells) != len(head) or not cells[0].isdigit():
            break
        groups: dict[str, list[str]] = {}  # "fwd ms": [predicted, meas, err], ...
        group = ""
        for name, cell in zip(head, cells, strict=True):
            if name not in ("meas", "err"):
                group = name
            groups.setdefault(group, []).append(cell)
        stages.append(
            {
                "stage": int(groups["stage"][0]),
                **{
                    key: {"predicted": number(groups[g][0]), "measured": number(groups[g][1])}
                    for key, g in _GROUPS
                },
            }
        )
    return stages


def run_table(text: str) -> dict[str, Any] | None:
    """A run's predicted-vs-measured figures, found by the table's title; None without one.

    Returns:
        ``step_ms`` ({"predicted", "measured"}, None without the "step:" line), ``stages``
        (per stage: ``stage`` and {"predicted", "measured"} of ``fwd_ms``, ``bwd_ms``,
        ``mem_mib``), ``steps_trained``, ``steps_asked`` and ``last_loss``.
    """
    lines = text.splitlines()
    start = next((i for i, s in enumerate(lines) if s.startswith("predicted vs measured:")), None)
    if start is None:
        return None
    head_at = next(i for i in range(start, len(lines)) if lines[i].split()[:1] == ["stage"])
    step = re.search(r"^step: predicted (\S+) ms, measured (\S+) ms", text, re.M)
    trained = re.findall(r"^step (\d+)/(\d+)\s+loss (\S+)", text, re.M)
    return {
        "step_ms": {"predicted": number(step[1]), "measured": number(step[2])} if step else None,
        "stages": _stage_rows(lines, head_at),
        "steps_trained": len(trained),
        "steps_asked": int(trained[-1][1]) if trained else 0,
        "last_loss": number(trained[-1][2]) if trained else math.nan,
    }


def row(what: str, p: float, m: float, unit: str, digits: int = 2) -> str:
    """One summary line: what, then predicted and measured in ``unit`` with ``digits``
    decimals, then the error (``planner.plan.text.fmt_error``), in fixed columns."""
    return (
        f"  {what:<36} predicted {p:>10.{digits}f} {unit:<4} measured {m:>10.{digits}f} "
        f"{unit:<4} error {fmt_error(p, m):>6}"
    )


def profile_lines(prof: dict[str, Any]) -> list[str]:
    """The profiles' comparison (``bench._gpu_compare.compare_record``): its totals."""
    t = prof["totals"]
    return [
        f"profile: micro-batch {prof['micro_batch']}, {prof['blocks']} blocks, analytic for "
        f"{prof['analytic_device']} against measured on {prof['measured_on']} ({prof['how']}, "
        f"median of {prof['rounds']} rounds)",
        row("Σ forward (blocks + loss)", *_pm(t["fwd_ms"]), "ms", 3),
        row("Σ backward (blocks + loss)", *_pm(t["bwd_ms"]), "ms", 3),
        row("forward + backward, whole model", *_pm(t["fwd_bwd_ms"]), "ms", 3),
        row("Σ activations saved", *_pm(t["activation_mib"]), "MiB"),
    ]


def _pm(figure: dict[str, float]) -> tuple[float, float]:
    return figure["predicted"], figure["measured"]


def run_lines(title: str, got: dict[str, Any]) -> list[str]:
    """A run's figures (:func:`run_table`, with its errors added here), one per line."""
    for part in (got["step_ms"], *(s[k] for s in got["stages"] for k in s if k != "stage")):
        part["error"] = rel_error(part["predicted"], part["measured"])
    lines = [
        f"{title}: {got['steps_trained']}/{got['steps_asked']} steps trained, "
        f"last loss {got['last_loss']:.4f}",
        row("step", *_pm(got["step_ms"]), "ms"),
    ]
    for s in got["stages"]:
        i = s["stage"]
        lines += [
            row(f"stage {i} forward (per micro-batch)", *_pm(s["fwd_ms"]), "ms"),
            row(f"stage {i} backward (per micro-batch)", *_pm(s["bwd_ms"]), "ms"),
            row(f"stage {i} peak memory", *_pm(s["mem_mib"]), "MiB", 1),
        ]
    return lines


def step_lines(status: list[str], wall: int) -> tuple[dict[str, Any], list[str]]:
    """The steps' record and its two lines, from "name=status:seconds" ("0": ran fine;
    "skipped", or an exit status).

    >>> step_lines(["a-device=0:2", "d-run-pp1=124:90"], 95)[1][1]
    'failed: d-run-pp1; wall 95 s so far'
    """
    steps = {}
    for s in status:
        name, _, got = s.partition("=")
        code, _, took = got.partition(":")
        steps[name] = {"status": code, "s": int(took)}
    failed = [k for k, v in steps.items() if v["status"] != "0"]
    return steps, [
        "steps: "
        + ", ".join(
            f"{k} {'ok' if v['status'] == '0' else v['status']} ({v['s']} s)"
            for k, v in steps.items()
        ),
        f"failed: {', '.join(failed) if failed else 'none'}; wall {wall} s so far",
    ]


def plain(x: Any) -> Any:
    """Strict JSON: a figure not measured (NaN) is null.

    >>> plain({"a": [1.0, float("nan")]})
    {'a': [1.0, None]}
    """
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    return [plain(v) for v in x] if isinstance(x, list) else x


def summarize(
    *, mode: str, where: str, scratch: Path, out_path: Path, wall: int, status: list[str]
) -> None:
    """Print the summary from the files steps (b) and (d) left in ``scratch``
    (``profile-compare.json``, ``d-run-pp1.txt``, ``d-run-pp2.txt``), and write it to
    ``out_path``."""
    print(ERROR_CONVENTION + " (−: slower or larger than predicted)")
    record: dict[str, Any] = {"mode": mode, "measured_on": where, "runs": {}, "profile": None}
    compare = scratch / "profile-compare.json"
    if compare.exists():
        record["profile"] = json.loads(compare.read_text())
        print("\n".join(profile_lines(record["profile"])))
    else:
        print("profile: no comparison (step b failed or was skipped)")
    runs = {
        "pp1": (scratch / "d-run-pp1.txt", f"run pp 1 on {where}, 1 process"),
        "pp2": (scratch / "d-run-pp2.txt", "run pp 2 on cpu, 2 processes (gloo)"),
    }
    for key, (path, title) in runs.items():
        got = run_table(path.read_text()) if path.exists() else None
        if got is None or got["step_ms"] is None:
            print(
                f"{title}: no predicted-vs-measured table (step d-run-{key} failed or was skipped)"
            )
            continue
        print("\n".join(run_lines(title, got)))
        record["runs"][key] = got
    record["steps"], lines = step_lines(status, wall)
    record["wall_s"] = wall
    print("\n".join(lines))
    out_path.write_text(json.dumps(plain(record), indent=1) + "\n")
    print(f"summary written to {out_path}")
