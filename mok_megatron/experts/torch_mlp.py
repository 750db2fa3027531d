"""The ``torch`` expert backend (bf16): the experts' MLP on ``torch._grouped_mm``, with Megatron's schedule
hooks: delayed weight gradients and activation recompute.

Legend: R rows (grouped by local expert), H expert width, F1 fc1 rows (2F with a GLU), F FFN width,
L local experts.

Weights: ``w1_LFH`` ``[L, F1, H]`` (F1 = 2F with a GLU: gate rows then up rows, Megatron's layout) and
``w2_LHF`` ``[L, H, F]``. Slice ``[l]`` of each is expert ``l``'s ``linear_fc1.weight`` /
``linear_fc2.weight`` in Megatron's ``SequentialMLP``.

``expert_mlp`` runs the MLP; where a schedule hook is on, its GEMMs are autograd functions of their own:

``delay_wgrad_compute`` (Megatron's contract, as in ``TEGroupedMLP`` / TE's ``GroupedLinear``): the
backward of each grouped GEMM computes only the input gradient and leaves the weight gradient as a
``WgradTask`` in the module's ``WgradQueue``; ``MoKGroupedMLP.backward_dw()`` runs the queued tasks
later (Megatron's combined 1F1B schedule calls it after the layer's backward) and accumulates them
into ``param.grad`` exactly as autograd would have: tasks summed in the order backward produced them,
then added to the existing gradient, so the result is bitwise the non-delayed one.

``recompute_modules`` containing ``moe_act`` (Megatron's selective activation recompute): fc2 saves the
fc1 output ``h`` instead of the activation output; backward recomputes ``act(h) * probs`` from ``h``
and runs its backward (the same ops, so the gradients are bitwise those without recompute). Saved:
the activation's output ``[R, F]`` and every intermediate the activation keeps for its backward.

Both use torch's grouped GEMM kernel (``mok_megatron.ops.grouped_gemm``). Where the kernel cannot run
(fp64, strides not 16-byte aligned, pre-Hopper CUDA) the per-expert reference is used and the deferred
weight gradient is recomputed through it (correct, one extra GEMM).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mok_megatron.experts.common import scale_input
from mok_megatron.ops import grouped_gemm as gg
from mok_megatron.ops.activation import ActivationSpec, apply_activation


@dataclass
class WgradTask:
    """One deferred weight gradient: ``dW = f(dy, x)`` for parameter ``weight``."""

    weight: torch.nn.Parameter
    compute: Callable[[], torch.Tensor]


class WgradQueue:
    """Deferred weight gradients of one module, in the order backward produced them."""

    def __init__(self):
        self.tasks: list[WgradTask] = []

    def __len__(self) -> int:
        return len(self.tasks)

    def push(self, weight: torch.nn.Parameter, compute: Callable[[], torch.Tensor]) -> None:
        self.tasks.append(WgradTask(weight, compute))

    def sums(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Compute every queued weight gradient and empty the queue: ``{id(weight): (weight, sum)}``,
        each weight's gradients summed in production order (as autograd's engine sums them)."""
        tasks, self.tasks = self.tasks, []
        sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for task in tasks:
            dw = task.compute()
            key = id(task.weight)
            if key in sums:
                sums[key] = (task.weight, sums[key][1] + dw)
            else:
                sums[key] = (task.weight, dw)
        return sums

    def run(self) -> list[torch.nn.Parameter]:
        """Compute every queued weight gradient and accumulate it into ``param.grad``, as autograd's
        engine does: per parameter, sum in production order, then add to the existing gradient.
        Returns the parameters that received a gradient."""
        sums = self.sums()
        with torch.no_grad():
            for weight, dw in sums.values():
                if weight.grad is None:
                    weight.grad = dw
                else:
                    weight.grad += dw
        return [w for w, _ in sums.values()]


def _wgrad_fn(dy_MN, x_MK, w_GNK, offs_G) -> Callable[[], torch.Tensor]:
    """The deferred weight gradient of ``y = grouped_linear(x, w)`` for upstream ``dy``."""
    if x_MK.shape[0] == 0:
        return lambda: torch.zeros_like(w_GNK)
    if gg.kernel_supports(x_MK, w_GNK):
        return lambda: gg._wgrad(dy_MN, x_MK, offs_G)

    def through_reference():  # the same ops as the reference's own backward
        counts = torch.diff(offs_G.long(), prepend=offs_G.new_zeros(1, dtype=torch.long)).tolist()
        with torch.enable_grad():
            w = w_GNK.detach().requires_grad_(True)
            (dw,) = torch.autograd.grad(gg.grouped_linear_reference(x_MK, w, counts), w, dy_MN)
        return dw

    return through_reference


def _dgrad(dy_MN, x_MK, w_GNK, offs_G) -> torch.Tensor:
    if x_MK.shape[0] == 0:
        return x_MK.new_zeros(x_MK.shape)
    if gg.kernel_supports(x_MK, w_GNK):
        return gg._dgrad(dy_MN, w_GNK, offs_G)
    counts = torch.diff(offs_G.long(), prepend=offs_G.new_zeros(1, dtype=torch.long)).tolist()
    with torch.enable_grad():
        x = x_MK.detach().requires_grad_(True)
        (dx,) = torch.autograd.grad(gg.grouped_linear_reference(x, w_GNK.detach(), counts), x, dy_MN)
    return dx


def _forward_gemm(x_MK, w_GNK, offs_G) -> torch.Tensor:
    if x_MK.shape[0] == 0:
        return x_MK.new_zeros((0, w_GNK.shape[1]))
    if gg.kernel_supports(x_MK, w_GNK):
        return gg._fwd(x_MK, w_GNK, offs_G)
    counts = torch.diff(offs_G.long(), prepend=offs_G.new_zeros(1, dtype=torch.long)).tolist()
    return gg.grouped_linear_reference(x_MK, w_GNK, counts)


def _finish_wgrad(queue, param, w, dy, x, offs, needed: bool):
    """The weight gradient to return now (None when deferred to ``queue`` for ``param``)."""
    if not needed:
        return None
    fn = _wgrad_fn(dy, x, w, offs)
    if queue is None:
        return fn()
    queue.push(param, fn)
    return None


# The parameter itself rides on ctx (not only in save_for_backward): under saved-tensor hooks (Megatron's
# activation offloading, memory probes) ctx.saved_tensors may hand back another tensor object with the
# same data, and a deferred gradient must land on the Parameter's .grad.


class _Linear(torch.autograd.Function):
    """``grouped_linear`` whose weight gradient may be deferred to a ``WgradQueue``."""

    @staticmethod
    def forward(ctx, x_MK, w_GNK, offs_G, queue):
        ctx.save_for_backward(x_MK, w_GNK, offs_G)
        ctx.queue, ctx.param = queue, w_GNK if queue is not None else None
        return _forward_gemm(x_MK, w_GNK, offs_G)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_GNK, offs_G = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dx = _dgrad(dy_MN, x_MK, w_GNK, offs_G) if ctx.needs_input_grad[0] else None
        dw = _finish_wgrad(ctx.queue, ctx.param, w_GNK, dy_MN, x_MK, offs_G, ctx.needs_input_grad[1])
        return dx, dw, None, None


class _ActFc2(torch.autograd.Function):
    """``fc2(act(h) * probs)`` saving ``h`` (not the activation output): backward recomputes it."""

    @staticmethod
    def forward(ctx, h_MF1, probs_M, w2_GNK, offs_G, act: ActivationSpec, queue):
        with torch.no_grad():
            a_MF = apply_activation(h_MF1, act, probs_M)
            y = _forward_gemm(a_MF, w2_GNK, offs_G)
        ctx.save_for_backward(h_MF1, probs_M, w2_GNK, offs_G)
        ctx.act, ctx.queue, ctx.param = act, queue, w2_GNK if queue is not None else None
        return y

    @staticmethod
    def backward(ctx, dy_MN):
        h_MF1, probs_M, w2_GNK, offs_G = ctx.saved_tensors
        need_h, need_p, need_w = ctx.needs_input_grad[:3]
        dy_MN = dy_MN.contiguous()
        with torch.enable_grad():
            h = h_MF1.detach().requires_grad_(need_h)
            p = probs_M.detach().requires_grad_(need_p)
            a_MF = apply_activation(h, ctx.act, p)
        a = a_MF.detach()
        dw2 = _finish_wgrad(ctx.queue, ctx.param, w2_GNK, dy_MN, a, offs_G, need_w)
        dh = dp = None
        inputs = [t for t, need in ((h, need_h), (p, need_p)) if need]
        if inputs:
            da = _dgrad(dy_MN, a, w2_GNK, offs_G)
            grads = list(torch.autograd.grad(a_MF, inputs, da, allow_unused=True))
            dh = grads.pop(0) if need_h else None
            dp = grads.pop(0) if need_p else None
        return dh, dp, dw2, None, None, None


def expert_mlp(
    x_RH: torch.Tensor,
    probs_R: torch.Tensor,
    tokens_per_expert_L: torch.Tensor,
    w1_LFH: torch.Tensor,
    w2_LHF: torch.Tensor,
    act: ActivationSpec,
    *,
    apply_probs_on_input: bool = False,
    recompute_activation: bool = False,
    wgrad_queue: WgradQueue | None = None,
) -> torch.Tensor:
    """``fc2(act(fc1(x)) * probs)`` per local expert.

    Inputs: x_RH [R, H], probs_R [R] (router dtype), tokens_per_expert_L [L] (any device, sums to R).
    Output: y_RH [R, H] in x's dtype, already scaled by the router probabilities. ``wgrad_queue``: the
    weight gradients are deferred to it (Megatron's ``delay_wgrad_compute``); ``recompute_activation``:
    the activation is recomputed in backward (``moe_act``). Without either, autograd's own backward."""
    if x_RH.shape[0] != probs_R.shape[0]:
        raise ValueError(f"expert_mlp: {x_RH.shape[0]} rows but {probs_R.shape[0]} probabilities")
    if tokens_per_expert_L.shape != (w1_LFH.shape[0],):
        raise ValueError(
            f"expert_mlp: tokens_per_expert has shape {tuple(tokens_per_expert_L.shape)}, "
            f"expected ({w1_LFH.shape[0]},) for {w1_LFH.shape[0]} local experts"
        )
    offs_L = gg.offsets_from_counts(tokens_per_expert_L, x_RH.device)
    if apply_probs_on_input:
        x_RH, probs_R = scale_input(x_RH, probs_R)
    if not recompute_activation and wgrad_queue is None:
        h = gg.grouped_linear(x_RH, w1_LFH, offs_L)
        return gg.grouped_linear(apply_activation(h, act, probs_R), w2_LHF, offs_L)
    h = _Linear.apply(x_RH.contiguous(), w1_LFH, offs_L, wgrad_queue)
    if recompute_activation:
        return _ActFc2.apply(h, probs_R, w2_LHF, offs_L, act, wgrad_queue)
    return _Linear.apply(apply_activation(h, act, probs_R), w2_LHF, offs_L, wgrad_queue)
