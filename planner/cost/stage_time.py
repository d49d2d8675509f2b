"""The time of a stage: its compute, its sends, its all-reduce, its tied exchange, its step.

For a stage holding blocks ``[i, j)`` of a layout (``pp`` stages × ``dp``
replicas, ``m`` micro-batches of ``b = B / (dp·m)`` samples):

* **compute** per micro-batch: Σ forward and Σ backward of its blocks at ``b``
  on the stage's device type (+ the loss on the last stage, + one more forward
  when the stage recomputes activations), plus a fixed cost per pipeline
  action (``ACTION_OVERHEAD_MS``: the schedule's bookkeeping and p2p handshake).
  Local CPU processes share the machine's cores ([Note: shared cores] in
  :mod:`planner.cost.simulate`, :func:`cpu_speeds`): the simulation slows the
  stages that compute at once; the per-action figures reported are the steady
  state's.
* **p2p**: the bytes live across the split point (``boundary_bytes``, skip
  connections included) sent forward, and their gradients sent back, over the
  link joining the two stages' devices: latency + bytes / bandwidth (between
  CPU processes slowed like compute, plus a wake-up wait, not slowed, when the
  cores are oversubscribed: ``CPU_OVERSUBSCRIBED_WAKEUP_S``). A strided tensor among
  them (a transposed residual, a channels-last view) is first copied dense by
  the sender, and its gradient by the receiver: a read and a write of its
  bytes at the device's memory bandwidth (``runtime.split.relay``).
* **all-reduce** of the stage's gradients across its ``dp`` replicas (ring:
  2(n−1)/n · bytes / bandwidth), inside the stage's last backward (DDP), so it
  delays the gradient sent to the stage before; then the all-reduce of tied
  weights among the stages holding them, which start it together ([Note: tied
  copies]); then the **optimizer step**: on GPUs a memory-bound pass over
  weights, gradients and optimizer state at the device's memory bandwidth, on
  CPUs per tensor ([Note: the CPU optimizer step]); with ZeRO-1 over a replica's
  share of the parameters only, followed by the **weights' broadcasts** from
  each replica to the others ([Note: ZeRO-1 shares] in :mod:`planner.cost.basis`);
  with FSDP over a replica's shard, and no all-reduce: the weights' **all-gather**
  and the gradients' **reduce-scatter**, both in the tail ([Note: FSDP as it runs] in
  :mod:`planner.cost.basis`).
* **the agreement**, after every stage's last backward: the gradient norm, a read
  of the stage's gradients (:mod:`planner.cost.agreement`).

Pure: no torch. Times in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.cost.agreement import agree_ms
from planner.cost.basis import CostBasis
from planner.cost.cpu_step import cpu_step_s
from planner.devices.catalogue import Device
from planner.plan.records import Calibration, ModelProfile

__all__ = [
    "ACTION_OVERHEAD_MS",
    "CPU_CORUN_SLOWDOWN",
    "CPU_OVERSUBSCRIBED_WAKEUP_S",
    "StageTime",
    "corun_slowdown",
    "cpu_speeds",
]

# Fixed cost of one pipeline action (a forward or a backward of one micro-batch
# on one stage), on top of the blocks' measured time: the schedule's Python
# bookkeeping and the p2p handshake. gloo: measured by bench/bench_runtime.py
# on a near-empty stage, 0.56–0.70 ms (median 0.68) per action on the 2-core
# machine. NCCL: kernel-launch scale, not measured here (no GPU lent).
ACTION_OVERHEAD_MS = {"gloo": 0.7, "nccl": 0.05}

# Local CPU "devices" share one machine's memory system: with every process
# computing at once, each stage's fwd+bwd ran 1.09–1.29× slower than alone
# (bench/bench_runtime.py, "corun"); the profile measures one process alone.
# Applied while more than one process computes (see cpu_speeds).
CPU_CORUN_SLOWDOWN = 1.15

# [Note: whose co-run a calibration fits] A calibration fits the co-run slow-down
# from a run's actions that overlap another rank's (planner.calibrate.compute), and
# only a pipeline's actions are sometimes alone and sometimes not: so what it
# measures is stages co-running, one stage's forward beside another's backward.
# Replicas of a stage (dp > 1) run the same action at the same moment, their
# memory-bound phases together: in the calibration benchmark's quiet run
# (2026-12-07) the 2×1 m4 fits found 1.0 on 6 models of 8, while the same
# models' 1×2 replicas ran their forwards 0.99–1.33 × their time alone, and the
# 1×2 cases priced with the fitted 1.0 came out 6–28 % low. So a fitted co-run
# prices layouts whose co-running processes are stages only (dp 1); a layout with
# replicas keeps CPU_CORUN_SLOWDOWN (which was measured with all processes busy).

# [Note: a wake-up is not time-sliced] When local CPU processes outnumber the cores
# (pp × dp × threads > cores), a process woken by a message often waits for a core
# first, about a scheduler time slice: a wait, not work, so the time-slicing that
# slows the copies (``comm_scale``) does not multiply it. Fitted first as 2 ms so
# multiplied (2.3×: 4.6 ms a message, four examples at pp 2 × dp 2); the calibration
# benchmark's quiet run (2026-12-07) measured 1.6–3.8 ms (median 2.8, eight models)
# between a stage's action ending and the next stage's starting: 2 ms, not slowed,
# took BERT's and Llama's 2 × 2 cases from +40 and +27 % to −3 and +3 % (same launches).
CPU_OVERSUBSCRIBED_WAKEUP_S = 2e-3

# [Note: gloo's all-gather and reduce-scatter] NCCL runs both as rings, each half a
# ring all-reduce of the whole bytes; gloo does not: its all_gather_into_tensor and
# reduce_scatter_tensor took 1.4 and 1.6-2.0 times its all_reduce of the same whole
# tensor at 2 ranks, 1.25 and 1.6 at 4 (34 MiB fp32, medians of 7, on the 2-core
# machine, 2026-12-06). FSDP on gloo is priced at these multiples of the all-reduce.
_GLOO_FSDP = (1.3, 1.8)


def cpu_speeds(
    *, stages: int, processes: int, threads: int, cores: int, corun: float = CPU_CORUN_SLOWDOWN
) -> list[float]:
    """[Note: shared cores] for local CPU processes: the speed of each computing
    process while k of the ``stages`` compute at once (k = 1 … stages).

    The ``processes`` of a node (each with ``threads`` torch threads) are spread
    over the stages, so k computing stages keep k/stages of them busy. More
    threads than ``cores`` are time-sliced (speed cores / threads busy), and two
    or more processes running at once share the memory bandwidth
    (``corun``, default ``CPU_CORUN_SLOWDOWN``; a calibration may fit its own).

    Example::

        cpu_speeds(stages=2, processes=4, threads=1, cores=2)  # pp 2 × dp 2: [0.87, 0.43]
    """
    out = []
    for k in range(1, stages + 1):
        busy = max(1.0, k * processes / stages)  # processes computing
        share = min(1.0, cores / (busy * threads))
        running = min(busy, cores / threads)  # processes on a core at any instant
        out.append(share / (corun if running > 1 else 1.0))
    return out


def corun_slowdown(profile: ModelProfile, dp: int) -> float:
    """The co-run slow-down of the local CPU processes of a layout of ``dp`` replicas:
    the profile's calibration's when there is one and dp is 1, else
    ``CPU_CORUN_SLOWDOWN`` ([Note: whose co-run a calibration fits])."""
    cal = profile.calibration
    if dp > 1 or cal is None or cal.corun_slowdown is None:
        return CPU_CORUN_SLOWDOWN
    return cal.corun_slowdown


class StageTime:
    """Every time figure of a stage of one layout (see the module docstring).

    Attributes:
        overhead: the fixed cost of one pipeline action (ms).
        speeds: ``speeds[k − 1]``, the speed of a computing stage while k compute.
        compute_scale: 1 / the steady state's speed (all stages computing): the
            factor from a figure alone to the figure the closed form and the
            stage table use.
        comm_scale: the same for transfers (between CPU processes they are CPU
            work too: loopback copies), 1 elsewhere.
        wakeup_s: the wait per message when the cores are oversubscribed, not
            slowed by ``comm_scale`` ([Note: a wake-up is not time-sliced]).
        calibration: the profile's calibration (``planner calibrate``), or one
            that changes nothing: its action overhead and co-run slow-down
            replace the defaults, its scales multiply the optimizer step and the
            all-reduce, its extra is added to each transfer between stages.
    """

    def __init__(self, basis: CostBasis) -> None:
        self.b = basis
        backend = basis.cluster.backend
        self.calibration = basis.profile.calibration or Calibration()
        fitted = self.calibration.action_overhead_ms
        self.overhead = ACTION_OVERHEAD_MS.get(backend, 0.0) if fitted is None else fitted
        self.speeds = self._speeds()
        self.compute_scale = 1.0 / self.speeds[-1]
        self.comm_scale = self.compute_scale if backend == "gloo" else 1.0
        self.wakeup_s = CPU_OVERSUBSCRIBED_WAKEUP_S if self._oversubscribed() else 0.0
        # Processes on the busiest node: they share its cache ([Note: the CPU optimizer step]).
        self._processes = self._cpu_processes()[0] if backend == "gloo" else 1
        self._kinds: dict[int, list[tuple[Device, int]]] = {}
        self._pairs: dict[int, list[tuple[int, int]]] = {}

    # ----------------------------------------------------------------- compute

    def _cpu_processes(self) -> tuple[int, int]:
        """(processes computing on the busiest node, torch threads each) of this layout."""
        cluster = self.b.cluster
        ranks = [r for stage in self.b.layout.ranks for r in stage]
        threads = max(cluster.devices[r].threads for r in ranks) or 1
        return min(max(cluster.devices_per_node()), len(ranks)), threads

    def _speeds(self) -> list[float]:
        """Speed of a stage while k stages compute at once ([Note: shared cores])."""
        pp = self.b.layout.pp
        if self.b.cluster.backend != "gloo":
            return [1.0] * pp
        processes, threads = self._cpu_processes()
        cores = self.b.cluster.cores_per_node
        corun = corun_slowdown(self.b.profile, self.b.layout.dp)
        return cpu_speeds(stages=pp, processes=processes, threads=threads, cores=cores, corun=corun)

    def _oversubscribed(self) -> bool:
        """More busy threads than cores on a node, with every stage computing."""
        if self.b.cluster.backend != "gloo":
            return False
        processes, threads = self._cpu_processes()
        return processes * threads > self.b.cluster.cores_per_node

    def fwd(self, s: int, i: int, j: int) -> float:
        """One micro-batch's forward on stage s holding blocks [i, j), steady state (ms)."""
        out = 0.0
        for t in self.b.stage_types[s]:
            tab = self.b.tables[t]
            v = tab.fwd[j] - tab.fwd[i] + (tab.loss_fwd if j == self.b.n_blocks else 0.0)
            out = max(out, v)
        return (out + self.overhead) * self.compute_scale

    def bwd(self, s: int, i: int, j: int, recompute: bool) -> float:
        """One micro-batch's backward (and the recomputed forward), steady state (ms)."""
        out = 0.0
        for t in self.b.stage_types[s]:
            tab = self.b.tables[t]
            v = tab.bwd[j] - tab.bwd[i] + (tab.loss_bwd if j == self.b.n_blocks else 0.0)
            if recompute:
                v += tab.fwd[j] - tab.fwd[i]
            out = max(out, v)
        return (out + self.overhead) * self.compute_scale

    # ----------------------------------------------------------------- communication

    def cut(self, s: int, j: int) -> tuple[float, float]:
        """(forward, backward) transfer time per micro-batch on link s → s+1 at block j."""
        b, tab = self.b, self.b.table(s)  # gradients come back for floating tensors only
        nbytes, grads = tab.boundary[j] * b.act_scale, tab.grad_boundary[j] * b.act_scale
        copied, fwd, bwd = tab.copied[j] * b.act_scale, 0.0, 0.0
        for src, dst in self._link_pairs(s):
            link = b.cluster.p2p_time(src, dst, nbytes)
            fwd = max(fwd, link + self._dense_copy_s(src, copied))
            bwd = max(bwd, b.cluster.p2p_time(src, dst, grads) + self._dense_copy_s(dst, copied))
        extra = self.calibration.p2p_extra_ms  # one message each way
        return self._wire_s(fwd, 1) * 1e3 + extra, self._wire_s(bwd, 1) * 1e3 + extra

    def _wire_s(self, copies_s: float, messages: int) -> float:
        """Copies time-sliced, a wait per message ([Note: a wake-up is not time-sliced])."""
        return copies_s * self.comm_scale + messages * self.wakeup_s

    def _link_pairs(self, s: int) -> list[tuple[int, int]]:
        """One (sender, receiver) rank pair of link s → s+1 per kind of pair the replicas
        use: the transfer's time depends only on the two devices and whether they are
        one, share a node or not, so the slowest replica is among these."""
        got = self._pairs.get(s)
        if got is None:
            c, ranks = self.b.cluster, self.b.layout.ranks
            kinds: dict[tuple[object, ...], tuple[int, int]] = {}
            for src, dst in zip(ranks[s], ranks[s + 1], strict=True):
                a, z = c.devices[src], c.devices[dst]
                key = (a.device, z.device, src == dst, a.node == z.node)
                kinds.setdefault(key, (src, dst))
            got = self._pairs[s] = list(kinds.values())
        return got

    def _devices(self, s: int) -> list[tuple[Device, int]]:
        """The distinct (device, torch threads) among stage s's replicas."""
        got = self._kinds.get(s)
        if got is None:
            c = self.b.cluster
            pairs = ((c.devices[r].device, c.devices[r].threads) for r in self.b.layout.ranks[s])
            got = self._kinds[s] = list(dict.fromkeys(pairs))
        return got

    def _dense_copy_s(self, rank: int, nbytes: float) -> float:
        """Copying ``nbytes`` of strided tensors dense on ``rank``'s device: read + write."""
        if not nbytes:
            return 0.0
        dev = self.b.cluster.devices[rank].device
        return 2 * nbytes / (dev.memory_bandwidth * dev.memory_efficiency)

    def optimizer_ms(self, s: int, i: int, j: int) -> float:
        """The optimizer step of stage s (tied copies included).

        GPUs: a memory-bound pass, weights and state read and written and the
        gradients read once, at the device's memory bandwidth. Local CPUs: see
        [Note: the CPU optimizer step].
        """
        b = self.b
        n_params = b.stepped(s, i, j)  # ZeRO-1's share, FSDP's shard: [Note: ZeRO-1 shares]
        slowest = 0.0
        for dev, _ in self._devices(s):
            if b.cluster.backend == "gloo":
                t = self._cpu_step_s(s, i, j, dev, n_params)
            else:
                moved = n_params * (2 * (b.weights_b + b.optim_b) + b.grads_b)
                t = moved / (dev.memory_bandwidth * dev.memory_efficiency)
            slowest = max(slowest, t)
        return slowest * 1e3 * self.calibration.optimizer_scale

    def _cpu_step_s(self, s: int, i: int, j: int, dev: Device, n_params: float) -> float:
        """[Note: the CPU optimizer step] of ``n_params`` of blocks [i, j), seconds, at the
        steady state's speed (every process steps at the end)."""
        return cpu_step_s(self.b, s, (i, j), dev, n_params, self._processes) * self.compute_scale

    def reduce_ms(self, s: int, i: int, j: int) -> float:
        """DDP's all-reduce of stage s's gradients across its replicas (tied copies
        included), in ms; it runs inside the stage's last backward. 0 with FSDP
        (its reduce-scatter: :meth:`fsdp_ms`), and for a stage that holds no
        parameter (the runtime wraps no DDP around it: ``runtime.stage``)."""
        b = self.b
        n_params = b.held_parameters(s, i, j)
        if b.layout.dp == 1 or b.fsdp or n_params == 0:
            return 0.0
        ring, dp = b.cluster.allreduce_time(b.layout.ranks[s], n_params * b.wire_b), b.layout.dp
        return self._wire_s(ring, 2 * (dp - 1)) * 1e3 * self.calibration.allreduce_scale

    def tied_ms(self, s: int, i: int, j: int) -> float:
        """The all-reduce of tied weights' gradients that stage s shares with other
        stages, in ms.

        [Note: tied copies] A stage using a tied tensor whose owner block sits
        on another stage holds a copy; the copy's gradient is all-reduced with
        the owner's every step, by every stage holding one (the owner too), and
        none of them goes on before all have joined. Which other stages hold it
        is not known per segment, so the exchange is priced on the slowest link
        from this stage to any other stage of the replica.
        """
        b = self.b
        nbytes = sum(
            n
            for owner, n, users in b.tied
            if any(i <= u < j for u in users) and not all(i <= u < j for u in users)
        )
        if not nbytes:
            return 0.0
        grads = nbytes / b.param_elem * b.grads_b
        me = b.layout.ranks[s][0]
        others = {b.layout.ranks[o][0] for o in range(b.layout.n_stages)} - {me}
        ring = max((b.cluster.allreduce_time((o, me), grads) for o in others), default=0.0)
        return self._wire_s(ring, 2) * 1e3

    def gather_ms(self, s: int, i: int, j: int) -> float:
        """With ZeRO-1, after the optimizer step: each replica of stage s sends the
        weights of its share to the others, one broadcast per replica (ms); 0 with DDP.

        dp broadcasts, each priced at the largest share (:meth:`CostBasis.stepped`, in
        the weights' bytes; the others' are no larger), each a pipelined ring over the
        ring the stage's replicas all-reduce on (as NCCL's): ``S/B + (n−1)·L``, half
        of what a ring all-reduce of ``S·n/(n−1)`` takes (:meth:`Cluster.allreduce_time`).
        """
        b = self.b
        if not b.sharded:
            return 0.0
        dp = b.layout.dp
        share = b.stepped(s, i, j) * b.weights_b
        one = b.cluster.allreduce_time(b.layout.ranks[s], share * dp / (dp - 1)) / 2
        t = dp * self._wire_s(one, 1)
        return t * 1e3 * self.calibration.allreduce_scale

    def fsdp_ms(self, s: int, i: int, j: int) -> tuple[float, float]:
        """With FSDP, (the weights' all-gather, the gradients' reduce-scatter) of stage s
        over its replicas (ms; tied copies included); (0, 0) otherwise.

        Each runs on the ring the replicas all-reduce on and takes half of a ring
        all-reduce of its bytes (:meth:`Cluster.allreduce_time`; n − 1 messages of
        its 2(n − 1)); on gloo the multiples measured there ([Note: gloo's
        all-gather and reduce-scatter]): the weights in their own dtype
        (``weights_b``: the runtime gathers the fp32 master copy), the gradients as
        DDP's all-reduce sends them (``wire_b``: bf16 under bf16-mixed). Neither
        overlaps compute; both are priced in the stage's tail ([Note: FSDP as it
        runs] in :mod:`planner.cost.basis`).
        """
        b = self.b
        if not b.fsdp:
            return 0.0, 0.0
        n, ranks, dp = b.held_parameters(s, i, j), b.layout.ranks[s], b.layout.dp
        times = _GLOO_FSDP if b.cluster.backend == "gloo" else (0.5, 0.5)
        gather = b.cluster.allreduce_time(ranks, n * b.weights_b) * times[0]
        scatter = b.cluster.allreduce_time(ranks, n * b.wire_b) * times[1]
        scale = 1e3 * self.calibration.allreduce_scale
        return self._wire_s(gather, dp - 1) * scale, self._wire_s(scatter, dp - 1) * scale

    def agree_ms(self, s: int, i: int, j: int) -> float:
        """[Note: the step's agreement] on stage s (ms)."""
        return agree_ms(self.b, s, (i, j), [d for d, _ in self._devices(s)], self.compute_scale)

    def sync(self, s: int, i: int, j: int) -> float:
        """The step's tail on stage s (ms): DDP's all-reduce, the tied exchange ([Note:
        tied copies]), the agreement, the optimizer step, with ZeRO-1 the weights'
        broadcasts, with FSDP its all-gather and reduce-scatter."""
        return (
            self.reduce_ms(s, i, j)
            + self.tied_ms(s, i, j)
            + self.agree_ms(s, i, j)
            + self.optimizer_ms(s, i, j)
            + self.gather_ms(s, i, j)
            + sum(self.fsdp_ms(s, i, j))
        )

    def joined(self, bounds: Sequence[int]) -> list[list[int]]:
        """Groups of stages that all-reduce tied weights together (a collective)."""
        b = self.b
        groups: list[set[int]] = []
        for _, _, users in b.tied:
            stages = {
                s for s in range(b.layout.n_stages) for u in users if bounds[s] <= u < bounds[s + 1]
            }
            if len(stages) < 2:
                continue
            for g in [g for g in groups if g & stages]:
                groups.remove(g)
                stages |= g
            groups.append(stages)
        return [sorted(g) for g in groups]
