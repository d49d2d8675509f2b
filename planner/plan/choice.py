"""How the plan's configuration was chosen: the cost model's error band, and the fastest one.

The search does not simply keep the fastest predicted configuration: among those
predicted within ``band_pct`` of it, it keeps the sturdiest ([Note: robust band] in
:mod:`planner.search.robust`). :class:`ChoiceRecord` says which band was used and,
when the plan's configuration is not the fastest, which one was, what is proven of
it, and why it lost. A plan without the record (written before it existed) was the
fastest its search found.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.plan.codec import FIGURE, Record

__all__ = ["ChoiceRecord", "FastestRecord"]


@dataclass(frozen=True, kw_only=True)
class FastestRecord(Record):
    """The fastest configuration the search solved, when the plan chose another.

    Attributes:
        pp, dp, micro_batches, schedule, virtual, dp_mode: its configuration.
        step_ms: its predicted step.
        bubble_fraction: its pipeline bubble (as ``Predicted.bubble_fraction``).
        status: what is proven of ``step_ms`` over every contiguous placement of
            *its* configuration, as ``SolverRecord.status``: "optimal", "bounded"
            or "time_limit".
        gap, bound_ms: as ``SolverRecord``'s, for its configuration.
    """

    pp: int
    dp: int
    micro_batches: int
    schedule: str
    step_ms: float = field(metadata=FIGURE)
    bubble_fraction: float = field(metadata=FIGURE)
    status: str
    gap: float | None = field(default=None, metadata=FIGURE)
    bound_ms: float | None = None  # not rounded: a lower bound must stay ≤ the step it bounds
    virtual: int = 1
    dp_mode: str = "ddp"


@dataclass(frozen=True, kw_only=True)
class ChoiceRecord(Record):
    """Why this configuration: the band within which a sturdier one beats the fastest.

    Attributes:
        band_pct: the band, in percent of the fastest predicted step
            (``SearchOptions.robust_band_pct``; 0: the fastest always wins).
        fastest: the fastest configuration, when the plan's is not it (None:
            the plan's configuration is the fastest).
        reason: the choice in words.
    """

    band_pct: float
    fastest: FastestRecord | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.band_pct < 100:
            raise ValueError(f"band_pct must be in [0, 100) percent, got {self.band_pct!r}")

    def interval(self, step_ms: float) -> tuple[float, float]:
        """``step_ms × (1 ± band)``: what the cost model's error allows the step to be."""
        band = self.band_pct / 100
        return step_ms * (1 - band), step_ms * (1 + band)
