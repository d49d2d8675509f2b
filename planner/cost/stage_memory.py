"""The memory of a stage: its peak of live bytes over a step, by kind, against its capacity.

See [Note: the memory peak] at :meth:`StageMemoryModel.peak` for the moments
that can make the peak and what each holds; [Note: optimizer temporaries] for
the optimizer step's own allocations.

Pure: no torch. Sizes in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.cost.basis import CostBasis

__all__ = ["MemoryBreakdown", "StageMemoryModel"]

# [Note: optimizer temporaries] torch's Adam/AdamW step computes
# sqrt(exp_avg_sq) / bias_correction into new tensors. On CPU one parameter at a
# time (the single-tensor path: two of the parameter's size at once; the
# largest block's parameters, or a tied tensor, stand for the largest tensor);
# measured. On GPUs the default foreach path does it for all parameters at once
# (4 bytes per parameter at the step): not counted, no GPU was lent to measure
# it. SGD with momentum updates in place.


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes on one device of a stage at its peak, by kind; ``total`` is the peak.

    ``grads`` are the gradients live at that moment (none yet at the start of
    the step's first backward, all of them at the optimizer step);
    ``activations`` is everything else the step allocates: saved activations
    of the micro-batches in flight, the pipeline's receive buffers, the loss's
    tensors and the transient ones (an activation gradient, the optimizer's
    temporaries). ``tied_copies``: weights, gradients and optimizer state of
    tied copies (counted whole all step; with FSDP as the stage's own at that
    moment). With FSDP, ``params`` is the weights whole and their shard (and
    bf16 copy) at a backward's moment, the shard alone at the optimizer step.
    """

    params: float
    grads: float
    optimizer: float
    buffers: float
    comm_buffers: float
    tied_copies: float
    activations: float

    @property
    def total(self) -> float:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.buffers
            + self.comm_buffers
            + self.tied_copies
            + self.activations
        )


class StageMemoryModel:
    """The memory figures of every stage of one layout, and the recompute choice."""

    def __init__(self, basis: CostBasis) -> None:
        self.b = basis
        devices, ranks = basis.cluster.devices, basis.layout.ranks
        self._host = [all(devices[r].device.kind == "cpu" for r in rs) for rs in ranks]
        """Per stage: its devices are CPUs, whose memory the process's batch is in."""

    def peak(self, s: int, i: int, j: int, recompute: bool = False) -> MemoryBreakdown:
        """The peak of live tensor bytes on a device of stage s holding blocks [i, j).

        [Note: the memory peak] Weights, optimizer state, buffers, DDP's buckets
        and the pipeline's receive buffers live all step (with FSDP the weights
        are whole from the first forward to the last backward, beside their
        shard); gradients and activations come and go, so the peak is the
        largest of these moments:

        * **the first backward** (GPipe, and 1F1B while m ≤ its in-flight count):
          the step began with no gradients (``zero_grad(set_to_none=True)``);
          the n micro-batches in flight hold their activations, and as one is
          run backward its blocks' gradients appear while its blocks' saved
          tensors go, so the peak is ``max over k`` of (gradients of blocks
          ≥ k + activations of blocks ≤ k) + n − 1 other micro-batches; on the
          last stage the loss's backward starts it, with the model's output,
          what the loss saved and two output-sized gradients live;
        * **a later backward with every gradient allocated** (any m > 1: n
          micro-batches in flight in 1F1B's steady state, n − 1 after GPipe's
          first backward): autograd computes a parameter's gradient into a new
          tensor, then adds it to the one held: the largest such tensor adds
          (examples/gpt.py at pp 2: 16 MiB, 8 and 11 % of the stages' peaks),
          as the micro-batch run backward still holds its blocks' activations
          up to the block making it (``max over k``: an embedding's, made last,
          meets that micro-batch's smallest activations); on the last stage the
          loss's backward makes no parameter gradient;
        * with FSDP, **the reduce-scatter** at the end of the last backward: the
          weights whole, the gradients whole and the output's shard of them
          ([Note: FSDP as it runs] in :mod:`planner.cost.basis`);
        * **the optimizer step**: all gradients, the optimizer's temporaries; with
          ZeRO-1 then a replica's share of the weights, flat, as it is sent; with
          FSDP shards only (weights, gradients, state and temporaries over 1/dp).

        On the last stage, what the loss saved goes with the loss's backward: a
        block's backward after it holds the output alone of the two (counted
        with both, examples/gpt.py at pp 2, m 4, 1F1B was priced 71.1 MiB on its
        last stage against 63.4 measured; the loss's output-sized gradients and
        a block's new parameter gradient were counted at once too).

        Per micro-batch in flight: the blocks' saved activations (each tensor
        once, charged to the block that made it), and on the last stage the
        model's output and what the loss saves (cross-entropy keeps its
        log-softmax, MSE its difference: about the output's size). Receive
        buffers: torch's pipelining keeps one input buffer per micro-batch on
        every stage after the first, and one output-gradient buffer per
        micro-batch on every stage before the last, for its floating-point
        tensors only (integer ids and masks have no gradient: BERT's first
        stage, the embeddings' index work alone, was priced 16 KiB against 7.5
        measured with them counted); the first stage holds the replica's batch
        instead; the batch besides: :meth:`_batch`. Backward moments add a
        block's output and input gradients (the largest pair) and, after the
        first stage, the last input gradient still being sent; GPipe waits for
        its sends after the last backward, which so holds every earlier
        micro-batch's (a 1 KiB last stage measured all four of m 4), and for its
        forward sends after the last forward: the dense copies of a strided
        output, one per micro-batch. With recompute, micro-batches in flight
        keep only their inputs; the one run backward is recomputed first.
        """
        b = self.b
        held = self._held(s, i, j)
        moments = self._moments(s, i, j, recompute)
        grads, activations, when = max(
            moments, key=lambda x: x[0] + x[1] + sum(held[x[2]].values())
        )
        return MemoryBreakdown(
            grads=grads,
            buffers=b.table(s).buffers[j] - b.table(s).buffers[i],
            activations=activations,
            **held[when],
        )

    def _moments(self, s: int, i: int, j: int, recompute: bool) -> list[tuple[float, float, str]]:
        """The moments of [Note: the memory peak] as (gradients, activations, when): when is
        "bwd" (the weights and state of a backward), "rs" (FSDP's reduce-scatter, at the end
        of the last backward) or "step" (the optimizer step), a key of :meth:`_held`."""
        b = self.b
        tab = b.table(s)
        last = j == b.n_blocks
        n_params = b.parameters(s, i, j)
        scale = b.act_scale
        m, n = b.layout.micro_batches, b.layout.in_flight(s)
        stage_input = tab.boundary[i] if i > 0 else tab.input_bytes
        stage_output = tab.output[j - 1] if last else tab.boundary[j]
        output_grads = 0.0 if last else tab.grad_boundary[j]  # received, per micro-batch
        recv = m * (stage_input + output_grads) * scale + self._batch(s, i, j)
        acts = tab.act[j] - tab.act[i]
        loss = 2 * stage_output * scale if last else 0.0  # the output, and what the loss saves
        saved = stage_output * scale if last else 0.0  # what the loss saves: freed by its backward
        per_mb = (0.0 if recompute else acts) + loss
        all_grads = n_params * b.grads_b  # tied copies' gradients: in tied_copies
        # In a block's backward: the gradients of its output and of its input (none for
        # the model's inputs: no batch tensor requires one); and the stage input's
        # gradient of the previous micro-batch, held until its send ends.
        input_grad = tab.grad_boundary[i] * scale if i > 0 else 0.0
        first_pair = tab.output[i] * scale + input_grad
        pair = max(first_pair, tab.grad_pair(i + 1, j)[0]) if j > i + 1 else first_pair
        grad_tmp = pair + input_grad
        # The first backward: gradients of blocks >= k, activations of blocks <= k.
        _, k = tab.backward_curve(i, j)
        first_grads = tab.grads[j] - tab.grads[k]
        first_acts = tab.act[k + 1] - tab.act[i]
        first = recv + (n - 1) * per_mb + first_acts + loss - saved + grad_tmp
        moments = [(first_grads, first, "bwd")]
        if not last:  # the forwards' end: GPipe still holds every dense copy it sent
            copies = (m if b.layout.schedule == "gpipe" else 1) * tab.copied[j] * scale
            moments.append((0.0, recv + n * per_mb + copies, "bwd"))
        out_grads = 2 * stage_output * scale
        if last:  # the loss's backward opens it: no gradients yet, two output-sized ones
            moments.append((0.0, recv + (n - 1) * per_mb + acts + loss + out_grads, "bwd"))
        if m > 1:  # a later micro-batch's backward: every gradient exists, and a new one
            later = n if m > n else n - 1  # in flight then, the one run backward among them
            new = self._largest(s, i, j) / b.param_elem * b.grads_b
            grads = all_grads
            if b.fsdp and b.cast_b:  # [Note: FSDP as it runs]: those so far kept in bf16
                whole = b.held_parameters(s, i, j)
                grads, new = all_grads + whole * b.wire_b, 0.0
            # The micro-batch run backward: whole before its backward; at block k's, its
            # activations of blocks ..k and block k's new gradient (the largest block's
            # when it is early: an embedding, on a language model's first stage).
            before = recv + (later - 1) * per_mb + loss + acts
            current = min(acts + new, tab.later_curve(i, j)[0] - tab.act[i]) if new else acts
            held = before - acts + current
            moments.append((grads, held - saved + grad_tmp, "bwd"))
            if last:  # the loss's backward: no parameter's gradient in the making yet
                moments.append((grads, before + out_grads, "bwd"))
            if b.layout.schedule == "gpipe" and m > 2 and i > 0:
                # GPipe waits for its backward sends after the last backward: then the m - 1
                # earlier micro-batches' input gradients are held (grad_tmp counts one).
                earlier = (m - 2) * input_grad
                moments.append((grads, recv + loss + current - saved + grad_tmp + earlier, "bwd"))
                if last:
                    moments.append((grads, recv + loss + acts + out_grads + earlier, "bwd"))
        temp = self._optimizer_temp(s, i, j)
        if b.fsdp:  # the whole gradients and the reduce-scatter's output; then shards only
            dp = b.layout.dp
            moments.append((all_grads * (1 + 1 / dp), recv, "rs"))
            return [*moments, (all_grads / dp, recv + temp / dp, "step")]
        sent = b.stepped(s, i, j) * b.weights_b if b.sharded else 0.0  # ZeRO-1's flat send
        return [*moments, (all_grads, recv + max(temp, sent), "step")]

    def _batch(self, s: int, i: int, j: int) -> float:
        """Bytes of the batch stage s holds all step besides its first stage's inputs (in
        its receive buffers).

        [Note: the batch a process holds] The last stage moves its replica's targets to
        its device (m micro-batches of them). On a CPU the process's memory is the
        device's, and every stage holds its replica's whole batch, inputs and targets, as
        the runtime's feed hands it (runtime.data: a copy of the replica's slice; a
        small BERT's last stage, a 1 KiB classifier alone, measured 18.3 KiB with the
        global batch held, 9.3 predicted without it).
        """
        b = self.b
        tab, m, last = b.table(s), b.layout.micro_batches, j == b.n_blocks
        if self._host[s]:
            return m * ((tab.input_bytes if i > 0 else 0.0) + tab.target_bytes)
        return m * tab.target_bytes if last else 0.0

    def _held(self, s: int, i: int, j: int) -> dict[str, dict[str, float]]:
        """Per moment (:meth:`_moments`' when), the weights, optimizer state, tied copies'
        and DDP's buckets' bytes of blocks [i, j), as ``MemoryBreakdown``'s fields.

        With ZeRO-1 a replica holds the state of its share only, tied copies'
        included ([Note: ZeRO-1 shares]); with DDP it holds all. With FSDP a shard
        of every weight, gradient and state, and from the first forward to the last
        backward the weights whole as well; tied copies alike ([Note: FSDP as it
        runs]). No buckets with FSDP, nor with one replica.
        """
        b = self.b
        n, tied = b.parameters(s, i, j), b.tied_copy_bytes(i, j) / b.param_elem
        if b.fsdp:
            dp, w, g, o = b.layout.dp, b.weights_b, b.grads_b, b.optim_b
            whole = w * (1 + 1 / dp) + b.cast_b  # gathered, beside the shard, and cast
            kept = {"optimizer": n * o / dp, "comm_buffers": 0.0}
            rs_g = g * (1 + 1 / dp)  # the whole gradients and the reduce-scatter's output
            return {
                "bwd": kept | {"params": n * whole, "tied_copies": tied * (whole + g + o / dp)},
                "rs": kept | {"params": n * whole, "tied_copies": tied * (whole + rs_g + o / dp)},
                "step": kept | {"params": n * w / dp, "tied_copies": tied * (w + g + o) / dp},
            }
        copies = tied * (b.weights_b + b.cast_b + b.grads_b)
        state = b.stepped(s, i, j) * b.optim_b  # ZeRO-1: the share's, tied copies' included
        if not b.sharded:
            state, copies = n * b.optim_b, copies + tied * b.optim_b
        buckets = (n + tied) * b.grads_b if b.layout.dp > 1 else 0.0
        kinds: dict[str, float] = {"params": n * (b.weights_b + b.cast_b), "optimizer": state}
        kinds |= {"tied_copies": copies, "comm_buffers": buckets}
        return dict.fromkeys(("bwd", "step"), kinds)

    def floor(self, s: int, i: int, j: int) -> float:
        """Bytes stage s holds at its peak whatever else, non-decreasing in j: the weights
        (and their bf16 copy; with FSDP gathered beside the shard), optimizer state (with
        ZeRO-1 at least 1/dp of it, with FSDP 1/dp), buffers and DDP's buckets of blocks
        [i, j), and the larger of all their gradients (the optimizer step; FSDP's
        reduce-scatter) and what the first backward holds at its worst block k (the
        gradients of the blocks after k, the activations of the blocks up to k:
        recomputed or not, one micro-batch's)."""
        b = self.b
        tab = b.table(s)
        n_params, dp = b.parameters(s, i, j), b.layout.dp
        optim_b = b.optim_b / dp if b.sharded or b.fsdp else b.optim_b  # a share holds ≥ n / dp
        if b.fsdp:
            per = b.weights_b * (1 + 1 / dp) + b.cast_b + optim_b
        else:
            per = b.weights_b + b.cast_b + optim_b + (b.grads_b if dp > 1 else 0)
        first = tab.grads[j] - tab.act[i] + tab.backward_curve(i, j)[0]
        held = max(n_params * b.grads_b, first)
        return n_params * per + tab.buffers[j] - tab.buffers[i] + held

    def _optimizer_temp(self, s: int, i: int, j: int) -> float:
        """Temporaries of the optimizer step (bytes): [Note: optimizer temporaries]."""
        b = self.b
        if b.training.optimizer == "sgd":
            return 0.0
        if b.cluster.backend != "gloo":
            return 0.0  # GPUs: not measured here (see the note)
        return 2 * self._largest(s, i, j) / b.param_elem * 4  # two of the largest, fp32

    def _largest(self, s: int, i: int, j: int) -> float:
        """Bytes of the largest tensor blocks [i, j) train: a block's parameters, or a tied one."""
        return max([self.b.table(s).max_params(i, j)[0], *self.b.tied_in(i, j)])

    def recompute(self, s: int, i: int, j: int) -> bool:
        """Recompute exactly when the stage does not fit without it.

        Also when it does not fit with it either: that segment is infeasible anyway,
        and costing it with recompute keeps a segment's work at least its parts'
        (the partition heuristic's bisection relies on that), and its memory the
        smaller figure the user would have to fit.
        """
        return self.peak(s, i, j).total > self.b.capacity[s]
