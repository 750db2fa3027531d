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

``gradient_accumulation_fusion`` (Megatron's default; ``MoKGroupedMLP`` passes ``main_grad_owners``
when it is on and the weights have ``main_grad``): each weight-gradient GEMM adds straight into the fp32
``param.main_grad`` (``ops.wgrad_accumulate``: QuACK's varlen-K GEMM on Hopper, torch's grouped GEMM
elsewhere) and backward returns Megatron's dummy gradient (``experts.main_grad``), so neither autograd
nor DDP's hook sums or adds full-size gradients. Queued (delayed or late) tasks accumulate when they
run; the owner is the real Parameter even where the GEMM's weight is a late-wgrad stand-in.

Both use torch's grouped GEMM kernel (``mok_megatron.ops.grouped_gemm``). Where the kernel cannot run
(fp64, strides not 16-byte aligned, pre-Hopper CUDA) the per-expert reference is used and the deferred
weight gradient is recomputed through it (correct, one extra GEMM).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mok_megatron.experts.common import scale_input
from mok_megatron.experts.main_grad import fused_wgrad_result
from mok_megatron.ops import grouped_gemm as gg
from mok_megatron.ops.activation import ActivationSpec, apply_activation
from mok_megatron.ops.wgrad_accumulate import grouped_wgrad_accumulate_


@dataclass
class WgradTask:
    """One deferred weight gradient: ``dW = f(dy, x)`` for ``weight`` (the Parameter, or a late-wgrad
    stand-in). With ``main_grad_of`` (gradient accumulation fusion), ``compute`` adds dW into that
    Parameter's ``main_grad`` itself and returns None."""

    weight: torch.Tensor
    compute: Callable[[], torch.Tensor | None]
    main_grad_of: torch.nn.Parameter | None = None
    # (dy_MN, x_MK, offs_G, main_grad or None) where dW is torch's grouped GEMM of these: a queue that merges
    # calls (``WgradQueue(merge_calls=True)``) runs such tasks of one weight as one GEMM over all their rows
    operands: tuple | None = None


class WgradQueue:
    """Deferred weight gradients of one module, in the order backward produced them.

    ``merge_calls``: the tasks of one weight that are torch grouped GEMMs (``WgradTask.operands``) run as one
    grouped GEMM over all their rows, gathered group by group (``ops.grouped_gemm.concat_groups``), instead
    of one GEMM per task and a full-size sum per extra task, where the gather moves fewer bytes than the
    sums (``_merge_pays``). The result equals the per-task sum up to the order of the additions (and is
    bitwise repeatable run to run). Why: one layer call's weight gradients in 4 expert calls cost 5.83 ms
    summed against 5.41 merged and 3.79 in one call (DeepSeek-V3 EP slice), 5.50 / 3.81 / 1.88 ms
    (Qwen3-30B-A3B, 128 experts) on an H200 (``benchmarks/wgrad.py``); with few, small experts the gather costs
    more than the sums it saves."""

    def __init__(self, merge_calls: bool = False):
        self.tasks: list[WgradTask] = []
        self.merge_calls = merge_calls

    def __len__(self) -> int:
        return len(self.tasks)

    def push(
        self,
        weight: torch.Tensor,
        compute: Callable[[], torch.Tensor | None],
        main_grad_of: torch.nn.Parameter | None = None,
        operands: tuple | None = None,
    ) -> None:
        self.tasks.append(WgradTask(weight, compute, main_grad_of, operands))

    @staticmethod
    def _merged(tasks: list[WgradTask]) -> list[WgradTask]:
        """``tasks`` with each weight's mergeable tasks (two or more, all grouped GEMMs into the same
        sink) replaced by one task at the place of the weight's first."""
        by_weight: dict[int, list[WgradTask]] = {}
        for task in tasks:
            by_weight.setdefault(id(task.weight), []).append(task)
        out, done = [], set()
        for task in tasks:
            key = id(task.weight)
            group = by_weight[key]
            mergeable = (
                len(group) > 1
                and all(t.operands is not None for t in group)
                and len({id(t.main_grad_of) for t in group}) == 1
                and _merge_pays(group)
            )
            if not mergeable:
                out.append(task)
            elif key not in done:
                done.add(key)
                out.append(_merged_task(group))
        return out

    def drain(self) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor | None]], set[int]]:
        """Run every task in production order and empty the queue: the per-weight results (see ``sums``)
        and the ids of the weights whose gradients went into ``main_grad``."""
        tasks, self.tasks = self.tasks, []
        if self.merge_calls:
            tasks = self._merged(tasks)
        sums: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        fused: dict[int, tuple[torch.Tensor, torch.nn.Parameter]] = {}
        for task in tasks:
            dw = task.compute()
            key = id(task.weight)
            if task.main_grad_of is not None:
                fused[key] = (task.weight, task.main_grad_of)
            elif key in sums:
                sums[key] = (task.weight, sums[key][1] + dw)
            else:
                sums[key] = (task.weight, dw)
        for key, (weight, owner) in fused.items():
            if key in sums:
                raise RuntimeError(
                    f"WgradQueue: weight of shape {tuple(weight.shape)} has gradients both accumulated into "
                    "main_grad and returned; its main_grad appeared or vanished between forward calls of one "
                    "backward. Attach main_grad (Megatron's DDP) before the first forward."
                )
            sums[key] = (weight, fused_wgrad_result(owner))
        return sums, set(fused)

    def sums(self) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        """Compute every queued weight gradient and empty the queue: ``{id(weight): (weight, sum)}``,
        each weight's gradients summed in production order (as autograd's engine sums them). For a
        weight whose tasks added into ``main_grad``, the sum is Megatron's dummy gradient, or None
        (``experts.main_grad.fused_wgrad_result``)."""
        return self.drain()[0]

    def run(self) -> list[torch.Tensor]:
        """Compute every queued weight gradient and accumulate it into ``param.grad``, as autograd's
        engine does: per parameter, sum in production order, then add to the existing gradient. A
        weight whose gradient went into ``main_grad`` gets the dummy as ``param.grad`` where it has none
        (what DDP's hook, run next by ``backward_dw``, expects and drops). Returns the weights run."""
        sums, fused = self.drain()
        with torch.no_grad():
            for key, (weight, dw) in sums.items():
                if dw is None:
                    continue
                if weight.grad is None:
                    weight.grad = dw
                elif key not in fused:  # a dummy carries no value
                    weight.grad += dw
        return [w for w, _ in sums.values()]


def _merge_pays(group: list[WgradTask]) -> bool:
    """Whether one GEMM over the gathered rows beats one GEMM per task plus the sums, by bytes: the gather
    moves every operand row (``rows x (N + K)`` elements), the sums ``len - 1`` full-size gradients.
    Measured on an H200 in the pipeline (``benchmarks/overlap.py``, late-wgrad): DeepSeek-V3's slice (8 experts
    of 7168 x 2048) gains 0.4-0.5 ms at 4 calls and loses 0.6-0.8 ms at 2, where the rule merges only at 4;
    Qwen3's EP=8 slice (16 experts of 2048 x 768, 16k tokens) loses 1.3-1.6 ms merged, where the rule never
    merges."""
    dy_MN, x_MK = group[0].operands[0], group[0].operands[1]
    rows = sum(t.operands[0].shape[0] for t in group)
    return rows * (dy_MN.shape[1] + x_MK.shape[1]) <= (len(group) - 1) * group[0].weight.numel()


def _merged_task(group: list[WgradTask]) -> WgradTask:
    """One task computing the weight gradient of all of ``group``'s grouped GEMMs as one GEMM."""
    first = group[0]
    parts = [([t.operands[0], t.operands[1]], t.operands[2]) for t in group]
    main_grad = first.operands[3]

    def compute():
        (dy_MN, x_MK), offs_G = gg.concat_groups(parts)
        if main_grad is not None:
            grouped_wgrad_accumulate_(main_grad, dy_MN, x_MK, offs_G)
            return None
        if x_MK.shape[0] == 0:
            return torch.zeros_like(first.weight)
        return gg._wgrad(dy_MN, x_MK, offs_G)

    return WgradTask(first.weight, compute, first.main_grad_of, None)


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


def _finish_wgrad(queue, param, w, dy, x, offs, needed: bool, owner=None, main_grad=None, dummy=True):
    """The weight gradient to return now (None when deferred to ``queue`` for ``param``). With ``owner``
    (gradient accumulation fusion) dW is added into ``main_grad`` (``owner.main_grad`` as of forward, or
    a group's slice of it) now or when the queue runs, and the gradient returned is Megatron's dummy (or
    None; always None for a group's slice, ``dummy`` False: ``experts.groups`` hands the dummy)."""
    if not needed:
        return None
    if owner is not None:

        def accumulate():
            grouped_wgrad_accumulate_(main_grad, dy, x, offs)

        if queue is None:
            accumulate()
            return fused_wgrad_result(owner) if dummy else None
        queue.push(param, accumulate, main_grad_of=owner, operands=_operands(dy, x, w, offs, main_grad))
        return None
    fn = _wgrad_fn(dy, x, w, offs)
    if queue is None:
        return fn()
    queue.push(param, fn, operands=_operands(dy, x, w, offs, None))
    return None


def _operands(dy, x, w, offs, main_grad) -> tuple | None:
    """A task's ``operands`` where its weight gradient is torch's grouped GEMM (the kernel runs)."""
    return (dy, x, offs, main_grad) if gg.kernel_supports(x, w) else None


# The parameter itself rides on ctx (not only in save_for_backward): under saved-tensor hooks (Megatron's
# activation offloading, memory probes) ctx.saved_tensors may hand back another tensor object with the
# same data, and a deferred gradient must land on the Parameter's .grad. ``owner`` (fusion: the Parameter
# whose main_grad receives dW) and its main_grad, taken at forward as Megatron's linears take it, ride on ctx
# too.


def _keep_owner(ctx, owner, main_grad_range=None) -> None:
    ctx.owner = owner
    ctx.main_grad = owner.main_grad if owner is not None else None
    ctx.dummy = main_grad_range is None
    if ctx.main_grad is not None and main_grad_range is not None:
        lo, hi = main_grad_range
        ctx.main_grad = ctx.main_grad[lo:hi]


class _Linear(torch.autograd.Function):
    """``grouped_linear`` whose weight gradient may be deferred to a ``WgradQueue`` and may accumulate into
    ``owner.main_grad``."""

    @staticmethod
    def forward(ctx, x_MK, w_GNK, offs_G, queue, owner, main_grad_range=None):
        ctx.save_for_backward(x_MK, w_GNK, offs_G)
        ctx.queue, ctx.param = queue, w_GNK if queue is not None else None
        _keep_owner(ctx, owner, main_grad_range)
        return _forward_gemm(x_MK, w_GNK, offs_G)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_GNK, offs_G = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dx = _dgrad(dy_MN, x_MK, w_GNK, offs_G) if ctx.needs_input_grad[0] else None
        need_w = ctx.needs_input_grad[1]
        dw = _finish_wgrad(
            ctx.queue, ctx.param, w_GNK, dy_MN, x_MK, offs_G, need_w, ctx.owner, ctx.main_grad, ctx.dummy
        )
        return dx, dw, None, None, None, None


class _ActFc2(torch.autograd.Function):
    """``fc2(act(h) * probs)`` saving ``h`` (not the activation output): backward recomputes it."""

    @staticmethod
    def forward(ctx, h_MF1, probs_M, w2_GNK, offs_G, act: ActivationSpec, queue, owner, main_grad_range=None):
        with torch.no_grad():
            a_MF = apply_activation(h_MF1, act, probs_M, offs_G[-1:])
            y = _forward_gemm(a_MF, w2_GNK, offs_G)
        ctx.save_for_backward(h_MF1, probs_M, w2_GNK, offs_G)
        ctx.act, ctx.queue, ctx.param = act, queue, w2_GNK if queue is not None else None
        _keep_owner(ctx, owner, main_grad_range)
        return y

    @staticmethod
    def backward(ctx, dy_MN):
        h_MF1, probs_M, w2_GNK, offs_G = ctx.saved_tensors
        need_h, need_p, need_w = ctx.needs_input_grad[:3]
        dy_MN = dy_MN.contiguous()
        with torch.enable_grad():
            h = h_MF1.detach().requires_grad_(need_h)
            p = probs_M.detach().requires_grad_(need_p)
            a_MF = apply_activation(h, ctx.act, p, offs_G[-1:])
        a = a_MF.detach()
        dw2 = _finish_wgrad(
            ctx.queue, ctx.param, w2_GNK, dy_MN, a, offs_G, need_w, ctx.owner, ctx.main_grad, ctx.dummy
        )
        dh = dp = None
        inputs = [t for t, need in ((h, need_h), (p, need_p)) if need]
        if inputs:
            da = _dgrad(dy_MN, a, w2_GNK, offs_G)
            grads = list(torch.autograd.grad(a_MF, inputs, da, allow_unused=True))
            dh = grads.pop(0) if need_h else None
            dp = grads.pop(0) if need_p else None
        return dh, dp, dw2, None, None, None, None, None


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
    main_grad_owners: tuple[torch.nn.Parameter | None, torch.nn.Parameter | None] | None = None,
    main_grad_range: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``fc2(act(fc1(x)) * probs)`` per local expert.

    Inputs: x_RH [R, H], probs_R [R] (router dtype), tokens_per_expert_L [L] (any device, sums to R).
    Output: y_RH [R, H] in x's dtype, already scaled by the router probabilities. ``wgrad_queue``: the
    weight gradients are deferred to it (Megatron's ``delay_wgrad_compute``); ``recompute_activation``:
    the activation is recomputed in backward (``moe_act``); ``main_grad_owners`` (fc1's, fc2's; None
    for a weight without fusion): the Parameters whose ``main_grad`` receives each weight gradient
    (gradient accumulation fusion; the GEMM weights may be stand-ins of them); ``main_grad_range``: the
    weights are local experts ``[lo, hi)`` of those Parameters (a group of ``experts.groups``), whose
    slice of ``main_grad`` receives them, and no dummy gradient is returned. Without any of these,
    autograd's own backward."""
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
    # rows past the last offset are a sync-free buffer's spare rows, which no GEMM reads: the fused
    # activation skips them
    live = offs_L[-1:] if offs_L.numel() else None
    own1, own2 = main_grad_owners or (None, None)
    if main_grad_range is not None and wgrad_queue is not None:
        raise ValueError(
            "expert_mlp: a group of experts (main_grad_range) with a weight-gradient queue: queued tasks "
            "hold whole weights; run expert groups without delayed or late weight gradients."
        )
    if not recompute_activation and wgrad_queue is None and own1 is None and own2 is None:
        h = gg.grouped_linear(x_RH, w1_LFH, offs_L)
        return gg.grouped_linear(apply_activation(h, act, probs_R, live), w2_LHF, offs_L)
    rng = main_grad_range
    h = _Linear.apply(x_RH.contiguous(), w1_LFH, offs_L, wgrad_queue, own1, rng)
    if recompute_activation:
        return _ActFc2.apply(h, probs_R, w2_LHF, offs_L, act, wgrad_queue, own2, rng)
    return _Linear.apply(apply_activation(h, act, probs_R, live), w2_LHF, offs_L, wgrad_queue, own2, rng)
