"""ZeRO-1's shares: which replica of a stage owns each of its parameter tensors.

One rule for both sides of the contract: the runtime (``runtime.zero``) gives
each tensor to the replica this names, and the cost model prices a replica's
optimizer state and step from the same assignment ([Note: ZeRO-1 shares] in
``planner.cost.basis``).

Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["owners", "share_loads"]


def owners(sizes: Sequence[float], replicas: int) -> list[int]:
    """The replica owning each tensor: largest first, each to the replica holding the
    fewest bytes so far (ties: the earlier tensor, the lower replica), so none holds
    more than ``Σ sizes / replicas + (1 − 1/replicas) · max(sizes)``.

    >>> owners([4, 1, 3, 2], 2)
    [0, 0, 1, 1]
    """
    if replicas < 1:
        raise ValueError(f"replicas must be ≥ 1, got {replicas}")
    load = [0.0] * replicas
    out = [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        r = min(range(replicas), key=lambda r: (load[r], r))
        out[k] = r
        load[r] += sizes[k]
    return out


def share_loads(sizes: Sequence[float], replicas: int) -> list[float]:
    """The bytes each replica owns under :func:`owners` (equal sizes are interchangeable,
    so their order does not change the loads).

    >>> share_loads([4, 1, 3, 2], 2)
    [5.0, 5.0]
    """
    load = [0.0] * replicas
    for k, r in enumerate(owners(sizes, replicas)):
        load[r] += sizes[k]
    return load
