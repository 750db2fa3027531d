"""Combine (unpermute): each token's sum of its expert output rows, optionally weighted by the router
probabilities, deterministic (fixed k order, fp32 accumulation, rounded once, no atomics).

Legend: T tokens, K routes per token, H hidden, R rows of the expert-major buffer.

Forward:  ``out_TH[t] = sum_k p[t, k] * y_RH[row_TK[t, k]]`` over live routes (p = 1 unweighted).
Backward: ``dy_RH[row_TK[t, k]] = p[t, k] * dout_TH[t]`` (rows no route reads get zeros) and, weighted,
``dprobs_TK[t, k] = <dout_TH[t], y_RH[row_TK[t, k]]>`` in fp32 - one pass that reads each token's gradient
once. Both are the row-movement kernels of ``kernels.permute``.

How it plugs in: replaces ``ops.permute.combine_tokens`` in ``engine.plain.combine_postprocess``
(unweighted: MoK applies the probabilities inside the experts, as Megatron does); the weighted form is the
torchtitan-style "score after experts" combine, which lets the expert MLP skip the probability multiply.
"""

from __future__ import annotations

import torch

from mok_megatron.kernels import Impl, use_triton
from mok_megatron.kernels.permute import check_devices, gather_sum_rows, scatter_rows
from mok_megatron.kernels.routing import RoutingMeta


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_RH, probs_TK, meta, out_dtype):
        out_TH, _ = gather_sum_rows(y_RH, meta.row_TK, out_dtype, weight_TK=probs_TK)
        ctx.meta = meta
        ctx.y_dtype = y_RH.dtype
        ctx.save_for_backward(y_RH if probs_TK is not None else None, probs_TK)
        return out_TH

    @staticmethod
    def backward(ctx, dout_TH):
        y_RH, probs_TK = ctx.saved_tensors
        want_probs = probs_TK is not None and ctx.needs_input_grad[1]
        dy_RH, dprobs_TK, _ = scatter_rows(
            dout_TH, ctx.meta, ctx.y_dtype, scale_TK=probs_TK, other_RH=y_RH if want_probs else None
        )
        return dy_RH, dprobs_TK, None, None


def combine(
    y_RH: torch.Tensor,
    meta: RoutingMeta,
    probs_TK: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    impl: Impl = Impl.AUTO,
) -> torch.Tensor:
    """Inputs: y_RH [R, H] expert outputs in the layout of ``meta``; probs_TK [T, K] (weights) or None.
    Output: out_TH [T, H] in out_dtype (default y's). Differentiable in y and probs."""
    if y_RH.dim() != 2 or y_RH.shape[0] != meta.num_rows:
        raise ValueError(
            f"combine: y has shape {tuple(y_RH.shape)}, expected [R, H] with R = meta.num_rows = {meta.num_rows}"
        )
    if probs_TK is not None and probs_TK.shape != meta.row_TK.shape:
        raise ValueError(
            f"combine: probs has shape {tuple(probs_TK.shape)}, expected {tuple(meta.row_TK.shape)}"
        )
    check_devices("combine", meta, y=y_RH, probs=probs_TK)
    out_dtype = out_dtype or y_RH.dtype
    if not use_triton(impl, y_RH, "combine"):
        return combine_reference(y_RH, meta, probs_TK, out_dtype)
    return _Combine.apply(y_RH, probs_TK, meta, out_dtype)


def combine_reference(
    y_RH: torch.Tensor,
    meta: RoutingMeta,
    probs_TK: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Pure torch: gather the K rows, weight in fp32, sum over k, round once."""
    num_tokens, topk = meta.row_TK.shape
    if y_RH.shape[0] == 0:  # no rows at all (every route dropped or elsewhere): nothing to gather
        return y_RH.new_zeros((num_tokens, y_RH.shape[1]), dtype=out_dtype or y_RH.dtype) + 0 * y_RH.sum()
    live_TK = meta.row_TK >= 0
    rows_N = meta.row_TK.reshape(-1).long().clamp(min=0)
    picked_TKH = y_RH.index_select(0, rows_N).view(num_tokens, topk, y_RH.shape[1]).float()
    picked_TKH = torch.where(live_TK.unsqueeze(-1), picked_TKH, 0.0)
    if probs_TK is not None:
        picked_TKH = picked_TKH * torch.where(live_TK, probs_TK.float(), 0.0).unsqueeze(-1)
    return picked_TKH.sum(dim=1).to(out_dtype or y_RH.dtype)
