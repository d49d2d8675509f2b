"""One training step as a graph of timed nodes: what the simulator runs and the solver prices.

[Note: the step graph] A step of a schedule (:mod:`planner.plan.schedule`) is
a directed acyclic graph. Its nodes are the stages' actions (``F3`` / ``B3``
on stage s; a split backward's ``I3`` and ``W3``), the transfers between
neighbouring stages on different ranks (``send_F`` on link s → s+1, ``send_B``
on link s → s−1) and each stage's tail (the tied weights' exchange and the
optimizer step). An edge u → v says v starts after u ends:

* a rank runs its actions in the schedule's order (one at a time), torch's
  order (one stage per rank unless the schedule runs ``virtual`` > 1);
* a forward needs the previous stage's forward of that micro-batch, sent over
  the link (on the same rank: nothing to send); a backward (``B``, or the
  input part ``I``) needs the next stage's, sent back (the last stage: its
  own forward); a weight part ``W`` needs its stage's ``I``;
* a link between two ranks carries one transfer at a time, in the order the
  sender sends (forward and backward transfers alike);
* a rank's tails follow its last action, one stage after another, and
  every stage's last backward: the runtime agrees on the loss and the
  gradient norm over the pipeline before any optimizer steps ([Note: the
  step's agreement] in :mod:`planner.cost.agreement`), which also covers the
  stages that exchange tied weights' gradients in their tails.

Each node's duration is a sum of *figures* of one stage or link, named as in
:class:`~planner.plan.sections.StepInputs`: ``fwd`` / ``bwd`` (compute, which
runs at the machine's speed of the moment: [Note: shared cores] in
:mod:`planner.cost.simulate`), ``reduce`` (DDP's all-reduce inside a stage's
last backward), ``link_fwd`` / ``link_bwd``, ``tail``. With every speed 1 the
step is the longest path through the graph, a max of sums of figures: the
solver minimises exactly that (:mod:`planner.solve.step`).

Imports no torch (each rank's order is torch's, through
:func:`planner.plan.schedule.rank_actions`).
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

from planner.plan.schedule import rank_actions, stage_ranks

__all__ = ["FIGURES", "Node", "StepGraph", "step_graph"]

FIGURES = ("fwd", "bwd", "reduce", "tail", "link_fwd", "link_bwd")
"""The figures a node's duration is made of: per stage the first four, per link the last two."""


@dataclass(frozen=True)
class Node:
    """One timed node of a step.

    Attributes:
        kind: "F", "B", "I", "W" (a split backward's input and weight parts),
            "send_F", "send_B" or "tail".
        stage: the stage it runs on (a send: the sending stage).
        micro_batch: the micro-batch (-1 for a tail).
        preds: the nodes it waits for (indices into :attr:`StepGraph.nodes`).
        compute: the figure computed at the machine's speed ("fwd", "bwd") or "".
        fixed: figures that take their full time after the compute, as
            (figure, stage or link) pairs: the last backward's ("reduce", s),
            a send's ("link_fwd", s) or ("link_bwd", s − 1), a tail's ("tail", s).
        part: of a split backward, "input" or "weight": the share of ``bwd`` it
            computes (``weight_share``); "" for the whole figure.
    """

    kind: str
    stage: int
    micro_batch: int
    preds: tuple[int, ...]
    compute: str
    fixed: tuple[tuple[str, int], ...]
    part: str = ""


@dataclass(frozen=True)
class StepGraph:
    """The nodes of one step in topological order, and where each stage ends.

    Attributes:
        nodes: every node; each one's ``preds`` come before it.
        last: per stage, its last backward (the one that all-reduces).
        tails: per stage, its tail node; the step ends when the last tail does.
        ranks: per stage, the rank it runs on (one per stage unless ``virtual`` > 1).
    """

    schedule: str
    n_stages: int
    micro_batches: int
    nodes: tuple[Node, ...]
    last: tuple[int, ...]
    tails: tuple[int, ...]
    ranks: tuple[int, ...] = ()


Key = tuple[str, int, int]  # (kind, stage, micro-batch)


@functools.lru_cache(maxsize=64)
def step_graph(schedule: str, n_stages: int, micro_batches: int, virtual: int = 1) -> StepGraph:
    """The graph of one step of ``schedule`` over ``n_stages`` stages, ``virtual`` per
    rank (see [Note: the step graph]).

    Example::

        g = step_graph("gpipe", 2, 2)
        [n.kind + str(n.micro_batch) for n in g.nodes][:3]   # ['F0', 'F1', 'send_F0']
    """
    p, m = n_stages, micro_batches
    if p % virtual:
        raise ValueError(f"{p} stages do not divide into ranks of {virtual}")
    actions = rank_actions(schedule, p // virtual, m, virtual)
    on = stage_ranks(schedule, p // virtual, virtual)
    grad = {(a.stage, a.micro_batch): a.kind for r in actions for a in r if a.kind in "BI"}
    keys: list[Key] = []
    preds: dict[Key, list[Key]] = {}
    last: dict[int, Key] = {}  # per stage, its last B or W
    sent: dict[tuple[int, int], Key] = {}  # per directed rank link, its last transfer

    def send(kind: str, me: Key, to: int) -> None:
        key, link = (kind, me[1], me[2]), (on[me[1]], on[to])
        keys.append(key)
        preds[key] = [me] + ([sent[link]] if link in sent else [])
        sent[link] = key

    for rank, acts in enumerate(actions):
        for t, a in enumerate(acts):
            kind, s, k = a
            me = (kind, s, k)
            keys.append(me)
            need = [tuple(acts[t - 1])] if t else []
            if kind == "F" and s > 0:
                need.append(("send_F", s - 1, k) if on[s - 1] != rank else ("F", s - 1, k))
            elif kind in "BI" and s < p - 1:
                nxt = (grad[(s + 1, k)], s + 1, k)
                need.append(("send_B", s + 1, k) if on[s + 1] != rank else nxt)
            elif kind in "BI":
                need.append(("F", s, k))
            elif kind == "W":
                need.append(("I", s, k))
            preds[me] = need  # type: ignore[assignment]
            if kind == "F" and s < p - 1 and on[s + 1] != rank:  # its activation goes to s + 1
                send("send_F", me, s + 1)
            elif kind in "BI" and s > 0 and on[s - 1] != rank:  # its gradient goes back to s − 1
                send("send_B", me, s - 1)
            if kind in "BW":
                last[s] = me
        prev: Key = tuple(acts[-1])  # type: ignore[assignment]
        for s in (s for s in range(p) if on[s] == rank):  # a rank's tails, one after another
            keys.append(("tail", s, -1))
            preds[("tail", s, -1)] = [prev]
            prev = ("tail", s, -1)
    for s in range(p):  # [Note: the step's agreement]: after every stage's last backward
        tail = preds[("tail", s, -1)]
        tail += [last[g] for g in range(p) if last[g] not in tail]
    order = _topological(keys, preds)
    # Tails last: nothing but a rank's next tail follows one, so the order stays
    # topological.
    order = [key for key in order if key[0] != "tail"] + [key for key in order if key[0] == "tail"]
    index = {key: i for i, key in enumerate(order)}
    reduce_at = set(last.values())
    nodes = tuple(
        _node(key, tuple(dict.fromkeys(index[q] for q in preds[key])), key in reduce_at)
        for key in order
    )
    last_of = tuple(index[last[s]] for s in range(p))
    tails = tuple(index[("tail", s, -1)] for s in range(p))
    return StepGraph(schedule, p, m, nodes, last_of, tails, on)


_PART = {"I": "input", "W": "weight"}


def _node(key: Key, preds: tuple[int, ...], reduces: bool) -> Node:
    kind, s, k = key
    if kind == "F":
        return Node(kind, s, k, preds, "fwd", ())
    if kind in "BIW":
        return Node(
            kind, s, k, preds, "bwd", (("reduce", s),) if reduces else (), _PART.get(kind, "")
        )
    if kind == "send_F":
        return Node(kind, s, k, preds, "", (("link_fwd", s),))
    if kind == "send_B":
        return Node(kind, s, k, preds, "", (("link_bwd", s - 1),))
    return Node(kind, s, k, preds, "", (("tail", s),))


def _topological(keys: list[Key], preds: dict[Key, list[Key]]) -> list[Key]:
    """Kahn's order, ties in creation order (stage by stage), so it is deterministic."""
    waiting = {key: len(preds[key]) for key in keys}
    after: dict[Key, list[Key]] = {key: [] for key in keys}
    for key in keys:
        for q in preds[key]:
            after[q].append(key)
    rank = {key: i for i, key in enumerate(keys)}
    heap = [(rank[key], key) for key in keys if waiting[key] == 0]
    heapq.heapify(heap)
    out: list[Key] = []
    while heap:
        _, key = heapq.heappop(heap)
        out.append(key)
        for nxt in after[key]:
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                heapq.heappush(heap, (rank[nxt], nxt))
    if len(out) != len(keys):
        raise AssertionError(f"the step graph has a cycle ({len(keys) - len(out)} nodes left)")
    return out
