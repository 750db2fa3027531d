"""Dispatch and combine as six phases over a frozen ``DispatchPlan`` (Megatron's phase split).

Legend:
    T  local tokens   H  hidden   N  rows sent   R  rows received by this rank's experts

    dispatch_preprocess   x_TH, probs_TE -> x_NH, probs_N        permute into expert-major order (aligned
                                                                 plans: padded positions, padding zeroed)
    token_dispatch        x_NH, probs_N  -> x_(EP rows), probs    all-to-all over EP
    dispatch_postprocess  ...            -> x_RH, probs_R         all-gather over ETP, sort by local expert
    combine_preprocess    y_RH           -> y (EP rows)           unsort, reduce-scatter over ETP (fp32)
    token_combine         y              -> y_NH                  all-to-all back over EP
    combine_postprocess   y_NH           -> out [*hidden_shape]   per-token sum (deterministic)

``dispatch`` / ``combine`` chain them. None of them keeps state: what combine needs is in the plan.
"""

from __future__ import annotations

import torch

from mok_megatron.transport.comm import all_gather_v, all_to_all_v, reduce_scatter_v
from mok_megatron.engine.plan import DispatchPlan
from mok_megatron.ops.permute import combine_tokens, permute_tokens_with_probs


class _PermuteRows(torch.autograd.Function):
    """``x[idx]`` for a permutation ``idx`` whose inverse is known: the backward is a gather through the
    inverse (index_select's own backward is an atomic index_add)."""

    @staticmethod
    def forward(ctx, x, idx, inv):
        ctx.save_for_backward(inv)
        return x.index_select(0, idx)

    @staticmethod
    def backward(ctx, g):
        (inv,) = ctx.saved_tensors
        return g.index_select(0, inv), None, None


def permute_rows(x: torch.Tensor, idx: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    return _PermuteRows.apply(x, idx, inv)


def dispatch_preprocess(x_TH: torch.Tensor, probs_TE: torch.Tensor, plan: DispatchPlan):
    if plan.meta is not None:  # aligned layout: rows land in their padded positions, padding zeroed
        from mok_megatron.kernels.permute import permute

        return permute(x_TH, plan.meta, probs_TE.gather(1, plan.ids_TK))
    return permute_tokens_with_probs(x_TH, probs_TE, plan.token_idx_N, plan.expert_idx_N, plan.slots)


def token_dispatch(x_NH: torch.Tensor, probs_N: torch.Tensor, plan: DispatchPlan):
    g = plan.groups.ep
    x = all_to_all_v(x_NH, plan.recv_splits, plan.send_splits, g)
    probs = all_to_all_v(probs_N, plan.recv_splits, plan.send_splits, g)
    return x, probs


def dispatch_postprocess(x: torch.Tensor, probs: torch.Tensor, plan: DispatchPlan):
    """Returns ``(x_RH, tokens_per_expert_L, probs_R)``: rows grouped by local expert."""
    g = plan.groups.tp
    x = all_gather_v(x, plan.tp_splits, g)
    probs = all_gather_v(probs, plan.tp_splits, g)
    if plan.sort_idx_R is not None:
        x = permute_rows(x, plan.sort_idx_R, plan.unsort_idx_R)
        probs = permute_rows(probs, plan.sort_idx_R, plan.unsort_idx_R)
    return x, plan.tokens_per_expert_L, probs


def combine_preprocess(y_RH: torch.Tensor, plan: DispatchPlan, reduce_dtype: torch.dtype = torch.float32):
    if plan.unsort_idx_R is not None:
        y_RH = permute_rows(y_RH, plan.unsort_idx_R, plan.sort_idx_R)
    if plan.groups.tp_size > 1:
        # Expert-TP partial sums are reduced in fp32 (Megatron reduces in the router-probability
        # dtype, which is fp32 only with moe_router_dtype='fp32').
        dtype = y_RH.dtype
        y_RH = reduce_scatter_v(y_RH.to(reduce_dtype), plan.tp_splits, plan.groups.tp).to(dtype)
    return y_RH


def token_combine(y: torch.Tensor, plan: DispatchPlan):
    return all_to_all_v(y, plan.send_splits, plan.recv_splits, plan.groups.ep)


def combine_postprocess(y_NH: torch.Tensor, plan: DispatchPlan):
    if plan.meta is not None:
        from mok_megatron.kernels.combine import combine

        return combine(y_NH, plan.meta).view(plan.hidden_shape)
    return combine_tokens(y_NH, plan.slots).view(plan.hidden_shape)


def dispatch(x_TH: torch.Tensor, probs_TE: torch.Tensor, plan: DispatchPlan):
    """All three dispatch phases: ``(x_RH, tokens_per_expert_L, probs_R)``."""
    x, p = dispatch_preprocess(x_TH, probs_TE, plan)
    x, p = token_dispatch(x, p, plan)
    return dispatch_postprocess(x, p, plan)


def combine(y_RH: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """All three combine phases: the layer output in ``plan.hidden_shape``."""
    return combine_postprocess(token_combine(combine_preprocess(y_RH, plan), plan), plan)
