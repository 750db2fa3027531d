"""Late weight gradients: inside one pipelined layer call, the experts' weight gradients wait until the
last dispatch-backward exchange is in flight, and fill the time it flies.

Why: a pipelined layer's backward ends with the dispatch-backward exchange (each received row's input
gradient going home). With the weight gradients computed beside the input gradients (autograd's
default), the last expert call's backward ends with its weight-gradient GEMMs and only then hands its
input gradient to that exchange, so nothing is left to hide it: at one minibatch a whole exchange is
exposed. Here every expert GEMM's backward computes only its input gradient and queues its weight
gradient (``expert_schedule.WgradQueue``); the queue runs after the last dispatch-backward exchange
has been launched, on the compute stream, while the exchange flies on the communication stream.

How: ``LateWgrad.open()``, called by the pipeline after it packs every minibatch and before it creates
any expert call or dispatch-exchange autograd node, passes the experts' weights through one autograd
node (``_Gate``); the layer call's expert GEMMs use its outputs and queue their weight gradients in
``LateWgrad.queue``. Autograd runs ready nodes most recently created first, so ``_Gate``'s backward
runs after every dispatch-backward node (created later) has launched its exchange and before the
packs' backward (created earlier), which waits for those exchanges. There each weight's gradient is
one grouped GEMM over the rows of every expert call of the layer call (the calls' rows gathered group by
group, ``WgradQueue(merge_calls=True)``) where that gather moves fewer bytes than the full-size sums it
replaces (``experts.torch_mlp._merge_pays``), else one GEMM per call plus the sums; the gate returns it
through autograd: ``AccumulateGrad`` and every hook on the weights (Megatron's DDP) run as without it. The
gradients equal the per-call sums up to the order of the additions (tested to fp32 rounding; bitwise at one
expert call, and bitwise repeatable run to run).

Cost: each expert GEMM's output gradient lives until ``_Gate`` runs (DeepSeek-V3's slice at 4096
tokens, 8 local experts: ~0.7 GB more at the peak), and a merged GEMM copies its weight's operand rows
(fc1 on DeepSeek's slice at 4096 tokens: x and dy, ~0.74 GB) while it runs. Opt-in (``--mok-late-wgrad``):
on one H200 with the loopback transport (CUDA graphs, sync-free) it gains 0.2-0.5 ms on DeepSeek-V3's 4k
slice at 4 minibatches (merged) and is within ±0.2 ms elsewhere (Qwen3's EP=8 slice; 2 minibatches),
docs/results/2026-12-02-late-wgrad-merge: the exchange's spin runs beside the weight gradients, but the
loopback's copies wait for them to finish. A real link is where it can pay. Not with Megatron's
``delay_wgrad_compute`` (its ``backward_dw`` already defers them further) nor with the FP8 / TE experts
(their GEMMs are not ``experts.torch_mlp``'s); ``MoKGroupedMLP.late_wgrad`` decides.

With gradient accumulation fusion the queued tasks add into the real Parameters' ``main_grad`` (the
tasks carry the Parameter; the stand-ins are views) and ``_Gate`` returns Megatron's dummy gradient for
each such weight (or None where DDP does not track it): a whole layer call's weight gradient is one
accumulating GEMM into ``main_grad``.
"""

from __future__ import annotations

import torch

from mok_megatron.experts.torch_mlp import WgradQueue


class LateWgrad:
    """The weight-gradient gate of one layer call. ``open()`` makes ``weights`` (stand-ins for the
    parameters, to use in this call's expert GEMMs) and an empty ``queue``; each call of ``open``
    starts over (an overflow redo runs the pipeline again).

    The autograd node keeps the queue and the stand-ins' ids, never this object: with a reference cycle
    (gate -> stand-ins -> node -> gate) a forward dropped without backward left the node to Python's
    garbage collector, which could then run inside a later CUDA graph capture and invalidate it."""

    def __init__(self, params: tuple[torch.nn.Parameter, ...]):
        self.params = params
        self.queue = WgradQueue(merge_calls=True)
        self.weights: tuple[torch.Tensor, ...] | None = None

    def open(self) -> None:
        self.queue = WgradQueue(merge_calls=True)
        stand_in_ids: list[int] = []
        self.weights = _Gate.apply(self.queue, stand_in_ids, *self.params)
        stand_in_ids.extend(id(w) for w in self.weights)


class _Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, queue: WgradQueue, stand_in_ids: list[int], *params):
        ctx.set_materialize_grads(False)  # the outputs' gradients are None: the queue holds them
        ctx.queue, ctx.stand_in_ids = queue, stand_in_ids
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        index = {key: i for i, key in enumerate(ctx.stand_in_ids)}
        out: list[torch.Tensor | None] = [None] * len(grads)
        sums, fused = ctx.queue.drain()
        for key, (weight, dw) in sums.items():
            if key not in index:
                raise RuntimeError(
                    "late weight gradients: a queued gradient belongs to no weight of this gate "
                    f"(shape {tuple(weight.shape)}); expert GEMMs must use LateWgrad.weights"
                )
            out[index[key]] = dw
        # A stand-in used outside the queue (never in MoK's experts): its gradient adds to the queued sum,
        # which under fusion is a dummy carrying no value, so there it would be lost.
        fused_slots = {index[key] for key in fused if key in index}
        for i, g in enumerate(grads):
            if g is None:
                continue
            if i in fused_slots:
                raise RuntimeError(
                    "late weight gradients: a weight whose queued gradients went into main_grad (gradient "
                    "accumulation fusion) also got a gradient outside the queue, which main_grad would not "
                    "receive; use LateWgrad.weights only in the expert GEMMs, or --no-gradient-accumulation-fusion."
                )
            out[i] = g if out[i] is None else out[i] + g
        return (None, None, *out)
