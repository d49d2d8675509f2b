"""Per-block cost: forward and backward time, parameters, activations, at any micro-batch size.

``profiler`` (:func:`profile_model`: pick the blocks, assemble the records),
``runner`` (one block alone), ``timing`` (the timed rounds), ``analytic``
(FLOPs and bytes priced on a catalogue device), ``ownership`` (what each block
owns and keeps), ``state`` (the model left as found), ``sizes`` (any
micro-batch size from one or two profiled ones).
"""

from __future__ import annotations

from planner.profile.profiler import profile_model
from planner.profile.sizes import SizedProfiles, at_batch_size
from planner.profile.timing import Progress

__all__ = ["Progress", "SizedProfiles", "at_batch_size", "profile_model"]
