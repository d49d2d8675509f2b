"""Rendering of a plan: the terminal report, a self-contained HTML page and a Chrome trace.

Everything here needs only the :class:`~planner.plan.Plan`, so ``planner show
plan.yaml`` renders a saved plan as ``planner plan`` rendered the fresh one.
The pipeline timeline is re-simulated from the plan's own per-stage figures
(:func:`timeline`). Pure: no torch.

The parts: ``terminal`` (:func:`print_plan`), ``html`` (:func:`write_html`),
``trace`` (:func:`trace_events`, :func:`write_trace`); ``_content`` holds what
they all show, ``_format`` how figures are written.
"""

from __future__ import annotations

from planner.report._content import timeline
from planner.report.html import write_html
from planner.report.terminal import print_plan
from planner.report.trace import trace_events, write_trace

__all__ = ["print_plan", "timeline", "trace_events", "write_html", "write_trace"]
