"""Terminal rendering of a ``ModelProfile``: the per-block table, tied sets and the check line."""

from __future__ import annotations

from rich.console import Console

from planner.plan.fold import Col
from planner.plan.records import ModelProfile, SplitCheck
from planner.report.content import Row
from planner.report.terminal import print_table

__all__ = ["CHECK_TOLERANCE", "check_line", "print_profile"]

CHECK_TOLERANCE = 0.10
"""The largest |Σ blocks − whole| / whole we accept before warning."""

_MB = 1e6


def check_line(prof: ModelProfile) -> str:
    """One line comparing Σ blocks (+ loss) with the whole unsplit model.

    A profile timed round by round carries a :class:`SplitCheck` ([Note: the
    split check]): it is judged only when enough rounds were quiet, since on a
    busy machine neither total says what the model costs.
    """
    if prof.split_check is not None:
        return _judged(prof.split_check)
    total = prof.blocks_step_ms
    whole = prof.whole_step_ms
    if whole is None:
        return (
            f"check: Σ blocks fwd+bwd + loss = {total:.2f} ms "
            f"(analytic for {prof.device}; no whole-model measurement)"
        )
    whole_with_loss = whole + prof.loss_fwd_ms + prof.loss_bwd_ms
    err = (total - whole_with_loss) / whole_with_loss if whole_with_loss else 0.0
    return (
        f"check: Σ blocks fwd+bwd + loss = {total:.2f} ms vs whole model "
        f"{whole_with_loss:.2f} ms: {err:+.1%} ({_verdict(err)} ±{CHECK_TOLERANCE:.0%})"
    )


def _judged(check: SplitCheck) -> str:
    figures = (
        f"Σ blocks fwd+bwd + loss = {check.blocks_ms:.2f} ms vs whole model "
        f"{check.whole_ms:.2f} ms: {check.error:+.1%}"
    )
    if not check.judged:
        return (
            f"check: not judged: machine busy ({check.quiet} of {check.rounds} timed rounds "
            f"quiet, others kept {check.load_share:.0%} of the cores busy); {figures}, "
            f"least loaded of {check.kept} rounds each"
        )
    charge = ""
    if check.charge_ms > 0:
        charge = (
            f"; {check.charge_ms * 1e3:.0f} µs a block that a stage does not pay "
            "taken off every block"
        )
    return (
        f"check: {figures} ({_verdict(check.error)} ±{CHECK_TOLERANCE:.0%}; blocks as timed, "
        f"fastest of {check.kept} quiet rounds each{charge})"
    )


def _verdict(err: float) -> str:
    return "within" if abs(err) <= CHECK_TOLERANCE else "OUTSIDE"


# Which columns a narrow terminal hides first (higher: earlier; 0: the last to go).
_COLS = [
    Col("#", right=True, drop=4),
    Col("block (split point)"),
    Col("fwd ms", right=True),
    Col("bwd ms", right=True),
    Col("params MB", right=True, drop=1),
    Col("activations MB", right=True, drop=1),
    Col("boundary MB", right=True, drop=2),
    Col("GFLOP fwd", right=True, drop=3),
]


def print_profile(prof: ModelProfile, *, title: str = "", console: Console | None = None) -> None:
    """Print the per-block table (folded to the console's width), the tied-parameter sets,
    notes and the check line.

    Example::

        print_profile(profile_model(model, (x,)), title="model.py · micro-batch 8")
    """
    console = console or Console()
    caption = (
        f"{prof.source} on {prof.device}, micro-batch {prof.batch_size}, {prof.dtype}, "
        + (f"{prof.threads} threads, median of {prof.repeats}" if prof.threads else "roofline")
        + f", captured with {prof.capture}"
    )
    rows: list[Row] = []
    for b in prof.blocks:
        cells = [
            str(b.index),
            b.name or "<input>",
            f"{b.fwd_ms:.3f}",
            f"{b.bwd_ms:.3f}",
            f"{b.param_bytes / _MB:.2f}",
            f"{b.activation_bytes / _MB:.2f}",
            f"{b.boundary_bytes / _MB:.3f}",
            f"{b.fwd_flops / 1e9:.3f}",
        ]
        rows.append((cells, ""))
    if prof.loss_fwd_ms or prof.loss_bwd_ms:
        loss = ["", "(loss)", f"{prof.loss_fwd_ms:.3f}", f"{prof.loss_bwd_ms:.3f}", "", "", "", ""]
        rows.append((loss, ""))
    total = [
        "",
        f"total ({len(prof.blocks)} blocks)",
        f"{sum(b.fwd_ms for b in prof.blocks) + prof.loss_fwd_ms:.2f}",
        f"{sum(b.bwd_ms for b in prof.blocks) + prof.loss_bwd_ms:.2f}",
        f"{prof.param_bytes / _MB:.2f}",
        f"{sum(b.activation_bytes for b in prof.blocks) / _MB:.2f}",
        "",
        f"{sum(b.fwd_flops for b in prof.blocks) / 1e9:.2f}",
    ]
    rows.append((total, ""))
    print_table(console, title, _COLS, rows, caption, where="`planner profile --json`")
    if prof.tied:
        for t in prof.tied:
            console.print(
                f"tied: {' = '.join(t.names)} ({t.nbytes / _MB:.2f} MB), "
                f"used by blocks {', '.join(map(str, t.blocks))}"
            )
    else:
        console.print("tied: none")
    for note in prof.notes:
        console.print(f"note: {note}", markup=False)
    console.print(check_line(prof), markup=False)
