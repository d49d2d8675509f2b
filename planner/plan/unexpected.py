"""Errors nobody raised on purpose, explained: the phase, the module, the original error, a fix.

The planner's own errors are ``ValueError``s that already say what, why and
how to fix. Anything else that reaches the command line (a ``RuntimeError``
from a model's ops, ``MemoryError``, ``RecursionError``, a bug of ours) is
named here, never swallowed: :func:`explain` keeps the original type and
message, says which phase raised it (read from the traceback), which block or
module was running (the notes :func:`add_where` attached on the way up), and
what to try. ``planner -v`` still prints the original traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from planner.plan.modelimport import model_frame

__all__ = ["add_where", "explain", "phase_of", "where_notes"]

_NOTE = "planner: while "
# The planner's folders, innermost first in a traceback, and the phase each one is.
_PHASES = (
    ("plan/modelfile.py", "calling the model file"),
    ("capture", "capturing the model as a graph"),
    ("profile", "profiling the model's blocks"),
    ("search", "searching the placements"),
    ("solve", "searching the placements (the ILP)"),
    ("cost", "searching the placements (the cost model)"),
    ("devices", "reading the devices"),
    ("report", "writing the report"),
)
_PLANNER = str(Path(__file__).resolve().parents[1])
_OUT_OF_MEMORY = ("DefaultCPUAllocator", "out of memory", "not enough memory", "std::bad_alloc")


def add_where(exc: BaseException, what: str) -> None:
    """Note on ``exc`` what was running when it was raised (``"running block 2 'fc'..."``).

    Kept on the exception itself (``__notes__``, which Python's traceback prints),
    so its type and message are unchanged for every caller.
    """
    notes = list(getattr(exc, "__notes__", None) or [])
    if f"{_NOTE}{what}" not in notes:
        notes.append(f"{_NOTE}{what}")
        exc.__notes__ = notes


def where_notes(exc: BaseException) -> list[str]:
    """What :func:`add_where` noted on ``exc``, innermost first."""
    notes = getattr(exc, "__notes__", None) or []
    return [n.removeprefix(_NOTE) for n in notes if isinstance(n, str) and n.startswith(_NOTE)]


def phase_of(exc: BaseException) -> str:
    """The phase of the planner's innermost frame in ``exc``'s traceback ("planning": none)."""
    phase = "planning"
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        name = frame.f_code.co_filename
        if not name.startswith(_PLANNER):
            continue
        rel = name[len(_PLANNER) + 1 :]
        phase = next((p for folder, p in _PHASES if rel.startswith(folder)), phase)
    return phase


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def explain(exc: BaseException, model_file: str | None = None) -> str:
    """The message for ``exc``: what (phase, module, original type and message), why, fix.

    >>> try:
    ...     raise RecursionError("maximum recursion depth exceeded")
    ... except RecursionError as e:
    ...     print(explain(e).splitlines()[0])
    planning raised RecursionError: maximum recursion depth exceeded
    """
    said = str(exc).strip() or "(no message)"
    lines = [f"{phase_of(exc)} raised {type(exc).__name__}: {said}"]
    notes = where_notes(exc)
    user = model_frame(exc, model_file)
    if notes:
        lines.append(f"  where: {'; in '.join(notes)}")
    if user:
        lines.append(f"  where: the model file, {user}")
    ran_model = any(n.startswith("running ") for n in notes)  # the runner's notes
    why, fix = _why_fix(exc, said, model_code=bool(ran_model or user))
    lines += [f"  why: {why}", f"  fix: {fix}"]
    return "\n".join(lines)


def _why_fix(exc: BaseException, said: str, *, model_code: bool) -> tuple[str, str]:
    if isinstance(exc, MemoryError) or any(s in said for s in _OUT_OF_MEMORY):
        gib = _memory_gib()
        here = f" ({gib:.1f} GiB here)" if gib else ""
        return (
            f"this machine ran out of memory{here}: a measured profile runs the model for "
            "real on one micro-batch, with its parameters, activations and gradients",
            "plan analytically for a catalogue device (--device-type h100, say: shapes only, "
            "nothing is allocated), or lower the micro-batch (a smaller --global-batch, or "
            "more --micro-batches), or free memory",
        )
    if isinstance(exc, RecursionError):
        return (
            f"Python's recursion limit is {sys.getrecursionlimit()} frames; a very deeply "
            "nested model (or a forward that calls itself) goes past it",
            "nest the modules less deeply (an nn.ModuleList of layers rather than each layer "
            "holding the next), or raise the limit at the top of the model file "
            "(`sys.setrecursionlimit(20_000)`)",
        )
    if model_code:
        fix = (
            "fix the model so that a training step runs: `loss_fn(model(*inputs), "
            "targets).backward()` on sample_batch reproduces it (`planner -v` prints the "
            "whole traceback)"
        )
        if "in-place operation" in said:
            fix += "; change a parameter or a leaf in place only under torch.no_grad(), or "
            fix += "compute a new tensor instead (`w = w * 2`, not `w.mul_(2)`)"
        return "the model's own code or ops raised it, as a training step would", fix
    return (
        "the planner does not expect this error here: most likely a bug in the planner "
        "(or in torch), not in the model",
        "run again with -v for the original traceback, and report it with the model file "
        "and the command line",
    )
