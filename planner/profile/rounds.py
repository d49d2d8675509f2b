"""Timed rounds summarised: every block's median, and the split check from per-round totals.

Pure numbers (no torch): :func:`summarise` turns the readings of the timed
rounds (:class:`RoundTimes`) and each round's machine load into the figures a
profile keeps ([Note: the split check]).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from planner.plan.records import MIN_QUIET_ROUNDS, SplitCheck

__all__ = [
    "QUIET_SHARE",
    "Measured",
    "RoundTimes",
    "block_sums",
    "kept_rounds",
    "net_ms",
    "split_charge",
    "split_check",
    "summarise",
]

QUIET_SHARE = 0.10
"""A timed round is quiet when other processes kept under this share of the cores busy."""


@dataclass
class RoundTimes:
    """Every timed round's readings (ms), round ``r`` at index ``r`` of each list.

    ``fwd[k][r]`` / ``bwd[k][r]``: block ``k`` alone; ``whole_f`` / ``whole_b``:
    the whole captured graph, unsplit; ``loss_f`` / ``loss_b``: the loss on its output
    (empty without a loss).
    """

    fwd: list[list[float]]
    bwd: list[list[float]]
    whole_f: list[float] = field(default_factory=list)
    whole_b: list[float] = field(default_factory=list)
    loss_f: list[float] = field(default_factory=list)
    loss_b: list[float] = field(default_factory=list)

    @classmethod
    def empty(cls, blocks: int) -> RoundTimes:
        return cls(fwd=[[] for _ in range(blocks)], bwd=[[] for _ in range(blocks)])


@dataclass(frozen=True)
class Measured:
    """The medians of the kept rounds (ms), how many were kept, a note on the load, the check."""

    fwd_ms: list[float]
    bwd_ms: list[float]
    loss_ms: tuple[float, float]
    whole_ms: tuple[float, float]
    repeats: int
    load_note: str | None
    check: SplitCheck


def kept_rounds(shares: Sequence[float]) -> list[int]:
    """Indices of the rounds to keep: the quiet ones, else the least loaded half.

    ``shares[r]``: the share of the cores other processes kept busy in round ``r``.

    >>> kept_rounds([0.5, 0.0, 0.02, 0.0, 0.6])
    [1, 2, 3]
    >>> kept_rounds([0.5, 0.3, 0.9, 0.4])
    [1, 3]
    """
    quiet = [i for i, x in enumerate(shares) if x < QUIET_SHARE]
    if len(quiet) >= min(MIN_QUIET_ROUNDS, len(shares)):
        return quiet
    order = sorted(range(len(shares)), key=lambda i: shares[i])
    return sorted(order[: max(1, len(order) // 2)])


def net_ms(measured: float, overhead: float) -> float:
    """A block's time less the timing harness's own cost (never below 10 % of the reading)."""
    return max(measured - overhead, 0.1 * measured)


def summarise(times: RoundTimes, shares: Sequence[float], harness: tuple[float, float]) -> Measured:
    """The profile's figures from the timed rounds.

    Example::

        m = summarise(times, load.shares, _harness_overhead())
        m.fwd_ms[0], m.check.error

    Args:
        times: every timed round's readings.
        shares: per round, the share of the cores other processes kept busy.
        harness: the timing harness's own forward and backward cost per block
            (ms), taken off every block's reading.

    Returns:
        Per block, the median of the kept rounds ([Note: quiet rounds]); the
        whole model's and the loss's medians; and the split check.
    """
    assert len(shares) == len(times.whole_f), "one load share per timed round"
    use = kept_rounds(shares)

    def med(xs: list[float]) -> float:
        return statistics.median(xs[i] for i in use)

    hf, hb = harness
    sums = block_sums(times, use, harness)
    check = split_check(times, shares, use, sums)
    cf, cb = split_charge(times, use, sums) if check.judged else (0.0, 0.0)
    loss = (med(times.loss_f), med(times.loss_b)) if times.loss_f else (0.0, 0.0)
    return Measured(
        fwd_ms=[net_ms(med(x), hf + cf) for x in times.fwd],
        bwd_ms=[net_ms(med(x), hb + cb) for x in times.bwd],
        loss_ms=loss,
        whole_ms=(med(times.whole_f), med(times.whole_b)),
        repeats=len(use),
        load_note=_load_note(check),
        check=replace(check, charge_ms=cf + cb),
    )


def block_sums(
    times: RoundTimes, use: list[int], harness: tuple[float, float]
) -> tuple[list[float], list[float]]:
    """Per kept round (in the order of ``use``), Σ over blocks of forward and of backward,
    each less the timing harness's cost (:func:`net_ms`)."""
    hf, hb = harness
    fwd = [sum(net_ms(x[r], hf) for x in times.fwd) for r in use]
    bwd = [sum(net_ms(x[r], hb) for x in times.bwd) for r in use]
    return fwd, bwd


def split_charge(
    times: RoundTimes, use: list[int], sums: tuple[list[float], list[float]]
) -> tuple[float, float]:
    """Forward and backward ms a block timed alone pays that the unsplit graph does not.

    [Note: split charge] Timed alone, every block pays a module call and an
    ``autograd.grad`` of its own; the harness overhead ([Note: harness
    overhead]) takes off what an empty block pays, but a real block's call
    costs more (its inputs, parameters and outputs are validated, gathered and
    returned one by one): 15-25 µs a block here, +13-24 % on the zoo's small
    transformers (blocks of 0.1-0.3 ms), which over-priced their pipelines by
    as much. A stage runs its blocks as one graph and pays that once. So
    the excess of Σ blocks over the whole graph, each total's fastest kept
    round as in the split check, forward and backward apart, is shared
    equally among the blocks and taken off each, when positive and the rounds
    were quiet enough to judge. A block is never priced below 10 % of its
    reading.
    """
    n = len(times.fwd)
    if not n or not use:
        return 0.0, 0.0

    def excess(split: list[float], whole: list[float]) -> float:
        return max(0.0, min(split) - min(whole[r] for r in use)) / n

    return excess(sums[0], times.whole_f), excess(sums[1], times.whole_b)


def split_check(
    times: RoundTimes,
    shares: Sequence[float],
    use: list[int],
    sums: tuple[list[float], list[float]],
) -> SplitCheck:
    """Σ blocks against the whole graph, like with like: each total's fastest kept round.

    [Note: the split check] Each timed round runs every block alone, then the
    whole captured graph and the loss. A round's two totals (Σ blocks + loss; whole +
    the same loss) are the same work done split and unsplit. Summing the
    blocks' medians instead and setting that against the whole model's median
    is biased on a busy machine: another process only ever adds time, a short
    block's median dodges the slow rounds, and the one long whole-model run is
    hit in most of them (hf_llama under load: Σ of block medians 20.4 ms
    against 55.4 ms for the median round's Σ; the check said −35.8 %). Both
    totals are therefore summarised alike, by the fastest kept round of each:
    the least disturbed reading of the same work. The medians stay the
    per-block figures (a cost is what a block takes as a rule, not at best).
    The blocks and the whole graph both run as generated code, as the
    runtime's stages do.
    """
    loss = [f + b for f, b in zip(times.loss_f, times.loss_b, strict=True)] or [0.0] * len(
        times.whole_f
    )
    blocks = [f + b + loss[r] for f, b, r in zip(*sums, use, strict=True)]
    whole = [times.whole_f[r] + times.whole_b[r] + loss[r] for r in use]
    return SplitCheck(
        blocks_ms=min(blocks),
        whole_ms=min(whole),
        rounds=len(shares),
        kept=len(use),
        quiet=sum(x < QUIET_SHARE for x in shares),
        load_share=statistics.median(shares) if shares else 0.0,
    )


def _load_note(check: SplitCheck) -> str | None:
    if check.quiet == check.rounds:
        return None
    return (
        f"{check.quiet} of {check.rounds} timed rounds were quiet (other processes "
        f"under {QUIET_SHARE:.0%} of the cores, no slow spell); the times are medians of "
        f"{check.kept}"
    )
