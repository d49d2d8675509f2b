"""One training step as a graph of timed nodes: what the simulator runs and the solver prices.

[Note: the step graph] A step of a schedule (:mod:`planner.plan.schedule`) is
a directed acyclic graph. Its nodes are the stages' actions (``F3`` / ``B3``
on stage s), the transfers between neighbouring stages (``send_F`` on link
s → s+1, ``send_B`` on link s → s−1) and each stage's tail (the tied
weights' exchange and the optimizer step). An edge u → v says v starts after
u ends:

* a stage runs its actions in the schedule's order (one at a time);
* a forward needs the previous stage's forward of that micro-batch, sent over
  the link; a backward needs the next stage's backward, sent back (the last
  stage: its own forward);
* a link carries one transfer at a time, in the order the sender sends;
* a stage's tail follows its last backward. Stages that all-reduce tied
  weights together (``join``) start their tails together, after every
  member's last backward: those edges depend on the placement and are added
  when the graph is run.

Each node's duration is a sum of *figures* of one stage or link, named as in
:class:`~planner.plan.sections.StepInputs`: ``fwd`` / ``bwd`` (compute, which
runs at the machine's speed of the moment: [Note: shared cores] in
:mod:`planner.cost.simulate`), ``reduce`` (DDP's all-reduce inside a stage's
last backward), ``link_fwd`` / ``link_bwd``, ``tail``. With every speed 1 the
step is the longest path through the graph, a max of sums of figures: the
solver minimises exactly that (:mod:`planner.solve.step`).

Pure: no torch.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

from planner.plan.schedule import schedule_actions

__all__ = ["FIGURES", "Node", "StepGraph", "step_graph"]

FIGURES = ("fwd", "bwd", "reduce", "tail", "link_fwd", "link_bwd")
"""The figures a node's duration is made of: per stage the first four, per link the last two."""


@dataclass(frozen=True)
class Node:
    """One timed node of a step.

    Attributes:
        kind: "F", "B", "send_F", "send_B" or "tail".
        stage: the stage it runs on (a send: the sending stage).
        micro_batch: the micro-batch (-1 for a tail).
        preds: the nodes it waits for (indices into :attr:`StepGraph.nodes`).
        compute: the figure computed at the machine's speed ("fwd", "bwd") or "".
        fixed: figures that take their full time after the compute, as
            (figure, stage or link) pairs: the last backward's ("reduce", s),
            a send's ("link_fwd", s) or ("link_bwd", s − 1), a tail's ("tail", s).
    """

    kind: str
    stage: int
    micro_batch: int
    preds: tuple[int, ...]
    compute: str
    fixed: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class StepGraph:
    """The nodes of one step in topological order, and where each stage ends.

    Attributes:
        nodes: every node; each one's ``preds`` come before it.
        last: per stage, its last action (the one that all-reduces, then the tail).
        tails: per stage, its tail node; the step ends when the last tail does.
    """

    schedule: str
    n_stages: int
    micro_batches: int
    nodes: tuple[Node, ...]
    last: tuple[int, ...]
    tails: tuple[int, ...]


@functools.lru_cache(maxsize=64)
def step_graph(schedule: str, n_stages: int, micro_batches: int) -> StepGraph:
    """The graph of one step of ``schedule`` (see [Note: the step graph]).

    Example::

        g = step_graph("gpipe", 2, 2)
        [n.kind + str(n.micro_batch) for n in g.nodes][:3]   # ['F0', 'F1', 'send_F0']
    """
    p, m = n_stages, micro_batches
    actions = schedule_actions(schedule, p, m)
    keys: list[tuple[str, int, int]] = []  # (kind, stage, micro-batch) per node
    preds: dict[tuple[str, int, int], list[tuple[str, int, int]]] = {}
    for s, acts in enumerate(actions):
        prev_f: tuple[str, int, int] | None = None
        prev_b: tuple[str, int, int] | None = None
        for t, act in enumerate(acts):
            kind, k = act[0], int(act[1:])
            me = (kind, s, k)
            keys.append(me)
            need = [(acts[t - 1][0], s, int(acts[t - 1][1:]))] if t else []
            if kind == "F" and s > 0:
                need.append(("send_F", s - 1, k))
            elif kind == "B" and s < p - 1:
                need.append(("send_B", s + 1, k))
            elif kind == "B":
                need.append(("F", s, k))
            preds[me] = need
            if kind == "F" and s < p - 1:  # its activation goes to s + 1, after the last one
                send = ("send_F", s, k)
                keys.append(send)
                preds[send] = [me] + ([prev_f] if prev_f else [])
                prev_f = send
            elif kind == "B" and s > 0:  # its gradient goes back to s − 1
                send = ("send_B", s, k)
                keys.append(send)
                preds[send] = [me] + ([prev_b] if prev_b else [])
                prev_b = send
        tail = ("tail", s, -1)
        keys.append(tail)
        last = acts[-1]
        preds[tail] = [(last[0], s, int(last[1:]))]
    order = _topological(keys, preds)
    index = {key: i for i, key in enumerate(order)}
    nodes = tuple(
        _node(key, tuple(dict.fromkeys(index[q] for q in preds[key])), actions, p) for key in order
    )
    last_of = tuple(index[(a[-1][0], s, int(a[-1][1:]))] for s, a in enumerate(actions))
    tails = tuple(index[("tail", s, -1)] for s in range(p))
    return StepGraph(schedule, p, m, nodes, last_of, tails)


def _node(
    key: tuple[str, int, int], preds: tuple[int, ...], actions: list[list[str]], p: int
) -> Node:
    kind, s, k = key
    if kind == "F":
        return Node(kind, s, k, preds, "fwd", ())
    if kind == "B":
        last = actions[s][-1] == f"B{k}"
        return Node(kind, s, k, preds, "bwd", (("reduce", s),) if last else ())
    if kind == "send_F":
        return Node(kind, s, k, preds, "", (("link_fwd", s),))
    if kind == "send_B":
        return Node(kind, s, k, preds, "", (("link_bwd", s - 1),))
    return Node(kind, s, k, preds, "", (("tail", s),))


def _topological(
    keys: list[tuple[str, int, int]], preds: dict[tuple[str, int, int], list[tuple[str, int, int]]]
) -> list[tuple[str, int, int]]:
    """Kahn's order, ties in creation order (stage by stage), so it is deterministic."""
    waiting = {key: len(preds[key]) for key in keys}
    after: dict[tuple[str, int, int], list[tuple[str, int, int]]] = {key: [] for key in keys}
    for key in keys:
        for q in preds[key]:
            after[q].append(key)
    rank = {key: i for i, key in enumerate(keys)}
    heap = [(rank[key], key) for key in keys if waiting[key] == 0]
    heapq.heapify(heap)
    out: list[tuple[str, int, int]] = []
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
