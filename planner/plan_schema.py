"""The plan file's schema, and the checks of a plan's data: types, version, consistency."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from planner.plan import PLAN_VERSION, SUPPORTED_VERSIONS, Plan, PlanError

Spec = Any  # a type, a tuple of types, a dict (mapping schema), or a list [item spec]


def _opt(spec: Spec) -> tuple[str, Spec]:
    return ("optional", spec)


_NUM = (int, float)
_STAGE = {
    "index": int,
    "split_point": str,
    "blocks": [int],
    "modules": [str],
    "ranks": [int],
    "device": str,
    "recompute": bool,
    "fwd_ms": _NUM,
    "bwd_ms": _NUM,
    "send_ms": _NUM,
    "sync_ms": _NUM,
    "memory": {"*": _NUM},
}
_SCHEMA: dict[str, Spec] = {
    "version": int,
    "model": {"fingerprint": str, "*": object},
    "cluster": {"*": object},
    "training": {
        "global_batch": int,
        "micro_batches": int,
        "micro_batch_size": int,
        "optimizer": str,
        "precision": str,
        "schedule": str,
    },
    "layout": {"pp": int, "dp": int},
    "stages": [_STAGE],
    "predicted": {"step_ms": _NUM, "*": _NUM},
    "solver": {
        "name": str,
        "status": str,
        "gap": _opt(_NUM),
        "bound_ms": _opt(_NUM),
        "time_limit_s": _opt(_NUM),
        "n_segments": int,
        "note": _opt(str),
    },
    "candidates": _opt(
        [
            {
                "pp": int,
                "dp": int,
                "micro_batches": int,
                "schedule": str,
                "step_ms": _opt(_NUM),
                "status": str,
                "reason": str,
            }
        ]
    ),
    "warnings": _opt([str]),
    "parameter_shapes": _opt({"*": [int]}),
    "profiles": _opt([{"*": object}]),
}


# Version 1 also recorded the solve's wall time (see [Note: reproducible plan files]).
_SCHEMA_V1: dict[str, Spec] = {**_SCHEMA, "solver": {**_SCHEMA["solver"], "solve_s": _NUM}}
_SCHEMAS: dict[int, dict[str, Spec]] = {1: _SCHEMA_V1, PLAN_VERSION: _SCHEMA}
assert set(_SCHEMAS) == set(SUPPORTED_VERSIONS)


def schema(version: int) -> dict[str, Spec]:
    """The schema of a supported plan format version."""
    return _SCHEMAS[version]


def _type_name(spec: Spec) -> str:
    if isinstance(spec, tuple) and spec and spec[0] == "optional":
        return f"{_type_name(spec[1])} or null"
    if isinstance(spec, dict):
        return "a mapping"
    if isinstance(spec, list):
        return f"a list of {_type_name(spec[0])}"
    if spec is _NUM:
        return "a number"
    if isinstance(spec, type):
        return {int: "an integer", str: "a string", bool: "true/false", object: "any value"}.get(
            spec, spec.__name__
        )
    return str(spec)


def _check(value: Any, spec: Spec, path: str) -> None:
    if isinstance(spec, tuple) and spec and spec[0] == "optional":
        if value is None:
            return
        spec = spec[1]
    if isinstance(spec, dict):
        if not isinstance(value, Mapping):
            raise PlanError(f"{path}: expected {_type_name(spec)}, got {_show(value)}")
        for key, sub in spec.items():
            if key == "*":
                continue
            optional = isinstance(sub, tuple) and sub and sub[0] == "optional"
            if key not in value:
                if optional:
                    continue
                raise PlanError(f"{path}.{key}: missing (expected {_type_name(sub)})")
            _check(value[key], sub, f"{path}.{key}")
        if "*" in spec:
            for key, item in value.items():
                if key not in spec:
                    _check(item, spec["*"], f"{path}.{key}")
        else:
            unknown = sorted(str(k) for k in value if k not in spec)
            if unknown:
                raise PlanError(
                    f"{path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(spec)}"
                )
        return
    if isinstance(spec, list):
        if not isinstance(value, list):
            raise PlanError(f"{path}: expected {_type_name(spec)}, got {_show(value)}")
        for k, item in enumerate(value):
            _check(item, spec[0], f"{path}[{k}]")
        return
    ok = isinstance(value, spec) if spec is not object else True
    # bool is an int in Python; a plan's integers and numbers must not be booleans.
    if ok and isinstance(value, bool) and spec is not bool:
        ok = False
    if not ok:
        raise PlanError(f"{path}: expected {_type_name(spec)}, got {_show(value)}")


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}"


def _check_version(data: Mapping[str, Any], path: str) -> None:
    version = data.get("version")
    # bool is an int in Python: `version: true` is not version 1.
    if isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
        *older, newest = map(str, SUPPORTED_VERSIONS)
        supported = f"versions {', '.join(older)} and {newest}" if older else f"version {newest}"
        found = "no version" if "version" not in data else f"version {version!r}"
        raise PlanError(
            f"{path}.version: plan format {found} is not supported (this planner reads "
            f"{supported}; it writes version {PLAN_VERSION}).\n"
            "  fix: regenerate the plan with `planner plan`, or use the planner version that "
            "wrote it"
        )


def _check_consistent(plan: Plan, path: str) -> None:
    """Cross-field rules the schema alone cannot state."""
    err: Callable[[str], PlanError] = lambda msg: PlanError(f"{path}: {msg}")  # noqa: E731
    if plan.pp < 1 or plan.dp < 1:
        raise err(f"layout.pp and layout.dp must be ≥ 1 (got {plan.pp}, {plan.dp})")
    if len(plan.stages) != plan.pp:
        raise err(f"layout.pp is {plan.pp} but stages lists {len(plan.stages)} stages")
    if plan.global_batch != plan.dp * plan.micro_batches * plan.micro_batch_size:
        raise err(
            f"training.global_batch {plan.global_batch} ≠ dp × micro_batches × "
            f"micro_batch_size = {plan.dp} × {plan.micro_batches} × {plan.micro_batch_size}"
        )
    seen: set[int] = set()
    prev_end = 0
    for k, st in enumerate(plan.stages):
        where = f"stages[{k}]"
        if st.index != k:
            raise err(f"{where}.index is {st.index}, expected {k}")
        if len(st.ranks) != plan.dp:
            raise err(f"{where}.ranks has {len(st.ranks)} ranks, expected dp = {plan.dp}")
        if st.blocks[0] != prev_end or st.blocks[1] <= st.blocks[0]:
            raise err(
                f"{where}.blocks {list(st.blocks)} must start at {prev_end} (where the previous "
                "stage ends) and hold at least one block"
            )
        prev_end = st.blocks[1]
        if k > 0 and not st.split_point:
            raise err(f"{where}.split_point is empty; every stage after the first needs one")
        dup = seen & set(st.ranks)
        if dup:
            raise err(f"{where}.ranks reuses rank(s) {sorted(dup)} already used by another stage")
        seen |= set(st.ranks)
    if seen != set(range(plan.world_size)):
        raise err(
            f"the stages' ranks must be exactly 0..{plan.world_size - 1} "
            f"(pp × dp = {plan.pp} × {plan.dp}); got {sorted(seen)}"
        )
    if plan.profiles and prev_end != len(plan.profiles[0].blocks):
        raise err(
            f"the stages cover blocks 0..{prev_end - 1} but the profile has "
            f"{len(plan.profiles[0].blocks)} blocks"
        )
