"""From a model (or a model file) and a cluster to a Plan: profile, search, solve, assemble.

This is the one function behind ``planner plan`` and ``planner.plan_model``:
the CLI parses its flags into the same ``PlanOptions``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from planner import cache as _cache
from planner.capture import CaptureError
from planner.cluster import Cluster, from_gpus
from planner.cost import Training
from planner.plan import Plan, SolverRecord, StagePlan
from planner.profile import ProfileOptions, Progress, profile_model
from planner.records import ModelProfile
from planner.scaling import at_batch_size
from planner.search import SearchOptions, SearchResult, configurations, search
from planner.solve import check_solver

__all__ = ["PlanOptions", "plan_model"]

log = logging.getLogger(__name__)

Sampler = Callable[[int], tuple[tuple[Any, ...], dict[str, Any], Any]]
"""sampler(batch_size) -> (args, kwargs, targets) of one micro-batch."""


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Everything ``planner plan`` takes besides the model.

    Attributes:
        training: global batch, optimizer, precision, memory headroom.
        search: pins (pp, dp, micro-batches, schedule), solver and time limit.
        profile: repeats, warm-up, granularity (``target_blocks``), cache.
    """

    training: Training
    search: SearchOptions = field(default_factory=SearchOptions)
    profile: ProfileOptions = field(default_factory=ProfileOptions)


def plan_model(
    model: nn.Module,
    sample: Sampler | tuple[Any, Any],
    *,
    cluster: Cluster | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    options: PlanOptions | None = None,
    global_batch: int | None = None,
    model_file: str | None = None,
    progress: Progress | None = None,
) -> Plan:
    """Plan ``model`` on ``cluster``.

    Example::

        plan = plan_model(model, (inputs, targets), cluster=from_gpus(8, "h100"),
                          loss_fn=F.cross_entropy)
        print(plan.pp, plan.dp, plan.split_points, plan.predicted["step_ms"])

    Args:
        model: the model (left unchanged).
        sample: a function ``batch_size -> (args, kwargs, targets)``, or one
            global batch ``(inputs, targets)`` (inputs: a tensor, tuple or
            dict), sliced into micro-batches along dimension 0.
        cluster: the devices (default: 8 local devices, see ``from_gpus``).
        loss_fn: the loss (its cost lands on the last stage).
        options: see ``PlanOptions``; default: the sample's batch, Adam, fp32.
        global_batch: the batch per step when ``options`` is not given
            (default: the sample's batch size).
        model_file: recorded in the plan, for people.
        progress: progress callback.

    Raises:
        ValueError: no configuration is possible or fits (the message says why,
            with the numbers, and what to change); the model cannot be captured.
        SolverUnavailable: the ILP solver is not installed (before any profiling).

    Profiles measured on the way enter the on-disk cache only when planning
    succeeds (see :func:`planner.cache.deferred`).
    """
    cluster = cluster or from_gpus(8)
    sampler, sample_batch = _sampler(sample)
    if options is None:
        batch = global_batch or sample_batch
        if batch is None:
            raise ValueError("give global_batch (or options) when sample is a function")
        options = PlanOptions(training=Training(global_batch=batch))
    training = options.training
    check_solver(options.search.solver)  # fail before minutes of profiling, not after
    with _cache.deferred():
        profiles = _Profiles(model, sampler, loss_fn, cluster, training, options, progress)
        base = profiles.first()
        names = [b.name for b in base.blocks]
        try:
            result = search(
                profiles.get,
                cluster,
                training,
                options.search,
                n_blocks=len(base.blocks),
                block_names=names,
            )
        except ValueError as exc:
            _explain_excluded(exc, base)
            raise
        return _assemble(result, base, cluster, training, options, profiles, model, model_file)


def _explain_excluded(exc: ValueError, base: ModelProfile) -> None:
    """Add the split points that were excluded (and why) to a search failure's message."""
    prefix = "excluded split point "
    excluded = [n.removeprefix(prefix) for n in base.notes if n.startswith(prefix)]
    if not excluded:
        return
    shown = "\n".join(f"    {e}" for e in excluded[:8])
    more = f"\n    (+{len(excluded) - 8} more)" if len(excluded) > 8 else ""
    exc.args = (
        f"{exc}\n"
        f"  {len(excluded)} candidate split point(s) were excluded, so the model has only "
        f"{len(base.blocks)} block(s) that can start a stage:\n{shown}{more}\n"
        "  A stage can only receive tensors: make the module before such a point return "
        "tensors (index a tuple or list before the next module call, pass numbers as "
        "tensors or configuration), so that the point becomes legal.",
        *exc.args[1:],
    )


# --------------------------------------------------------------------------- samples


def _sampler(sample: Sampler | tuple[Any, Any]) -> tuple[Sampler, int | None]:
    if callable(sample):
        return sample, None
    inputs, targets = sample
    from planner.modelfile import normalize_inputs

    args, kwargs = normalize_inputs(inputs)
    leaves = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if _batched(t)]
    if not leaves:
        raise ValueError("the sample has no tensor with a batch dimension")
    full = int(leaves[0].shape[0])

    def take(b: int) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        if b > full:
            raise ValueError(f"micro-batch {b} is larger than the sample's batch {full}")

        def cut(t: Any) -> Any:
            return t[:b] if _batched(t) and t.shape[0] == full else t

        a, k, y = torch.utils._pytree.tree_map(cut, (args, kwargs, targets))
        return a, k, y

    return take, full


def _batched(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0


# --------------------------------------------------------------------------- profiles


class _Profiles:
    """Profiles per (device type, micro-batch size): two measured anchors, the rest scaled.

    All profiles share the chain of the first one (same split points), so the
    blocks mean the same thing at every size and on every device.
    """

    def __init__(
        self,
        model: nn.Module,
        sampler: Sampler,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        cluster: Cluster,
        training: Training,
        options: PlanOptions,
        progress: Progress | None,
    ) -> None:
        self.model = model
        self.sampler = sampler
        self.loss_fn = loss_fn
        self.cluster = cluster
        self.training = training
        self.options = options
        self.progress = progress
        self.sizes = _micro_batch_sizes(cluster, training, options.search)
        self.anchors: dict[str, list[ModelProfile]] = {}
        self.split_points: tuple[str, ...] | None = options.profile.split_points
        self.cache: dict[tuple[str, int], ModelProfile] = {}

    def _profile(self, device: str, b: int) -> ModelProfile:
        args, kwargs, targets = self.sampler(b)
        base = self.options.profile
        local = self.cluster.devices[0].device.kind == "cpu" and device == "cpu"
        threads = self.cluster.devices[0].threads if local else None
        opts = ProfileOptions(
            device="local" if local or device == "cpu" else device,
            dtype=None if local or device == "cpu" else _analytic_dtype(self.training),
            repeats=base.repeats,
            warmup=base.warmup,
            threads=threads or base.threads,
            target_blocks=base.target_blocks,
            cache=base.cache,
            split_points=self.split_points,
        )
        try:
            prof = profile_model(
                self.model,
                args,
                kwargs,
                targets=targets,
                loss_fn=self.loss_fn,
                options=opts,
                progress=self.progress,
            )
        except CaptureError as exc:
            if b == max(self.sizes):
                raise
            raise self._too_small(b, exc) from exc
        if self.split_points is None:
            self.split_points = tuple(b.name for b in prof.blocks)
        return prof

    def _too_small(self, b: int, exc: CaptureError) -> ValueError:
        """The model runs at the largest micro-batch but not at ``b`` (e.g. BatchNorm1d at 1)."""
        batch = self.training.global_batch
        least = min(size for size in self.sizes if size > b)
        m = max(k for k in range(1, batch + 1) if batch % k == 0 and batch // k >= least)
        cause = exc.__cause__ or exc
        return ValueError(
            f"the model does not run on a micro-batch of {b} sample(s): "
            f"{type(cause).__name__}: {str(cause).strip().splitlines()[0]}\n"
            f"  why: the search tries every micro-batch count m that divides the batch, so "
            f"micro-batches of {batch} / (dp × m) = {', '.join(map(str, self.sizes))} "
            f"samples; the model runs on {max(self.sizes)}, not on {b}.\n"
            f"  fix: pin --micro-batches (and --dp) so that each micro-batch holds at least "
            f"{least} samples, e.g. --dp 1 --micro-batches {m}; or "
            "make the model run on smaller batches (e.g. LayerNorm or GroupNorm instead of "
            "BatchNorm1d)"
        )

    def first(self) -> ModelProfile:
        device = self.cluster.device_types[0]
        return self.get(device, max(self.sizes))

    def anchor_sizes(self) -> list[int]:
        lo, hi = min(self.sizes), max(self.sizes)
        return [hi] if lo == hi else [hi, lo]

    def get(self, device: str, b: int) -> ModelProfile:
        if (device, b) in self.cache:
            return self.cache[(device, b)]
        if device not in self.anchors:
            self.anchors[device] = [self._profile(device, a) for a in self.anchor_sizes()]
        prof = at_batch_size(self.anchors[device], b)
        self.cache[(device, b)] = prof
        return prof

    def all_anchors(self) -> list[ModelProfile]:
        return [p for key in sorted(self.anchors) for p in self.anchors[key]]


def _analytic_dtype(training: Training) -> str | None:
    return "bf16" if training.precision == "bf16-mixed" else None


def _micro_batch_sizes(cluster: Cluster, training: Training, opts: SearchOptions) -> list[int]:
    """Every micro-batch size the search may need (raises when no configuration is possible)."""
    configs = configurations(cluster, training, opts)
    return sorted({training.global_batch // (dp * m) for _, dp, m, _ in configs})


# --------------------------------------------------------------------------- the plan


def _assemble(
    result: SearchResult,
    base: ModelProfile,
    cluster: Cluster,
    training: Training,
    options: PlanOptions,
    profiles: _Profiles,
    model: nn.Module,
    model_file: str | None,
) -> Plan:
    lay, sol, pred = result.layout, result.solution, result.prediction
    prof = result.cost.profile
    stages = []
    for sp in pred.stages:
        i, j = sp.blocks
        modules: list[str] = []
        for blk in prof.blocks[i:j]:
            modules.extend(blk.modules)
        stages.append(
            StagePlan(
                index=sp.index,
                split_point=prof.blocks[i].name if sp.index else "",
                blocks=(i, j),
                modules=tuple(modules),
                ranks=lay.ranks[sp.index],
                device=sp.device,
                recompute=sp.recompute,
                fwd_ms=sp.fwd_ms,
                bwd_ms=sp.bwd_ms,
                send_ms=sp.send_fwd_ms + sp.send_bwd_ms,
                sync_ms=sp.sync_ms,
                memory={
                    "params": sp.memory.params,
                    "grads": sp.memory.grads,
                    "optimizer": sp.memory.optimizer,
                    "buffers": sp.memory.buffers,
                    "comm_buffers": sp.memory.comm_buffers,
                    "tied_copies": sp.memory.tied_copies,
                    "activations": sp.memory.activations,
                    "total": sp.memory.total,
                    "capacity": sp.capacity,
                },
            )
        )
    warnings = list(result.warnings)
    bns = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if bns and lay.micro_batches > 1:
        warnings.append(
            f"the model has BatchNorm ({', '.join(bns[:3])}{', ...' if len(bns) > 3 else ''}): "
            f"with {lay.micro_batches} micro-batches its statistics are computed over "
            f"{prof.batch_size} samples at a time, not the replica's "
            f"{training.global_batch // lay.dp}; pin --micro-batches 1 to keep them, or use a "
            "normalisation without batch statistics (LayerNorm, GroupNorm)"
        )
    n_params = sum(p.numel() for p in model.parameters())
    return Plan(
        model={
            "fingerprint": base.fingerprint,
            "file": model_file or "",
            "parameters": int(n_params),
            "capture": base.capture,
            "blocks": len(base.blocks),
        },
        parameter_shapes={
            name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)
        },
        cluster=cluster.to_dict(),
        global_batch=training.global_batch,
        micro_batches=lay.micro_batches,
        micro_batch_size=result.cost.micro_batch_size,
        optimizer=training.optimizer,
        precision=training.precision,
        schedule=lay.schedule,
        pp=lay.pp,
        dp=lay.dp,
        stages=tuple(stages),
        predicted={
            "step_ms": pred.step_ms,
            "closed_form_ms": pred.closed_form_ms,
            "samples_per_s": pred.samples_per_s,
            "bubble_fraction": pred.bubble_fraction,
        },
        solver=SolverRecord(
            name=sol.solver,
            status=sol.status,
            gap=sol.gap,
            bound_ms=sol.bound,
            solve_s=sol.solve_s,
            time_limit_s=options.search.time_limit_s,
            n_segments=sol.n_segments,
            note=result.refined,
        ),
        candidates=tuple(result.candidates),
        profiles=tuple(profiles.all_anchors()),
        warnings=tuple(warnings),
    )
