"""Robust choices: the sturdiest configuration within the cost model's error of the fastest.

[Note: robust band] The cost model is not exact: on the accuracy benchmark its
predicted step is off by a median |error| of 8.0 % (README, "Cost-model
accuracy"). Two configurations predicted 0.7 % apart are not told apart by it,
and the faster-predicted one may be the one with 16 stages and a 67 % bubble.
So the search does not keep the fastest blindly. With band β
(``SearchOptions.robust_band_pct``, default 8) and T* the fastest predicted
step, every configuration (pp, dp, m, schedule) solved with a step
T ≤ T* · (1 + β) is a rival, and the sturdiest rival is kept, by:

1. fewer pipeline stages (fewer transfers, a smaller bubble, fewer stages to
   mispredict);
2. a smaller overhead share ``1 − Σ_s busy_s / (pp · T)``: the part of the
   devices' step outside forward and backward (the bubble, exposed transfers
   and all-reduce, the optimizer step), compared in whole percent;
3. more memory headroom: the free share of the tightest device, in whole
   percent;
4. the faster predicted step.

A configuration stands for its fastest layout on the ranks (and thread
count). The search bounds and solves every configuration that could fall
within the band (its ceiling is T* · (1 + β), not T*) and could be chosen:
one that is neither faster than the fastest solved (its lower bound is above
T*) nor sturdier, on what is known before solving (pp, then v, then the dp
mode), than a solved rival that stays within the band of any fastest to come
(its step ≤ F · (1 + β), F the least lower bound of all configurations: no
step is below it) can be neither the fastest nor the one kept, and is pruned
unsolved (:func:`outranked`). On 10,000 single-device nodes, where the
all-reduce makes 47 configurations lie within 1.1 % of each other, that
solves 4 instead of 47. Pins are kept: every rival has the pinned pp, dp, m
and schedule, and with all four pinned there is nothing to choose. β = 0 keeps the fastest.

Claims stay exact: a configuration kept over a faster one is never called
optimal; the plan's ``choice`` section names the fastest, its step and what
is proven of it (:class:`~planner.plan.choice.ChoiceRecord`).

Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.cost.basis import Layout
from planner.cost.model import Prediction
from planner.options import SearchOptions
from planner.plan.choice import ChoiceRecord, FastestRecord
from planner.plan.schedule import SCHEDULES
from planner.plan.sections import DP_MODE_NAMES
from planner.solve.step_problem import StepSolution

__all__ = [
    "PINS",
    "Sturdiness",
    "Verdict",
    "choose",
    "explain",
    "outranked",
    "proof_text",
    "pruned_against",
    "record",
    "row_reason",
    "sturdiness",
]

PINS = ("pp", "dp", "micro_batches", "schedule", "virtual")
"""The configuration's parts a user can pin (``SearchOptions`` fields of these names)."""


_DP_STURDINESS = ("ddp", "zero1", "fsdp")
"""The dp modes, sturdiest first. DDP: every replica holds and steps everything, one
all-reduce inside the last backward, nothing else to exchange. ZeRO-1 then: the same
gradients and whole weights on every replica (its checkpoints load into its DDP twin), one
more exchange after the step, the weights' broadcast. FSDP last: the weights are whole
only from the stage's first forward to its last backward, two collectives a step priced
with an approximation (its all-gather in the tail: [Note: FSDP as it runs] in
planner.cost.basis), and its memory rests on torch's FSDP hooks freeing the whole
weights and gradients where priced."""


@dataclass(frozen=True, kw_only=True)
class Sturdiness:
    """What the choice weighs of one solved candidate ([Note: robust band]).

    Attributes:
        pp, dp, micro_batches, schedule, virtual, dp_mode: its configuration.
        step_ms: its predicted step.
        overhead: the share of the devices' step outside forward and backward.
        headroom: the free share of memory on its tightest device (1: unbounded).
        bubble: its pipeline bubble (``Prediction.bubble_fraction``), for people.
    """

    pp: int
    dp: int
    micro_batches: int
    schedule: str
    step_ms: float
    overhead: float = 0.0
    headroom: float = 1.0
    bubble: float = 0.0
    virtual: int = 1
    dp_mode: str = "ddp"

    @property
    def config(self) -> tuple[int, int, int, str, int, str]:
        return (self.pp, self.dp, self.micro_batches, self.schedule, self.virtual, self.dp_mode)

    def key(self) -> tuple[object, ...]:
        """The sturdiest first: fewer devices per pipeline, fewer stages on each (v), DDP
        before ZeRO-1 before FSDP (``_DP_STURDINESS``), less overhead, more headroom,
        faster."""
        return (
            *_prior(self.pp, self.virtual, self.dp_mode),
            round(self.overhead, 2),
            -round(self.headroom, 2),
            self.step_ms,
            self.dp,
            self.micro_batches,
            self.schedule,
        )

    def name(self) -> str:
        """ "pp 2 × dp 8, m 64, 1f1b" """
        v = f" v {self.virtual}" if self.virtual > 1 else ""
        v += f", {DP_MODE_NAMES[self.dp_mode]}" if self.dp_mode != "ddp" else ""
        return f"pp {self.pp} × dp {self.dp}, m {self.micro_batches}, {self.schedule}{v}"


def sturdiness(layout: Layout, prediction: Prediction) -> Sturdiness:
    """The figures :func:`choose` weighs, of a solved layout's predicted step."""
    tl, step = prediction.timeline, prediction.step_ms
    busy = sum(tl.busy_ms(s) for s in range(layout.n_stages))  # stages' computes, all ranks
    overhead = 1.0 - busy / (layout.pp * step) if step > 0 else 0.0
    free = [
        1.0 - st.memory.total / st.capacity
        for st in prediction.stages
        if 0 < st.capacity < math.inf
    ]
    return Sturdiness(
        pp=layout.pp,
        dp=layout.dp,
        micro_batches=layout.micro_batches,
        schedule=layout.schedule,
        virtual=layout.virtual,
        dp_mode=layout.dp_mode,
        step_ms=step,
        overhead=max(0.0, overhead),
        headroom=min(free, default=1.0),
        bubble=prediction.bubble_fraction,
    )


@dataclass(frozen=True)
class Verdict:
    """The choice: indices into the candidates given, and the rivals' count.

    ``rivals``: the other configurations within the band of the fastest;
    ``pinned``: every part of the configuration was pinned (nothing to choose).
    """

    chosen: int
    fastest: int
    rivals: int
    band_pct: float
    pinned: bool = False


def choose(found: Sequence[Sturdiness], options: SearchOptions) -> Verdict:
    """The sturdiest configuration within ``options.robust_band_pct`` of the fastest.

    Example::

        v = choose([Sturdiness(pp=16, dp=1, micro_batches=32, schedule="1f1b", step_ms=18.0),
                    Sturdiness(pp=2, dp=8, micro_batches=64, schedule="1f1b", step_ms=18.12)],
                   SearchOptions())
        v.chosen, v.fastest                  # 1, 0: +0.7 % is within the 8 % band

    Candidates that contradict a pin are never chosen (the search makes none).
    """
    kept = [k for k, f in enumerate(found) if _keeps_pins(f, options)]
    assert kept, "no candidate keeps the pins"
    fastest = min(kept, key=lambda k: (found[k].step_ms, found[k].key()))
    band = options.robust_band_pct
    pinned = _all_pinned(options)
    if pinned:
        return Verdict(fastest, fastest, 0, band, pinned=True)
    ceiling = found[fastest].step_ms * (1 + band / 100)
    best: dict[tuple[int, int, int, str, int, str], int] = {}  # a configuration: its fastest
    for k in kept:
        f = found[k]
        if f.step_ms <= ceiling:
            held = best.get(f.config)
            if held is None or (f.step_ms, f.key()) < (found[held].step_ms, found[held].key()):
                best[f.config] = k
    chosen = min(best.values(), key=lambda k: found[k].key())
    return Verdict(chosen, fastest, len(best) - 1, band)


def outranked(
    config: tuple[int, int, str],
    bound_ms: float,
    solved: Sequence[Sturdiness],
    floor_ms: float,
    options: SearchOptions,
) -> str | None:
    """Why a configuration not yet solved cannot be the fastest nor the one kept, whatever
    its step ([Note: robust band]); None when it might be.

    ``config``: its pp, v and dp mode (what is known of its sturdiness unsolved);
    ``bound_ms``: a lower bound on its step; ``solved``: the configurations solved so far;
    ``floor_ms``: a lower bound on every configuration's step (the least of their bounds),
    so the fastest to come is no faster.
    """
    if not solved or _all_pinned(options):
        return None
    fastest = min(f.step_ms for f in solved)
    if not bound_ms > fastest:  # it may be the fastest
        return None
    ceiling = min(fastest, floor_ms) * (1 + options.robust_band_pct / 100)
    pp, v, mode = config
    rivals = [
        f
        for f in solved
        if f.step_ms <= ceiling and _prior(f.pp, f.virtual, f.dp_mode) < _prior(pp, v, mode)
    ]
    if not rivals:
        return None
    r = min(rivals, key=lambda f: (f.key(), f.step_ms))
    return (
        f"cannot be chosen: lower bound {bound_ms:.1f} ms > the fastest {fastest:.1f} ms, "
        f"and {r.name()} ({r.step_ms:.1f} ms; {_sturdier(r, pp, v, mode)}) stays within "
        f"the ±{options.robust_band_pct:g} % band of any fastest (none below {floor_ms:.1f} ms)"
    )


def _prior(pp: int, virtual: int, dp_mode: str) -> tuple[int, int, int]:
    """The part of :meth:`Sturdiness.key` known before solving: its first items."""
    return (pp, virtual, _DP_STURDINESS.index(dp_mode))


def _sturdier(r: Sturdiness, pp: int, virtual: int, dp_mode: str) -> str:
    """ "1 stage instead of 4", "DDP instead of ZeRO-1": how ``r`` is sturdier than a
    configuration of ``pp``, ``virtual``, ``dp_mode``."""
    if (r.pp, r.virtual) != (pp, virtual):
        c = Sturdiness(pp=pp, dp=1, micro_batches=1, schedule="", step_ms=0.0, virtual=virtual)
        return _depths(r, c)
    return f"{DP_MODE_NAMES[r.dp_mode]} instead of {DP_MODE_NAMES[dp_mode]}"


def _all_pinned(options: SearchOptions) -> bool:
    """pp, dp, m and the schedule pinned, and v by a pin or the schedule: nothing to choose."""
    return all(getattr(options, p) is not None for p in PINS[:4]) and (
        options.virtual is not None or options.schedule in SCHEDULES  # v 1 by the schedule
    )


def _keeps_pins(f: Sturdiness, options: SearchOptions) -> bool:
    pins = all(getattr(options, p) in (None, getattr(f, p)) for p in PINS)
    return pins and (f.dp_mode in options.dp_modes or f.dp == 1)


def record(
    verdict: Verdict, chosen: Sturdiness, fastest: Sturdiness, proof: StepSolution
) -> ChoiceRecord:
    """The plan's ``choice`` section: the band, and the fastest when ``chosen`` is not it.

    ``proof``: the fastest configuration's solution (what is proven of its step).
    """
    band = verdict.band_pct
    if chosen.config == fastest.config or chosen.step_ms <= fastest.step_ms:
        return ChoiceRecord(band_pct=band, reason=_why_fastest(verdict))
    quick = FastestRecord(
        pp=fastest.pp,
        dp=fastest.dp,
        micro_batches=fastest.micro_batches,
        schedule=fastest.schedule,
        virtual=fastest.virtual,
        dp_mode=fastest.dp_mode,
        step_ms=fastest.step_ms,
        bubble_fraction=fastest.bubble,
        status=proof.status,
        gap=proof.gap,
        bound_ms=proof.bound,
    )
    return ChoiceRecord(band_pct=band, fastest=quick, reason=explain(chosen, fastest, band, proof))


def _why_fastest(v: Verdict) -> str:
    if v.pinned:
        return (
            "the fastest predicted step: pp, dp, micro-batches, schedule and stages per rank "
            "are pinned"
        )
    if v.band_pct == 0:
        return "the fastest predicted step (robust band 0: the fastest is kept)"
    if not v.rivals:
        return (
            f"the fastest predicted step; no other configuration within its ±{v.band_pct:g} % "
            "band (the cost model's error)"
        )
    many = f"{v.rivals} other configurations" if v.rivals > 1 else "1 other configuration"
    return (
        f"the fastest predicted step, and the sturdiest of it and the {many} solved within "
        f"its ±{v.band_pct:g} % band (the cost model's error)"
    )


def proof_text(sol: StepSolution) -> str:
    """What is proven of a configuration's step, in words ("proven optimal for ...")."""
    gap = "unknown" if sol.gap is None else f"{100 * sol.gap:.1f} %"
    if sol.status == "optimal":
        return "proven optimal for that configuration"
    if sol.status == "bounded":
        return f"within {gap} of optimal for that configuration"
    return f"the best found in the time limit for that configuration, gap {gap}"


def explain(chosen: Sturdiness, fastest: Sturdiness, band_pct: float, proof: StepSolution) -> str:
    """Why ``chosen`` was kept over the faster ``fastest``, with the numbers.

    Example: "pp 2 × dp 8, m 64, 1f1b chosen over pp 16 × dp 1, m 32, 1f1b (18.00 ms,
    proven optimal for that configuration): 18.12 ms, +0.7 % predicted, within the ±8 %
    band of the cost model's measured error; 2 stages instead of 16, bubble 6 % instead
    of 67 %".
    """
    more = (chosen.step_ms - fastest.step_ms) / fastest.step_ms
    head = (
        f"{chosen.name()} chosen over {fastest.name()} ({fastest.step_ms:.2f} ms, "
        f"{proof_text(proof)}): {chosen.step_ms:.2f} ms, {100 * more:+.1f} % predicted, within "
        f"the ±{band_pct:g} % band of the cost model's error; "
    )
    if (chosen.pp, chosen.virtual) != (fastest.pp, fastest.virtual):
        why = _depths(chosen, fastest)
    elif round(chosen.overhead, 2) != round(fastest.overhead, 2):
        why = (
            f"overhead (bubble, exposed communication, optimizer step) {_pct(chosen.overhead)} "
            f"of the step instead of {_pct(fastest.overhead)}"
        )
    else:
        why = (
            f"{_pct(chosen.headroom)} of memory free on the tightest device instead of "
            f"{_pct(fastest.headroom)}"
        )
    return f"{head}{why}, bubble {_pct(chosen.bubble)} instead of {_pct(fastest.bubble)}"


def row_reason(chosen: Sturdiness, fastest: Sturdiness, options: SearchOptions) -> str:
    """The chosen candidate row's reason when it is not the fastest (no claim of optimality)."""
    more = (chosen.step_ms - fastest.step_ms) / fastest.step_ms
    return (
        f"the sturdiest within the ±{options.robust_band_pct:g} % band of the fastest "
        f"({fastest.step_ms:.1f} ms, {more:+.1%}): {_depths(chosen, fastest)}, "
        f"bubble {_pct(chosen.bubble)} instead of {_pct(fastest.bubble)}"
    )


def pruned_against(best_ms: float, options: SearchOptions) -> str:
    """ "best 18.0 ms", or with a band "best 18.0 ms + 8 % band": what the search prunes
    against (a configuration within the band of the best may still be chosen)."""
    band = options.robust_band_pct
    return f"best {best_ms:.1f} ms" + (f" + {band:g} % band" if band else "")


def _stages(n: int) -> str:
    return f"{n} stage{'s' if n != 1 else ''}"


def _depths(chosen: Sturdiness, fastest: Sturdiness) -> str:
    """ "2 stages instead of 16", or with several stages per rank "4 stages instead of 8
    stages on 4 ranks"."""
    if chosen.virtual == fastest.virtual == 1:
        return f"{_stages(chosen.pp)} instead of {fastest.pp}"

    def depth(x: Sturdiness) -> str:
        n = _stages(x.pp * x.virtual)
        return n if x.virtual == 1 else f"{n} on {x.pp} ranks"

    return f"{depth(chosen)} instead of {depth(fastest)}"


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"
