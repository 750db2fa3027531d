"""The native FP8 experts on token rows (EP = 1): permute and combine fused into the FP8 GEMMs' operands.

Legend: T tokens, K routes per token, H hidden, P rows of the padded expert-major buffer (the aligned
plan's ``RoutingMeta.num_rows``), F1 fc1 rows (2F with a GLU), F FFN width, L local experts.

    fp8_token_mlp(x_TH, probs_TK, meta, counts_L, w1_LFH, w2_LHF, act) -> y_TH
        = combine(native_expert_mlp_aligned(permute(x_TH, meta, probs_TK), ...), meta), bitwise

The unfused EP = 1 path (``functional.plan.build_aligned_plan`` -> ``kernels.permute`` ->
``mcore.padded_experts.native_expert_mlp_aligned`` -> ``kernels.combine``) writes the permuted rows in bf16
and quantizes them again; the combine's backward writes the output gradient's rows in bf16 and fc2's
backward quantizes them again. A route's row is a copy of its token's row, so here:

    fc1 forward      A = ``quantize_permute(x_TH)``: each token quantized once, its e4m3 row written to its
                     K rows (no bf16 permuted rows)
    fc1 backward     dx_PH -> per-token gather-sum (the permute's backward); the weight gradient's x operand
                     (per-(expert, column) scales, transposed) read through ``src_P`` from x_TH
                     (``quantize_segments_t_rows``)
    fc2 forward      y_PH -> per-token gather-sum (the combine)
    fc2 backward     dgrad A = ``quantize_permute(dout_TH)`` (the combine's backward, quantized), the weight
                     gradient's dy operand read through ``src_P`` from dout_TH

Where the weight gradient runs in bf16 (``fp8.native.WGRAD_FP8_MIN_ROWS``: Qwen3-30B-A3B-like shapes) its
operand rows are rebuilt from the token rows in the backward instead (the permute's scatter, ``_rows``).
Quantization policy, accumulation modes and the weight cache are ``fp8.native``'s; probabilities are applied
by the activation (``ops.activation``), so this needs ``apply_probs_on_input=False``.
"""

from __future__ import annotations

import torch

from mok_megatron.fp8 import native as N
from mok_megatron.kernels.combine import combine
from mok_megatron.kernels.fp8_permute import quantize_permute
from mok_megatron.kernels.fp8_quant import quantize_segments_t, quantize_segments_t_rows
from mok_megatron.kernels.permute import permute
from mok_megatron.kernels.routing import RoutingMeta
from mok_megatron.ops.grouped_gemm import offsets_from_counts
from mok_megatron.ops.activation import ActivationSpec, apply_activation


def _rows(x_TH: torch.Tensor, meta: RoutingMeta) -> torch.Tensor:
    """The permuted bf16 rows ``[P, H]`` (padding zero) for a bf16 weight gradient: the permute's
    one-pass scatter (each token read once), not differentiated."""
    with torch.no_grad():
        return permute(x_TH, meta)[0]


class _PermuteFc1(torch.autograd.Function):
    """``fp8_grouped_linear(permute(x_TH), w1, offs)`` with A quantized straight from the token rows."""

    @staticmethod
    def forward(ctx, x_TH, w_GNK, offs_G, meta):
        xq_PH, xs_P, src_P = quantize_permute(x_TH, meta)
        ctx.meta = meta
        ctx.save_for_backward(x_TH, w_GNK, offs_G, src_P)
        wq_GNK, ws_GN = N.quantized_weight(w_GNK, "fwd")
        return N._gemm(xq_PH, wq_GNK.transpose(-2, -1), xs_P, ws_GN, offs_G, fast_accum=True).to(x_TH.dtype)

    @staticmethod
    def backward(ctx, dh_PN):
        x_TH, w_GNK, offs_G, src_P = ctx.saved_tensors
        dh_PN = dh_PN.contiguous()
        num_rows = dh_PN.shape[0]
        wgrad_fp8 = ctx.needs_input_grad[1] and N._wgrad_fp8(num_rows, w_GNK)
        dx_TH = dw_GNK = dh_partials = None
        if ctx.needs_input_grad[0]:
            dh_quantized, dh_partials = N._rowwise(dh_PN, wgrad_fp8)
            operands = N.dgrad_operands(dh_PN, w_GNK, N.quantized_weight(w_GNK, "dgrad"), dh_quantized)
            dx_PH = N._gemm(*operands, offs_G, fast_accum=N._dgrad_fast(w_GNK)).to(x_TH.dtype)
            dx_TH = combine(dx_PH, ctx.meta)  # the permute's backward: each token's K rows summed in fp32
        if ctx.needs_input_grad[1]:
            if wgrad_fp8:
                x_quantized = quantize_segments_t_rows(x_TH, src_P, offs_G)
                operands = N.wgrad_operands(dh_PN, None, offs_G, x_quantized, dy_partials=dh_partials)
                dw_GNK = N._gemm(*operands, offs_G, fast_accum=False).to(w_GNK.dtype)
            else:
                dw_GNK = N._wgrad_bf16(dh_PN, _rows(x_TH, ctx.meta), offs_G, w_GNK)
        return dx_TH, dw_GNK, None, None


class _Fc2Combine(torch.autograd.Function):
    """``combine(fp8_grouped_linear(a_PF, w2, offs))`` whose backward quantizes the output gradient's
    token rows straight into fc2's FP8 gradient operands."""

    @staticmethod
    def forward(ctx, a_PF, w_GNK, offs_G, meta):
        wgrad_fp8 = w_GNK.requires_grad and N._wgrad_fp8(a_PF.shape[0], w_GNK)
        a_quantized, a_partials = N._rowwise(a_PF, wgrad_fp8)
        ctx.meta = meta
        ctx.save_for_backward(a_PF, w_GNK, offs_G, a_partials)
        operands = N.fwd_operands(a_PF, w_GNK, N.quantized_weight(w_GNK, "fwd"), a_quantized)
        y_PH = N._gemm(*operands, offs_G, fast_accum=True).to(a_PF.dtype)
        return combine(y_PH, meta)

    @staticmethod
    def backward(ctx, dout_TH):
        a_PF, w_GNK, offs_G, a_partials = ctx.saved_tensors
        dout_TH = dout_TH.contiguous()
        dyq_PH, dys_P, src_P = quantize_permute(dout_TH, ctx.meta)
        da_PF = dw_GNK = None
        if ctx.needs_input_grad[0]:
            wq_GKN, ws_GK = N.quantized_weight(w_GNK, "dgrad")
            da_PF = N._gemm(
                dyq_PH, wq_GKN.transpose(-2, -1), dys_P, ws_GK, offs_G, fast_accum=N._dgrad_fast(w_GNK)
            ).to(a_PF.dtype)
        if ctx.needs_input_grad[1]:
            if N._wgrad_fp8(a_PF.shape[0], w_GNK):
                dyq_HP, dys_GH = quantize_segments_t_rows(dout_TH, src_P, offs_G)
                aq_FP, as_GF = quantize_segments_t(a_PF, offs_G, partials=a_partials)
                operands = (dyq_HP, aq_FP.t(), dys_GH.reshape(-1), as_GF.reshape(-1))
                dw_GNK = N._gemm(*operands, offs_G, fast_accum=False).to(w_GNK.dtype)
            else:
                dw_GNK = N._wgrad_bf16(_rows(dout_TH, ctx.meta), a_PF, offs_G, w_GNK)
        return da_PF, dw_GNK, None, None


class _PermuteProbs(torch.autograd.Function):
    """``probs_P[row_TK[t, k]] = probs_TK[t, k]``, 0 on rows no route lands on; backward a gather."""

    @staticmethod
    def forward(ctx, probs_TK, meta):
        ctx.meta = meta
        rows_N = meta.row_TK.reshape(-1).long()
        rows_N = torch.where(rows_N >= 0, rows_N, meta.num_rows)
        ctx.save_for_backward(rows_N)
        out = probs_TK.new_zeros(meta.num_rows + 1)
        return out.index_copy(0, rows_N, probs_TK.reshape(-1))[:-1]

    @staticmethod
    def backward(ctx, dprobs_P):
        (rows_N,) = ctx.saved_tensors
        live = (ctx.meta.row_TK >= 0).reshape(-1)
        d = torch.cat([dprobs_P, dprobs_P.new_zeros(1)]).index_select(0, rows_N)
        return torch.where(live, d, 0).view(ctx.meta.row_TK.shape), None


def fp8_token_mlp(
    x_TH: torch.Tensor,
    probs_TK: torch.Tensor,
    meta: RoutingMeta,
    counts_L: torch.Tensor,
    w1_LFH: torch.Tensor,
    w2_LHF: torch.Tensor,
    act: ActivationSpec,
) -> torch.Tensor:
    """The routed experts' output per token, ``[T, H]`` (module docstring). ``meta``: the aligned plan's
    routing metadata (alignment ``fp8.native.ALIGNMENT``, static row count); ``counts_L``: its rows per
    expert on the device (the last expert owning the spare rows), summing to P. No host read."""
    N.check_native_fp8(x_TH.device)
    if meta.alignment % N.ALIGNMENT or meta.num_rows % N.ALIGNMENT:
        raise ValueError(
            f"fp8_token_mlp: routing metadata with alignment {meta.alignment} and {meta.num_rows} rows; the "
            f"FP8 GEMMs need both multiples of {N.ALIGNMENT} (build the plan with build_aligned_plan at "
            f"alignment {N.ALIGNMENT})"
        )
    if probs_TK.shape != meta.row_TK.shape:
        raise ValueError(
            f"fp8_token_mlp: probs {tuple(probs_TK.shape)}, expected one per route {tuple(meta.row_TK.shape)}"
        )
    offs_L = offsets_from_counts(counts_L, x_TH.device)
    N._check_shapes(x_TH, w1_LFH, offs_L)
    probs_P = _PermuteProbs.apply(probs_TK, meta)
    h_PF1 = _PermuteFc1.apply(x_TH.contiguous(), w1_LFH, offs_L, meta)
    return _Fc2Combine.apply(apply_activation(h_PF1, act, probs_P), w2_LHF, offs_L, meta)
