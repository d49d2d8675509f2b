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
    tied copies (counted whole all step).
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

    def peak(self, s: int, i: int, j: int, recompute: bool = False) -> MemoryBreakdown:
        """The peak of live tensor bytes on a device of stage s holding blocks [i, j).

        [Note: the memory peak] Weights, optimizer state, buffers, DDP's buckets
        and the pipeline's receive buffers live all step; gradients and
        activations come and go, so the peak is the largest of these moments:

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
          (examples/gpt.py at pp 2: 16 MiB, 8 and 11 % of the stages' peaks);
        * **the optimizer step**: all gradients, the optimizer's temporaries; with
          ZeRO-1 then a replica's share of the weights, flat, as it is sent.

        Per micro-batch in flight: the blocks' saved activations (each tensor
        once, charged to the block that made it), and on the last stage the
        model's output and what the loss saves (cross-entropy keeps its
        log-softmax, MSE its difference: about the output's size). Receive
        buffers: torch's pipelining keeps one input buffer per micro-batch on
        every stage after the first, and one output-gradient buffer per
        micro-batch on every stage before the last (the first stage holds the
        replica's batch instead). Backward moments add a block's output and
        input gradients (the largest pair) and, after the first stage, the last
        input gradient still being sent. With recompute, micro-batches in flight
        keep only their inputs; the one run backward is recomputed first.
        """
        b = self.b
        tab = b.table(s)
        last = j == b.n_blocks
        n_params = b.parameters(s, i, j)
        scale = b.act_scale
        m, n = b.layout.micro_batches, b.layout.in_flight(s)
        stage_input = tab.boundary[i] if i > 0 else tab.input_bytes
        stage_output = tab.output[j - 1] if last else tab.boundary[j]
        recv = m * (stage_input + (0.0 if last else stage_output)) * scale
        acts = tab.act[j] - tab.act[i]
        loss = 2 * stage_output * scale if last else 0.0  # the output, and what the loss saves
        per_mb = (0.0 if recompute else acts) + loss
        all_grads = n_params * b.grads_b  # tied copies' gradients: in tied_copies
        # In a block's backward: the gradients of its output and of its input; and the
        # stage input's gradient of the previous micro-batch, held until its send ends.
        first_pair = (tab.output[i] + stage_input) * scale
        pair = max(first_pair, tab.grad_pair(i + 1, j)[0]) if j > i + 1 else first_pair
        grad_tmp = pair + (stage_input * scale if i > 0 else 0.0)
        # The first backward: gradients of blocks >= k, activations of blocks <= k.
        _, k = tab.backward_curve(i, j)
        first_grads = tab.grads[j] - tab.grads[k]
        first_acts = tab.act[k + 1] - tab.act[i]
        moments = [(first_grads, recv + (n - 1) * per_mb + first_acts + loss + grad_tmp)]
        out_grads = 2 * stage_output * scale
        if last:  # the loss's backward opens it: no gradients yet, two output-sized ones
            moments.append((0.0, recv + (n - 1) * per_mb + acts + loss + out_grads))
        if m > 1:  # a later micro-batch's backward: every gradient exists, and a new one
            later = n if m > n else n - 1  # in flight then, the one run backward among them
            new = self._largest(s, i, j) / b.param_elem * b.grads_b
            held = recv + later * per_mb + (acts if recompute else 0) + new
            moments.append((all_grads, held + grad_tmp))
            if last:
                moments.append((all_grads, held + out_grads))
        state, sent = self._state(s, i, j)  # sent: after the optimizer's temporaries
        moments.append((all_grads, recv + max(self._optimizer_temp(s, i, j), sent)))
        grads, activations = max(moments, key=lambda g_a: g_a[0] + g_a[1])
        return MemoryBreakdown(
            params=n_params * (b.weights_b + b.cast_b),
            grads=grads,
            buffers=tab.buffers[j] - tab.buffers[i],
            activations=activations,
            **state,
        )

    def _state(self, s: int, i: int, j: int) -> tuple[dict[str, float], float]:
        """The optimizer state, tied copies' and DDP's buckets' bytes of blocks [i, j)
        (as ``MemoryBreakdown``'s fields), and the weights' send buffer.

        With ZeRO-1 a replica holds the state of its share only, tied copies'
        included, and sends its share's weights in one flat buffer after the
        step ([Note: ZeRO-1 shares]); with DDP it holds all, and sends nothing.
        """
        b = self.b
        n, tied = b.parameters(s, i, j), b.tied_copy_bytes(i, j) / b.param_elem
        copies = tied * (b.weights_b + b.cast_b + b.grads_b)
        buckets = (n + tied) * b.grads_b if b.layout.dp > 1 else 0.0
        if b.sharded:
            share = b.stepped(s, i, j)
            kinds = {"optimizer": share * b.optim_b, "tied_copies": copies}
            return kinds | {"comm_buffers": buckets}, share * b.weights_b
        kinds = {"optimizer": n * b.optim_b, "tied_copies": copies + tied * b.optim_b}
        return kinds | {"comm_buffers": buckets}, 0.0

    def floor(self, s: int, i: int, j: int) -> float:
        """Bytes stage s holds at its peak whatever else, non-decreasing in j: the weights
        (and their bf16 copy), optimizer state (with ZeRO-1 at least 1/dp of it), buffers
        and DDP's buckets of blocks [i, j), and the larger of all their gradients (the
        optimizer step) and what the first backward holds at its worst block k (the
        gradients of the blocks after k, the activations of the blocks up to k:
        recomputed or not, one micro-batch's)."""
        b = self.b
        tab = b.table(s)
        n_params = b.parameters(s, i, j)
        optim_b = b.optim_b / b.layout.dp if b.sharded else b.optim_b  # a share holds ≥ n / dp
        per = b.weights_b + b.cast_b + optim_b + (b.grads_b if b.layout.dp > 1 else 0)
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
