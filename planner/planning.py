"""From a model (or a model file) and a cluster to a Plan: sizes, profiles, search, assembly.

This is the one function behind ``planner plan`` and ``planner.plan_model``:
the CLI parses its flags into the same ``PlanOptions``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from planner import cache as _cache
from planner.cost.model import Prediction
from planner.devices.build import from_gpus, with_threads
from planner.devices.cluster import Cluster
from planner.options import PlanOptions, SearchOptions, Training
from planner.plan.batch import batch_size_of, normalize_inputs, slice_batch
from planner.plan.fingerprint import parameter_shapes
from planner.plan.modelfile import ModelFile, load_model_file
from planner.plan.records import ModelProfile
from planner.plan.schema import Plan
from planner.plan.sections import (
    LayoutPlan,
    ModelInfo,
    Predicted,
    SolverRecord,
    StageMemory,
    StagePlan,
    TrainingPlan,
)
from planner.plan.text import first_line
from planner.plan.unexpected import add_where
from planner.profile.finite import nonfinite_warning
from planner.profile.meta import ShapesOnlyError
from planner.profile.sizes import Sampler, SizedProfiles
from planner.profile.timing import Progress
from planner.search.configurations import ProfileFor, ThreadsFor, configurations, local_cpu
from planner.search.loop import SearchResult, search
from planner.solve.partition import check_solver

__all__ = ["plan_model", "plan_model_file", "predicted", "stage_plans"]

log = logging.getLogger(__name__)


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
        print(plan.pp, plan.dp, plan.split_points, plan.predicted.step_ms)

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
        progress: called as each phase advances: tracing, timing the blocks at
            each anchor micro-batch size, the search (see
            ``planner.report.progress``: ``progress(phase, done, total, note)``).

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
        sizes = _micro_batch_sizes(cluster, training, options.search)
        if "cpu" in cluster.device_types:  # measured here: real tensors needed
            _check_real(model, sampler, min(sizes))
        profiles = SizedProfiles(
            model, sampler, loss_fn, cluster, training, options.profile, sizes, progress
        )
        base = _first(profiles, max(sizes))
        names = [b.name for b in base.blocks]
        try:
            result = search(
                profiles.get,
                cluster,
                training,
                options.search,
                n_blocks=len(base.blocks),
                block_names=names,
                threads_for=_threads_for(cluster, profiles) if local_cpu(cluster) else None,
                progress=progress,
            )
        except ValueError as exc:
            _explain_excluded(exc, base)
            raise
        except Exception as exc:
            add_where(exc, f"searching the placements of {len(base.blocks)} blocks")
            raise
        measured = base.source == "measured"  # it ran real values: were they finite?
        finite = nonfinite_warning(model, sampler, loss_fn, min(sizes)) if measured else None
        return _assemble(result, base, cluster, options, profiles, model, model_file, finite)


def plan_model_file(
    model_file: str,
    cluster: Cluster,
    options: Callable[[ModelFile], PlanOptions],
    progress: Progress | None = None,
) -> Plan:
    """:func:`plan_model` of a model file (``planner plan``): for catalogue devices the
    model is built on the meta device (shapes only), and with real tensors when its
    forward reads values.

    Args:
        options: the options, given the loaded model file (its batch size).
    """
    mf = load_model_file(model_file)
    opts = options(mf)
    analytic = "cpu" not in cluster.device_types

    def sampler(b: int) -> tuple[Any, Any, Any]:
        bt = mf.sample(b)
        return bt.args, bt.kwargs, bt.targets

    def planned(model: Any) -> Plan:
        return plan_model(
            model,
            sampler,
            cluster=cluster,
            loss_fn=mf.loss,
            options=opts,
            model_file=str(model_file),
            progress=progress,
        )

    if progress is not None:
        progress("building the model" + (" (shapes only)" if analytic else ""), 0, 0, "")
    try:
        return planned(mf.build(meta=analytic))
    except ShapesOnlyError as exc:  # the forward reads values: plan on real tensors
        log.warning("%s; building the model with real tensors", first_line(exc))
        if progress is not None:
            progress("building the model", 0, 0, "")
        return planned(mf.build())


def _first(profiles: SizedProfiles, b: int) -> ModelProfile:
    """The first profile; an unexpected error gets the phase noted (``planner.plan.unexpected``)."""
    try:
        return profiles.first()
    except Exception as exc:
        add_where(exc, f"profiling the model at micro-batch {b}")
        raise


def _threads_for(cluster: Cluster, profiles: SizedProfiles) -> ThreadsFor:
    """The local CPU cluster and its profiles at t torch threads ([Note: fewer CPU processes])."""

    def at(threads: int) -> tuple[Cluster, ProfileFor]:
        return with_threads(cluster, threads), lambda t, b: profiles.get(t, b, threads)

    return at


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
        "  A stage can only receive tensors of fixed shapes: make the module before such a "
        "point return tensors (index a tuple or list before the next module call, pass "
        "numbers as tensors or configuration), and keep data-dependent shapes (nonzero, "
        "boolean masks) inside one module (or pad them to a fixed size), so that the point "
        "becomes legal.",
        *exc.args[1:],
    )


def _check_real(model: nn.Module, sampler: Sampler, b: int) -> None:
    """Refuse meta tensors for a measured profile: they have shapes and no values to time."""
    tensors = [*model.parameters(), *model.buffers()]
    on_meta = sum(t.is_meta for t in tensors)
    batch = [t for t in tree_leaves(sampler(b)[:2]) if isinstance(t, torch.Tensor)]
    batch_meta = any(t.is_meta for t in batch)
    if not on_meta and not batch_meta:
        return
    where = sorted({str(t.device) for t in batch}) or ["(no tensors)"]
    model_at = f"{on_meta} of the model's {len(tensors)} parameters and buffers are on meta"
    raise ValueError(
        f"{model_at if on_meta else 'the model is on a real device'}, and the batch is on "
        f"{', '.join(where)}\n"
        "  why: this plan measures this machine's CPU (--gpus without --device-type, or a "
        "cpu cluster), which times real tensors; meta tensors have shapes but no values "
        "(nothing to run)\n"
        "  fix: build the model and draw the batch on a real device (no `torch.device('meta')` "
        "in build_model or sample_batch), or plan analytically for a catalogue device (e.g. "
        "--device-type h100), which needs shapes only and works on a meta model"
    )


def _sampler(sample: Sampler | tuple[Any, Any]) -> tuple[Sampler, int | None]:
    """A sampler of micro-batches, and the sample's batch size (None for a sampler)."""
    if callable(sample):
        return sample, None
    inputs, targets = sample
    args, kwargs = normalize_inputs(inputs)
    full = batch_size_of(args, kwargs)

    def take(b: int) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        if b > full:
            raise ValueError(f"micro-batch {b} is larger than the sample's batch {full}")
        a, k, y = slice_batch((args, kwargs, targets), 0, b, full)
        return a, k, y

    return take, full


def _micro_batch_sizes(cluster: Cluster, training: Training, opts: SearchOptions) -> list[int]:
    """Every micro-batch size the search may need (raises when no configuration is possible)."""
    configs = configurations(cluster, training, opts)
    return sorted({training.global_batch // (dp * m) for _, dp, m, _, _ in configs})


# --------------------------------------------------------------------------- the plan


def _assemble(
    result: SearchResult,
    base: ModelProfile,
    cluster: Cluster,
    options: PlanOptions,
    profiles: SizedProfiles,
    model: nn.Module,
    model_file: str | None,
    finite: str | None,
) -> Plan:
    lay, sol, pred = result.layout, result.solution, result.prediction
    training = options.training
    warnings = [*result.warnings, *([finite] if finite else [])]
    bn = _batchnorm_warning(
        model, lay.micro_batches, result.cost.micro_batch_size, training, lay.dp
    )
    if bn:
        warnings.append(bn)
    return Plan(
        model=ModelInfo(
            fingerprint=base.fingerprint,
            file=model_file or "",
            parameters=int(sum(p.numel() for p in model.parameters())),
            capture=base.capture,
            blocks=len(base.blocks),
            parameter_shapes=parameter_shapes(model),
        ),
        cluster=result.cost.cluster.to_record(),  # the processes it runs, their threads
        training=TrainingPlan(
            global_batch=training.global_batch,
            micro_batches=lay.micro_batches,
            micro_batch_size=result.cost.micro_batch_size,
            optimizer=training.optimizer,
            precision=training.precision,
            schedule=lay.schedule,
        ),
        layout=LayoutPlan(pp=lay.pp, dp=lay.dp, virtual=lay.virtual, dp_mode=lay.dp_mode),
        stages=stage_plans(pred, result.cost.profile, lay.ranks),
        predicted=predicted(pred),
        step=pred.inputs,
        solver=SolverRecord(
            name=sol.solver,
            status=sol.status,
            method=sol.method,
            gap=sol.gap,
            bound_ms=sol.bound,
            solve_s=sol.solve_s,
            time_limit_s=options.search.time_limit_s,
            n_segments=sol.n_segments,
            note=sol.detail,
        ),
        choice=result.choice,
        candidates=tuple(result.candidates),
        profiles=tuple(profiles.all_anchors(result.cost.cluster.devices[0].threads)),
        warnings=tuple(warnings),
    )


def predicted(pred: Prediction) -> Predicted:
    """The plan's record of a predicted step."""
    return Predicted(
        step_ms=pred.step_ms,
        closed_form_ms=pred.closed_form_ms,
        samples_per_s=pred.samples_per_s,
        bubble_fraction=pred.bubble_fraction,
    )


def stage_plans(
    pred: Prediction, prof: ModelProfile, ranks: Sequence[Sequence[int]]
) -> tuple[StagePlan, ...]:
    """The plan's stages for a predicted placement: split points, modules, ranks, figures.

    Args:
        pred: the prediction (``CostModel.predict``).
        prof: the profile whose blocks the placement cuts.
        ranks: ``ranks[s]``, the ranks running stage s (one per replica).
    """
    stages = []
    for sp in pred.stages:
        i, j = sp.blocks
        modules = [m for blk in prof.blocks[i:j] for m in blk.modules]
        mem = sp.memory
        stages.append(
            StagePlan(
                index=sp.index,
                split_point=prof.blocks[i].name if sp.index else "",
                blocks=(i, j),
                modules=tuple(modules),
                ranks=tuple(ranks[sp.index]),
                device=sp.device,
                recompute=sp.recompute,
                fwd_ms=sp.fwd_ms,
                bwd_ms=sp.bwd_ms,
                send_ms=sp.send_fwd_ms + sp.send_bwd_ms,
                sync_ms=sp.sync_ms,
                memory=StageMemory(
                    params=mem.params,
                    grads=mem.grads,
                    optimizer=mem.optimizer,
                    buffers=mem.buffers,
                    comm_buffers=mem.comm_buffers,
                    tied_copies=mem.tied_copies,
                    activations=mem.activations,
                    total=mem.total,
                    capacity=sp.capacity,
                ),
            )
        )
    return tuple(stages)


def _batchnorm_warning(
    model: nn.Module, micro_batches: int, micro_batch_size: int, training: Training, dp: int
) -> str | None:
    """With micro-batches, BatchNorm's statistics cover one micro-batch, not the replica's."""
    bns = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns or micro_batches <= 1:
        return None
    return (
        f"the model has BatchNorm ({', '.join(bns[:3])}{', ...' if len(bns) > 3 else ''}): "
        f"with {micro_batches} micro-batches its statistics are computed over "
        f"{micro_batch_size} samples at a time, not the replica's "
        f"{training.global_batch // dp}; pin --micro-batches 1 to keep them, or use a "
        "normalisation without batch statistics (LayerNorm, GroupNorm)"
    )
