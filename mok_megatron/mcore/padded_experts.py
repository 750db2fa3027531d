"""The experts' MLP on per-expert padded rows: the FP8 backends (``--mok-expert-backend torch-fp8 | te``).

Legend: R real rows (expert-major, as the dispatcher delivers them), P rows of the padded buffer, H
hidden, F1 fc1 rows (2F with a GLU), F FFN width, L local experts, A alignment.

FP8 grouped GEMMs need every expert's row count to be a multiple of A (``fp8.backend.expert_alignment``).
The rows are scattered once into a zeroed ``[P, H]`` buffer by the device-side plan of ``fp8.align``
(the native path skips that buffer and the padded output gradient: its fc1 quantizes the real rows, and
its fc2's backward the real output gradient, straight into the padded FP8 layout,
``fp8.native.fp8_grouped_linear_padded / _gather``)
(no host read for the native path: ``P`` is the static bound ``num_rows_bound`` rounded up to A, the last
expert owning the spare rows, ``native_offsets``), the probabilities the
same way (padding rows get probability 0, so their activation output is 0 and they add nothing to any
gradient), fc1 -> activation * probs -> fc2 run on the padded buffer, and the real rows are gathered
back. The scatter/gather are autograd ops (index_copy / index_select), so backward is exact.

    native_expert_mlp   fc1/fc2 through ``fp8.native.fp8_grouped_linear`` (rowwise FP8, sm_90+)
    te_expert_mlp       fc1/fc2 through Megatron's TE GroupedLinear wrappers (``mcore.te_experts``)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mok_megatron.fp8.align import PadPlan, pad_plan, pad_rows, unpad_rows
from mok_megatron.kernels.routing import num_rows_bound
from mok_megatron.ops.activation import ActivationSpec, apply_activation

# fc(x_PK, plan) -> y_PN
GemmFn = Callable[[torch.Tensor, PadPlan], torch.Tensor]


def pad_probs(probs_R: torch.Tensor, plan: PadPlan) -> torch.Tensor:
    """``[R]`` probabilities -> ``[P]``, 0 on padding rows (differentiable)."""
    return probs_R.new_zeros(plan.num_rows).index_copy(0, plan.dest_R, probs_R)


def padded_expert_mlp(
    x_RH: torch.Tensor,
    probs_R: torch.Tensor,
    counts_L: torch.Tensor,
    fc1: GemmFn,
    fc2: GemmFn,
    act: ActivationSpec,
    alignment: int,
    *,
    apply_probs_on_input: bool = False,
    num_rows: int | None = None,
    fc1_pads: bool = False,
    fc2_unpads: bool = False,
) -> torch.Tensor:
    """``fc2(act(fc1(x)) * probs)`` per expert with every expert's rows padded to ``alignment``.

    ``counts_L``: rows per local expert (device or host tensor; summing to R, not read back).
    ``num_rows``: P (default: the static bound; TE passes the exact padded total it needs).
    ``fc1_pads``: fc1 takes the R real rows and writes the padded layout itself (``fc1(x_RH, plan) ->
    h_PF1``; the native path quantizes straight into it), so no bf16 padded copy of x is built.
    ``fc2_unpads``: fc2 returns the R real rows itself (``fc2(a_PF, plan) -> y_RH``; the native path's
    backward quantizes their gradient straight into the padded layout)."""
    if x_RH.shape[0] != probs_R.shape[0]:
        raise ValueError(f"padded_expert_mlp: {x_RH.shape[0]} rows but {probs_R.shape[0]} probabilities")
    counts_L = counts_L.to(device=x_RH.device)
    if apply_probs_on_input:  # as Megatron: scale the input, then probabilities 1
        dtype = x_RH.dtype
        x_RH = (probs_R.unsqueeze(-1) * x_RH).to(dtype)
        probs_R = torch.ones_like(probs_R)
    plan = pad_plan(counts_L, alignment, x_RH.shape[0], num_rows)
    probs_P = pad_probs(probs_R, plan)
    h_PF1 = fc1(x_RH.contiguous(), plan) if fc1_pads else fc1(pad_rows(x_RH.contiguous(), plan), plan)
    a_PF = apply_activation(h_PF1, act, probs_P)
    return fc2(a_PF, plan) if fc2_unpads else unpad_rows(fc2(a_PF, plan), plan)


def native_num_rows(real_rows: int, num_experts: int, alignment: int) -> int:
    """P for the native path: the static bound ``num_rows_bound``, rounded up to ``alignment``."""
    bound = num_rows_bound(real_rows, num_experts, alignment)
    return (bound + alignment - 1) // alignment * alignment


def native_offsets(plan: PadPlan) -> torch.Tensor:
    """The grouped GEMM's ``offs`` for the static-size buffer: the plan's padded offsets with the last
    expert extended to the end, so it also owns the spare rows past the real padded total. Those rows
    are zero inputs with probability 0: they add nothing to any output row that is read or to any
    gradient, every group stays a multiple of the alignment (P is), and no GEMM output row is left
    unwritten (torch's kernels leave rows past ``offs[-1]`` unspecified)."""
    offs = plan.aligned_offsets_E
    if offs.numel():  # no ``offs[-1] = P``: a Python int written into a CUDA tensor is a pageable
        # host-to-device copy, which synchronises the stream (and breaks CUDA graph capture)
        offs = torch.cat([offs[:-1], offs.new_full((1,), plan.num_rows)])
    return offs


def native_expert_mlp(x_RH, probs_R, counts_L, w1_LFH, w2_LHF, act, *, apply_probs_on_input=False):
    """The MLP with both GEMMs in native rowwise FP8 (``torch._scaled_grouped_mm``); device-only. fc1
    quantizes the real rows straight into the padded layout (``fp8_grouped_linear_padded``); fc2 returns
    the real rows and quantizes their gradient straight into the padded layout
    (``fp8_grouped_linear_gather``): no bf16 padded copy of x or of the output gradient."""
    from mok_megatron.fp8.native import ALIGNMENT, fp8_grouped_linear_gather, fp8_grouped_linear_padded

    def fc1(x_RH, plan):
        offs = native_offsets(plan)
        return fp8_grouped_linear_padded(x_RH, w1_LFH, plan.dest_R, plan.offsets_E, offs, plan.num_rows)

    def fc2(a_PF, plan):
        return fp8_grouped_linear_gather(a_PF, w2_LHF, plan.dest_R, plan.offsets_E, native_offsets(plan))

    num_rows = native_num_rows(x_RH.shape[0], w1_LFH.shape[0], ALIGNMENT)
    return padded_expert_mlp(
        x_RH,
        probs_R,
        counts_L,
        fc1,
        fc2,
        act,
        ALIGNMENT,
        apply_probs_on_input=apply_probs_on_input,
        num_rows=num_rows,
        fc1_pads=True,
        fc2_unpads=True,
    )


def native_expert_mlp_aligned(x_PH, probs_P, counts_L, w1_LFH, w2_LHF, act, *, apply_probs_on_input=False):
    """The native FP8 MLP on rows the dispatcher already padded (``functional.plan.build_aligned_plan``):
    every count a multiple of ``fp8.native.ALIGNMENT``, padding rows zero with probability 0. fc1 / fc2
    run on the buffer as it is: no scatter into a padded buffer, no gather of real rows back."""
    from mok_megatron.fp8.native import ALIGNMENT, fp8_grouped_linear
    from mok_megatron.ops.grouped_gemm import offsets_from_counts

    if x_PH.shape[0] % ALIGNMENT or x_PH.shape[0] != probs_P.shape[0]:
        raise ValueError(
            f"native_expert_mlp_aligned: {x_PH.shape[0]} rows and {probs_P.shape[0]} probabilities; "
            f"expected equal counts, a multiple of {ALIGNMENT} (build the plan with build_aligned_plan)"
        )
    if apply_probs_on_input:  # as Megatron: scale the input, then probabilities 1
        x_PH = (probs_P.unsqueeze(-1) * x_PH).to(x_PH.dtype)
        probs_P = torch.ones_like(probs_P)
    offs_L = offsets_from_counts(counts_L, x_PH.device)
    h_PF1 = fp8_grouped_linear(x_PH.contiguous(), w1_LFH, offs_L)
    return fp8_grouped_linear(apply_activation(h_PF1, act, probs_P), w2_LHF, offs_L)


def padded_counts_host(counts_L: torch.Tensor, alignment: int) -> list[int]:
    """Per-expert padded row counts on the host (TE's ``m_splits``): one device-to-host read."""
    from mok_megatron.compat import te_m_splits

    counts_L = counts_L.long()
    return te_m_splits((counts_L + alignment - 1) // alignment * alignment)


def te_expert_mlp(
    x_RH, probs_R, counts_L, linear_fc1, linear_fc2, act, alignment, *, apply_probs_on_input=False
):
    """The MLP through TE GroupedLinear modules (``module(x, m_splits) -> (y, bias)``, Megatron's
    wrapper contract). Runs under whatever FP8 context the caller entered (Megatron's block does)."""
    m_splits = padded_counts_host(counts_L, alignment)

    def fc1(x_PH, plan):
        return linear_fc1(x_PH, m_splits)[0]

    def fc2(a_PF, plan):
        return linear_fc2(a_PF, m_splits)[0]

    if alignment == 1:  # nothing to pad (TE bf16): skip the scatter / gather
        if apply_probs_on_input:
            x_RH = (probs_R.unsqueeze(-1) * x_RH).to(x_RH.dtype)
            probs_R = torch.ones_like(probs_R)
        return fc2(apply_activation(fc1(x_RH, None), act, probs_R), None)
    return padded_expert_mlp(
        x_RH,
        probs_R,
        counts_L,
        fc1,
        fc2,
        act,
        alignment,
        apply_probs_on_input=apply_probs_on_input,
        num_rows=sum(m_splits),
    )
