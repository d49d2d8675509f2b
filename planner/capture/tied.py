"""Tied parameters: one tensor under several names, found by identity, and the blocks using it."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["param_identity", "tied_sets"]


def param_identity(model: nn.Module) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Canonical name of every parameter/buffer name, and all names of each canonical one."""
    owner: dict[str, str] = {}
    aliases: dict[str, list[str]] = {}
    first: dict[int, str] = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    )
    for name, tensor in named:
        canon = first.setdefault(id(tensor), name)
        owner[name] = canon
        aliases.setdefault(canon, []).append(name)
    return owner, aliases


def tied_sets(
    block_params: Sequence[Sequence[str]],
    owner: dict[str, str],
    aliases: dict[str, list[str]],
) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """Every tensor with several names, and the blocks that use it (by index, ascending).

    Args:
        block_params: per block, the attribute targets it reads.
        owner, aliases: from :func:`param_identity`.
    """
    users: dict[str, set[int]] = {}
    for index, params in enumerate(block_params):
        for target in params:
            canon = owner.get(target, target)
            users.setdefault(canon, set()).add(index)
    tied = []
    for canon, names in aliases.items():
        if len(names) > 1:
            tied.append((tuple(names), tuple(sorted(users.get(canon, set())))))
    return tied
