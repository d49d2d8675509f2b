"""The placement the search prints is the fastest there is: the step solver against brute force.

Every contiguous placement of small random models is priced by the full cost
model (``CostModel.predict``: GPipe and 1F1B, dp > 1, tied weights, memory
with recompute, local CPU processes sharing cores, mixed devices, two nodes);
the solver's step must equal the least of them where it says "optimal", and
its bound may never exceed it.
"""

from __future__ import annotations

import itertools
import random

import pytest
from models import block_cost, cpu_cluster, model_profile, usable_cores

from planner.cost import CostModel, Layout
from planner.devices.build import from_gpus
from planner.devices.cluster import Cluster
from planner.devices.cluster_file import parse_cluster
from planner.options import SearchOptions, Training
from planner.plan.records import ModelProfile, TiedSet
from planner.plan.schedule import stage_ranks
from planner.search import layouts
from planner.search.loop import place
from planner.solve import step as step_module

MB = 2**20
REL = 1e-9


def _profile(rng: random.Random, n: int, device: str, speed: float, tied: bool) -> ModelProfile:
    blocks = [
        block_cost(
            k,
            fwd_ms=rng.uniform(0.2, 3.0) / speed,
            bwd_ms=rng.uniform(0.4, 6.0) / speed,
            param_bytes=rng.choice([0, 1, 4, 16, 64]) * MB,
            activation_bytes=rng.choice([1, 8, 32]) * MB,
            boundary_bytes=0 if k == 0 else rng.choice([1, 2, 8, 32]) * MB,
        )
        for k in range(n)
    ]
    users = (0, n - 1) if rng.random() < 0.5 else (rng.randrange(n - 1), n - 1)
    ties = (TiedSet(names=("a.w", "b.w"), blocks=users, nbytes=16 * MB),) if tied else ()
    return model_profile(
        blocks,
        device,
        source="analytic",
        threads=0,
        tied=ties,
        input_bytes=MB,
        loss_fwd_ms=0.3 / speed,
        loss_bwd_ms=0.2 / speed,
    )


def _cluster(kind: str, devices: int) -> Cluster:
    if kind == "cpu":
        return cpu_cluster(devices)
    if kind == "mixed":
        half = devices // 2
        return parse_cluster(
            {"nodes": [{"type": "a100-80gb", "count": half}, {"type": "v100-32gb", "count": half}]}
        )
    if kind == "two-nodes":
        return from_gpus(16, "h100")
    if kind == "small-memory":
        return from_gpus(devices, "h100", memory_gib=0.5)
    return from_gpus(devices, "h100")


SEVERAL = {
    False: ["gpipe", "1f1b"],
    True: ["interleaved-1f1b", "looped-bfs"],
    "zb": ["interleaved-zb", "zbv", "dualpipev"],
}


def _parts(
    seed: int, kind: str, several: bool | str = False, dp_mode: str = "ddp"
) -> tuple[dict[str, ModelProfile], Cluster, Training, Layout]:
    """A random small instance: its profiles per device type, cluster, training, layout;
    ``several``: two stages per rank (True: Interleaved 1F1B or Looped BFS, "zb": a
    zero-bubble schedule; pp 2); ``dp_mode`` other than ddp: dp 2, in that mode."""
    rng = random.Random(seed)
    n = rng.randint(4, 9)
    pp = 2 if several else rng.choice([p for p in (2, 3, 4) if p <= n])
    dp = rng.choice([1, 2]) if dp_mode == "ddp" else 2
    v = 2 if several else 1
    schedule = rng.choice(SEVERAL[several])
    if schedule == "1f1b":
        m = rng.choice([pp, pp + 1, 2 * pp])
    elif schedule in ("interleaved-1f1b", "interleaved-zb"):
        m = rng.choice([2, 4])
    elif schedule == "dualpipev":
        m = rng.choice([4, 5])
    else:
        m = rng.choice([1, 2, 3, 4])
    cluster = _cluster(kind, 4 * dp if kind == "mixed" else pp * dp)
    grid = rng.choice(layouts(cluster, pp, dp))[1]
    tied = rng.random() < 0.5
    types = sorted({cluster.devices[r].device.key for st in grid for r in st})
    profiles = {
        t: _profile(random.Random(seed), n, t, 1.0 + 0.5 * k, tied) for k, t in enumerate(types)
    }
    ranks = tuple(grid[k] for k in stage_ranks(schedule, pp, v))
    layout = Layout(pp=pp, dp=dp, micro_batches=m, schedule=schedule, ranks=ranks, virtual=v,
                    dp_mode=dp_mode)  # fmt: skip
    return profiles, cluster, Training(global_batch=4 * dp * m), layout


def _instance(seed: int, kind: str, several: bool | str = False, dp_mode: str = "ddp") -> CostModel:
    return CostModel(*_parts(seed, kind, several, dp_mode))


def _brute_force(cost: CostModel) -> float | None:
    best = None
    for cuts in itertools.combinations(range(1, cost.n_blocks), cost.layout.n_stages - 1):
        pred = cost.predict((0, *cuts))
        if pred.fits and (best is None or pred.step_ms < best):
            best = pred.step_ms
    return best


def _check(cost: CostModel) -> str:
    best = _brute_force(cost)
    if best is None:
        return "infeasible"
    sol = place(cost, SearchOptions(time_limit_s=30))
    assert sol.step == pytest.approx(cost.predict(sol.starts).step_ms, rel=REL)
    assert cost.predict(sol.starts).fits
    assert sol.bound <= best * (1 + REL), (sol, best)
    assert sol.step >= best * (1 - REL)
    if sol.status == "optimal":
        assert sol.step == pytest.approx(best, rel=REL), (sol, best)
    return sol.status


KINDS = ["h100", "two-nodes", "mixed", "small-memory"]


@pytest.mark.parametrize("several", [True, "zb"], ids=["v2", "zb"])
@pytest.mark.parametrize("kind", KINDS)
def test_two_stages_per_rank_are_placed_optimally_with_their_memory_summed(
    kind: str, several: bool | str
) -> None:
    """Interleaved 1F1B and Looped BFS, and the zero-bubble schedules, pp 2 × v 2: the
    solver's placement against every placement simulated, a rank's two stages summed
    against its device."""
    seeds = range(8 if several is True else 12)  # zb: small memory fits 3 of 12
    statuses = [_check(_instance(700 + seed, kind, several=several)) for seed in seeds]
    assert all(s in ("optimal", "infeasible") for s in statuses), statuses
    assert statuses.count("optimal") >= 3


@pytest.mark.parametrize("kind", KINDS)
def test_the_step_solver_finds_the_fastest_placement(kind: str) -> None:
    statuses = [_check(_instance(seed, kind)) for seed in range(12)]
    assert all(s in ("optimal", "infeasible") for s in statuses), statuses
    assert statuses.count("optimal") >= 6


@pytest.mark.parametrize("kind", KINDS)
def test_the_step_milp_alone_finds_the_fastest_placement(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(step_module, "ENUMERATE_MAX", 0)  # no enumeration: the MILP proves it
    statuses = [_check(_instance(100 + seed, kind)) for seed in range(12)]
    assert all(s in ("optimal", "infeasible") for s in statuses), statuses
    assert statuses.count("optimal") >= 6


def test_shared_cores_are_bounded_and_enumerated_when_few(monkeypatch: pytest.MonkeyPatch) -> None:
    with usable_cores(2):
        statuses = [_check(_instance(200 + seed, "cpu")) for seed in range(10)]
        assert all(s == "optimal" for s in statuses if s != "infeasible"), statuses
        monkeypatch.setattr(step_module, "ENUMERATE_MAX", 0)
        monkeypatch.setattr(step_module, "ENUMERATE_WORK", 0)
        monkeypatch.setattr(step_module, "PROVE_WORK", 0)
        statuses = [_check(_instance(300 + seed, "cpu")) for seed in range(10)]
    assert set(statuses) <= {"optimal", "bounded", "infeasible"}, statuses


def test_shared_cores_are_searched_per_configuration_and_proven_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(step_module, "ENUMERATE_MAX", 0)
    monkeypatch.setattr(step_module, "ENUMERATE_WORK", 0)
    monkeypatch.setattr(step_module, "PROVE_WORK", 0)
    with usable_cores(2):
        cost = _instance(301, "cpu")
        searched = place(cost, SearchOptions(), prove=False)
        assert (searched.method, searched.status, searched.bound) == ("search", "bounded", 0.0)
        proven = place(cost, SearchOptions(), starts=[searched.starts])
        assert proven.method == "bound+simulation" and 0 < proven.bound <= proven.step
        assert proven.step <= searched.step
        # The search proves the configuration it keeps.
        from planner.search import search

        profile = cost.profile

        res = search(
            lambda device, b: profile,
            cost.cluster,
            Training(global_batch=cost.training.global_batch),
            SearchOptions(
                pp=cost.layout.pp, dp=cost.layout.dp, micro_batches=cost.layout.micro_batches
            ),
            n_blocks=cost.n_blocks,
        )
    assert res.solution.method != "search" and res.solution.bound > 0


def _graph_and_step(cost: CostModel) -> list[tuple[float, float]]:
    """The step graph's longest path and the simulated step, for every placement."""
    from planner.search.partition import step_problem
    from planner.solve.step_table import StepTable

    problem = step_problem(cost)
    assert problem.exact, "the graph of this layout is a bound, not its step"
    table = StepTable(problem)
    out = []
    for cuts in itertools.combinations(range(1, cost.n_blocks), cost.layout.n_stages - 1):
        starts = (0, *cuts)
        graph = table.graph_times(table.indices(starts))[0]
        out.append((graph, cost.step_ms(starts)))
    return out


@pytest.mark.parametrize("several", [False, True, "zb"], ids=["v1", "v2", "zb"])
@pytest.mark.parametrize("dp_mode", ["ddp", "zero1", "fsdp"])
@pytest.mark.parametrize("kind", ["h100", "two-nodes", "mixed", "small-memory"])
def test_the_step_graph_is_the_simulated_step_of_every_placement(
    kind: str, dp_mode: str, several: bool | str
) -> None:
    """Where the problem is exact, the MILP minimises the graph: it must be the step itself,
    whatever each stage's recompute choice (1F1B's stages hold different micro-batch counts,
    so one run of blocks may recompute on one stage and not on another), in every dp mode,
    with one stage per rank or two."""
    for seed in range(12):
        cost = _instance(400 + seed, kind, several, dp_mode)
        for graph, step in _graph_and_step(cost):
            assert graph == pytest.approx(step, rel=REL)


def test_one_run_of_blocks_recomputes_on_an_early_1f1b_stage_and_not_on_a_late_one() -> None:
    """The Llama 70B case of bench_scaling (pp 32, 1F1B): stage 0 holds 32 micro-batches
    in flight, stage 31 one, so a run that fits a late stage without recompute may need it
    on an early one; equal devices do not make equal figures."""
    n, pp, m = 8, 4, 8
    prof = _profile(random.Random(4), n, "h100", 1.0, tied=False)
    cluster = from_gpus(pp, "h100", memory_gib=0.2)
    layout = Layout(pp=pp, dp=1, micro_batches=m, schedule="1f1b", ranks=((0,), (1,), (2,), (3,)))
    cost = CostModel({"h100": prof}, cluster, Training(global_batch=4 * m), layout)
    middle = [(i, j) for i in range(1, n) for j in range(i + 1, n)]
    assert any(cost.recompute(1, i, j) != cost.recompute(2, i, j) for i, j in middle)
    for graph, step in _graph_and_step(cost):
        assert graph == pytest.approx(step, rel=REL)


@pytest.mark.parametrize("dp_mode", ["ddp", "zero1", "fsdp"])
@pytest.mark.parametrize("several", [False, True, "zb"], ids=["v1", "v2", "zb"])
@pytest.mark.parametrize("kind", ["h100", "two-nodes", "mixed", "small-memory"])
def test_every_lower_bound_is_below_the_step_of_every_placement(
    kind: str, several: bool | str, dp_mode: str
) -> None:
    """The bounds the search prunes with and the solver proves with never exceed a
    placement's simulated step: each segment's bound (on every placement holding that
    segment), and a configuration's bound (the work, the all-reduce chain)."""
    from planner.search.configurations import bounded
    from planner.search.partition import step_problem

    for seed in range(16):
        profiles, cluster, training, lay = _parts(500 + seed, kind, several, dp_mode)
        cost = CostModel(profiles, cluster, training, lay)
        problem = step_problem(cost)
        assert problem.seg_bound is not None and problem.seg_floor is not None
        assert problem.seg_memory_floor is not None
        seg_floor, mem_floor = problem.seg_floor, problem.seg_memory_floor
        configs = bounded(
            # a device type the layout leaves unused: any profile (the bound takes the least)
            lambda device, b, profiles=profiles: profiles.get(
                device, next(iter(profiles.values()))
            ),
            cluster,
            training,
            [(lay.pp, lay.dp, lay.micro_batches, lay.schedule, lay.virtual)],
            dp_modes=(dp_mode,),
        )
        grid = tuple(lay.ranks[lay.stage_ranks.index(k)] for k in range(lay.pp))
        floor = next(c.bound for c in configs if c.grid == grid and c.dp_mode == lay.dp_mode)
        n, S = cost.n_blocks, lay.n_stages
        for s in range(S):  # the floors the solver stops a stage's runs at
            for i in range(n):
                mem = [cost.memory_floor(s, i, j) for j in range(i + 1, n + 1)]
                assert mem == [mem_floor(s, i, j) for j in range(i + 1, n + 1)]  # shared
                work = [seg_floor(s, i, j) for j in range(i + 1, n + 1)]
                assert mem == sorted(mem) and work == sorted(work)
                for j in range(i + 1, n + 1):
                    assert cost.memory_floor(s, i, j) <= cost.stage_memory(s, i, j) * (1 + REL)
        for cuts in itertools.combinations(range(1, cost.n_blocks), S - 1):
            bounds = [0, *cuts, cost.n_blocks]
            step = cost.step_ms(tuple(bounds[:-1]))
            assert floor <= step * (1 + REL), (seed, bounds)
            fits = cost.fits(tuple(bounds[:-1]))
            for s in range(S if fits else 0):  # bounds are of placements that fit
                seg = problem.seg_bound(s, bounds[s], bounds[s + 1], step * (1 + REL))
                assert seg <= step * (1 + REL), (seed, s, bounds, seg, step)
                assert seg_floor(s, bounds[s], bounds[s + 1]) <= step * (1 + REL)
