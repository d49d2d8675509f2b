"""Rendering of a plan: the terminal report, a self-contained HTML page and a Chrome trace.

Everything here needs only the :class:`~planner.plan.schema.Plan`, so ``planner
show plan.yaml`` renders a saved plan as ``planner plan`` rendered the fresh
one, and every report replays the plan's own step (:func:`timeline`). Pure:
no torch.

The parts: ``terminal`` (:func:`print_plan`), ``html`` (:func:`write_html`),
``trace`` (:func:`trace_events`, :func:`write_trace`); ``content`` holds what
they all show, ``format`` how figures are written; ``profile_table`` renders a
profile, ``progress`` the progress bar.
"""

from __future__ import annotations

from planner.report.content import timeline
from planner.report.html import write_html
from planner.report.terminal import print_plan
from planner.report.trace import trace_events, write_trace

__all__ = ["print_plan", "timeline", "trace_events", "write_html", "write_trace"]
