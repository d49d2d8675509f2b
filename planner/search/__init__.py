"""The search over pipeline depth, data-parallel width, micro-batches and schedule.

``configurations`` (what is considered, laid on the ranks, bounded),
``partition`` (a layout's cost model as the solvers' problems: the step's and
the closed form's), ``loop`` (:func:`search`, and :func:`~planner.search.loop.place`
for one layout), ``ranking`` (the candidates a plan records), ``baselines``
(the partitioners people use today), ``messages`` (warnings, and why nothing
was possible or fit).

Pure: no torch.
"""

from __future__ import annotations

from planner.search.configurations import ProfileFor, configurations, layouts
from planner.search.loop import SearchResult, search
from planner.search.partition import partition_problem

__all__ = ["ProfileFor", "SearchResult", "configurations", "layouts", "partition_problem", "search"]
