"""The ``torch-fp8`` expert backend: both GEMMs in native rowwise FP8 (``torch._scaled_grouped_mm``, sm_90+,
no Transformer Engine), on the same parameters as the bf16 backend.

Legend: R real rows (expert-major), P rows of the padded expert-major buffer, T tokens, K routes per token,
H hidden, F1 fc1 rows (2F with a GLU), F FFN width, L local experts.

``MoKFP8GroupedMLP`` is the backend's experts module (``MoKGroupedMLP``'s parameters and checkpoints). Its
two calls run three MLPs, one math (fc1 -> activation * probs -> fc2 per expert, every expert's rows padded
to ``ops.fp8_grouped_gemm.ALIGNMENT``):

    native_expert_mlp           expert-major rows as any dispatcher delivers them: fc1 quantizes the real
                                rows straight into the padded layout, fc2 returns the real rows and its
                                backward quantizes their gradient straight into it (no bf16 padded copies);
                                P is a static bound (no host read)
    native_expert_mlp_aligned   rows the dispatcher already padded (``engine.plan.build_aligned_plan``)
    fp8_token_mlp               token rows and routing metadata (EP = 1 and the pipeline's expert calls):
                                permute and combine fused into the GEMMs' FP8 operands, below

The native FP8 experts on token rows (EP = 1): permute and combine fused into the FP8 GEMMs' operands.

Legend: T tokens, K routes per token, H hidden, P rows of the padded expert-major buffer (the aligned
plan's ``RoutingMeta.num_rows``), F1 fc1 rows (2F with a GLU), F FFN width, L local experts.

    fp8_token_mlp(x_TH, probs_TK, meta, counts_L, w1_LFH, w2_LHF, act) -> y_TH
        = combine(native_expert_mlp_aligned(permute(x_TH, meta, probs_TK), ...), meta), bitwise

The unfused EP = 1 path (``engine.plan.build_aligned_plan`` -> ``kernels.permute`` ->
``native_expert_mlp_aligned`` -> ``kernels.combine``) writes the permuted rows in bf16
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

Where the weight gradient runs in bf16 (``ops.fp8_grouped_gemm.WGRAD_FP8_MIN_ROWS``: Qwen3-30B-A3B-like shapes) its
operand rows are rebuilt from the token rows in the backward instead (the permute's scatter, ``_rows``).
Quantization policy, accumulation modes and the weight cache (owned by ``MoKFP8GroupedMLP``) are
``ops.fp8_grouped_gemm``'s; probabilities are applied by the activation (``ops.activation``), so this needs
``apply_probs_on_input=False``.
"""

from __future__ import annotations

import torch

from mok_megatron.config import MoKConfig

from mok_megatron.errors import MoKConfigError
from mok_megatron.experts.backend import expert_alignment
from mok_megatron.experts.common import padded_expert_mlp, scale_input
from mok_megatron.experts.grouped_mlp import MoKGroupedMLP
from mok_megatron.experts_contract import ExpertsContract
from mok_megatron.kernels.combine import combine
from mok_megatron.kernels.fp8_permute import quantize_permute
from mok_megatron.kernels.fp8_quant import quantize_segments_t, quantize_segments_t_rows
from mok_megatron.kernels.permute import permute
from mok_megatron.kernels.routing import RoutingMeta, num_rows_bound
from mok_megatron.ops import fp8_grouped_gemm as N
from mok_megatron.ops.activation import ActivationSpec, apply_activation
from mok_megatron.ops.align import PadPlan
from mok_megatron.ops.grouped_gemm import offsets_from_counts
from mok_megatron.options import ExpertBackend, MoKOptions


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


def native_expert_mlp(
    x_RH, probs_R, counts_L, w1_LFH, w2_LHF, act, *, apply_probs_on_input=False, cache=None
):
    """The MLP with both GEMMs in native rowwise FP8 (``torch._scaled_grouped_mm``); device-only. fc1
    quantizes the real rows straight into the padded layout (``fp8_grouped_linear_padded``); fc2 returns
    the real rows and quantizes their gradient straight into the padded layout
    (``fp8_grouped_linear_gather``): no bf16 padded copy of x or of the output gradient. ``cache``: the
    quantized weights' (``ops.fp8_grouped_gemm.FP8WeightCache``; None: quantized every call)."""
    from mok_megatron.ops.fp8_grouped_gemm import (
        ALIGNMENT,
        fp8_grouped_linear_gather,
        fp8_grouped_linear_padded,
    )

    def fc1(x_RH, plan):
        offs = native_offsets(plan)
        return fp8_grouped_linear_padded(
            x_RH, w1_LFH, plan.dest_R, plan.offsets_E, offs, plan.num_rows, cache
        )

    def fc2(a_PF, plan):
        offs = native_offsets(plan)
        return fp8_grouped_linear_gather(a_PF, w2_LHF, plan.dest_R, plan.offsets_E, offs, cache)

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


def native_expert_mlp_aligned(
    x_PH, probs_P, counts_L, w1_LFH, w2_LHF, act, *, apply_probs_on_input=False, cache=None
):
    """The native FP8 MLP on rows the dispatcher already padded (``engine.plan.build_aligned_plan``):
    every count a multiple of ``ops.fp8_grouped_gemm.ALIGNMENT``, padding rows zero with probability 0. fc1 / fc2
    run on the buffer as it is: no scatter into a padded buffer, no gather of real rows back."""
    from mok_megatron.ops.fp8_grouped_gemm import ALIGNMENT, fp8_grouped_linear

    if x_PH.shape[0] % ALIGNMENT or x_PH.shape[0] != probs_P.shape[0]:
        raise ValueError(
            f"native_expert_mlp_aligned: {x_PH.shape[0]} rows and {probs_P.shape[0]} probabilities; "
            f"expected equal counts, a multiple of {ALIGNMENT} (build the plan with build_aligned_plan)"
        )
    if apply_probs_on_input:
        x_PH, probs_P = scale_input(x_PH, probs_P)
    offs_L = offsets_from_counts(counts_L, x_PH.device)
    h_PF1 = fp8_grouped_linear(x_PH.contiguous(), w1_LFH, offs_L, cache)
    return fp8_grouped_linear(apply_activation(h_PF1, act, probs_P), w2_LHF, offs_L, cache)


def _rows(x_TH: torch.Tensor, meta: RoutingMeta) -> torch.Tensor:
    """The permuted bf16 rows ``[P, H]`` (padding zero) for a bf16 weight gradient: the permute's
    one-pass scatter (each token read once), not differentiated."""
    with torch.no_grad():
        return permute(x_TH, meta)[0]


class _PermuteFc1(torch.autograd.Function):
    """``fp8_grouped_linear(permute(x_TH), w1, offs)`` with A quantized straight from the token rows."""

    @staticmethod
    def forward(ctx, x_TH, w_GNK, offs_G, meta, cache):
        xq_PH, xs_P, src_P = quantize_permute(x_TH, meta)
        ctx.meta, ctx.cache = meta, cache
        ctx.save_for_backward(x_TH, w_GNK, offs_G, src_P)
        wq_GNK, ws_GN = N.quantized_weight(w_GNK, "fwd", cache)
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
            weight = N.quantized_weight(w_GNK, "dgrad", ctx.cache)
            operands = N.dgrad_operands(dh_PN, w_GNK, weight, dh_quantized)
            dx_PH = N._gemm(*operands, offs_G, fast_accum=N._dgrad_fast(w_GNK)).to(x_TH.dtype)
            dx_TH = combine(dx_PH, ctx.meta)  # the permute's backward: each token's K rows summed in fp32
        if ctx.needs_input_grad[1]:
            if wgrad_fp8:
                x_quantized = quantize_segments_t_rows(x_TH, src_P, offs_G)
                operands = N.wgrad_operands(dh_PN, None, offs_G, x_quantized, dy_partials=dh_partials)
                dw_GNK = N._gemm(*operands, offs_G, fast_accum=False).to(w_GNK.dtype)
            else:
                dw_GNK = N._wgrad_bf16(dh_PN, _rows(x_TH, ctx.meta), offs_G, w_GNK)
        return dx_TH, dw_GNK, None, None, None


class _Fc2Combine(torch.autograd.Function):
    """``combine(fp8_grouped_linear(a_PF, w2, offs))`` whose backward quantizes the output gradient's
    token rows straight into fc2's FP8 gradient operands."""

    @staticmethod
    def forward(ctx, a_PF, w_GNK, offs_G, meta, cache):
        wgrad_fp8 = w_GNK.requires_grad and N._wgrad_fp8(a_PF.shape[0], w_GNK)
        a_quantized, a_partials = N._rowwise(a_PF, wgrad_fp8)
        ctx.meta, ctx.cache = meta, cache
        ctx.save_for_backward(a_PF, w_GNK, offs_G, a_partials)
        operands = N.fwd_operands(a_PF, w_GNK, N.quantized_weight(w_GNK, "fwd", cache), a_quantized)
        y_PH = N._gemm(*operands, offs_G, fast_accum=True).to(a_PF.dtype)
        return combine(y_PH, meta)

    @staticmethod
    def backward(ctx, dout_TH):
        a_PF, w_GNK, offs_G, a_partials = ctx.saved_tensors
        dout_TH = dout_TH.contiguous()
        dyq_PH, dys_P, src_P = quantize_permute(dout_TH, ctx.meta)
        da_PF = dw_GNK = None
        if ctx.needs_input_grad[0]:
            wq_GKN, ws_GK = N.quantized_weight(w_GNK, "dgrad", ctx.cache)
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
        return da_PF, dw_GNK, None, None, None


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
    cache: N.FP8WeightCache | None = None,
) -> torch.Tensor:
    """The routed experts' output per token, ``[T, H]`` (module docstring). ``meta``: the aligned plan's
    routing metadata (alignment ``ops.fp8_grouped_gemm.ALIGNMENT``, static row count); ``counts_L``: its rows
    per expert on the device (the last expert owning the spare rows), summing to P; ``cache``: the quantized
    weights' (``ops.fp8_grouped_gemm.FP8WeightCache``). No host read."""
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
    h_PF1 = _PermuteFc1.apply(x_TH.contiguous(), w1_LFH, offs_L, meta, cache)
    return _Fc2Combine.apply(apply_activation(h_PF1, act, probs_P), w2_LHF, offs_L, meta, cache)


class MoKFP8GroupedMLP(MoKGroupedMLP):
    """Routed experts, the ``torch-fp8`` backend: ``MoKGroupedMLP``'s parameters with both GEMMs in native
    rowwise FP8. ``forward`` takes expert-major rows (padded by the dispatcher when ``aligned_input`` > 1);
    ``token_rows_forward`` takes token rows and the routing metadata (the permute fused into the GEMMs).
    Weight gradients are ordinary autograd gradients (no delayed, late or fused accumulation).
    ``fp8_weights``: this module's quantized weights, per weight version (``ops.fp8_grouped_gemm``)."""

    backend = ExpertBackend.TORCH_FP8

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fp8_weights = N.FP8WeightCache()

    @classmethod
    def contract(cls, config, mok_config: MoKConfig, options: MoKOptions) -> ExpertsContract:
        """Device counts, rows padded to ``ops.fp8_grouped_gemm.ALIGNMENT``, and, without probabilities on
        the input, token rows with the permute fused into their operands."""
        return ExpertsContract(
            mok=True,
            alignment=expert_alignment(ExpertBackend.TORCH_FP8, config),
            fuses_permute=not mok_config.apply_probs_on_input,
        )

    def late_wgrad(self):
        return None

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, late=None, group=None):
        """Megatron's experts call on expert-major rows; ``late`` / ``group`` as ``MoKGroupedMLP.forward``."""
        w1, w2, _, _, _ = self._call_weights(late, group)
        act = self.mok_config.activation
        # rows already padded by the dispatcher (aligned plan), or padded here
        mlp = native_expert_mlp_aligned if self.aligned_input > 1 else native_expert_mlp
        args = (permuted_local_hidden_states, permuted_probs, tokens_per_expert, w1, w2, act)
        on_input = self.mok_config.apply_probs_on_input
        return mlp(*args, apply_probs_on_input=on_input, cache=self.fp8_weights), None

    def token_rows_forward(self, x_TH, probs_TK, meta, counts_L):
        """The experts' per-token output ``[T, H]`` from the token rows and routing metadata in the padded
        layout: the aligned plan's at EP = 1 (``MoKTokenDispatcher.run_fused``), each expert call's in the
        overlap pipeline (``engine.pipeline._experts_aligned``)."""
        if self.mok_config.apply_probs_on_input:
            raise MoKConfigError(
                "token_rows_forward: apply_probs_on_input=True; the permute fuses into the FP8 GEMMs only "
                "with the probabilities applied by the activation (moe_apply_probs_on_input False)"
            )
        w1, w2, act = self.fc1_weight, self.fc2_weight, self.mok_config.activation
        return fp8_token_mlp(x_TH, probs_TK, meta, counts_L, w1, w2, act, self.fp8_weights)
