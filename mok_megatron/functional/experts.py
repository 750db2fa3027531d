"""The routed experts' MLP over rows grouped by local expert: fc1 -> activation * prob -> fc2.

Legend:
    R  rows (grouped by local expert)   H  expert input/output width
    L  local experts                    F  FFN width per expert on this rank (2F rows of fc1 with a GLU)

Weights: ``w1_LFH`` ``[L, F1, H]`` (F1 = 2F with a GLU: gate rows then up rows, Megatron's layout) and
``w2_LHF`` ``[L, H, F]``. Slice ``[l]`` of each is expert ``l``'s ``linear_fc1.weight`` /
``linear_fc2.weight`` in Megatron's ``SequentialMLP``.
"""

from __future__ import annotations

import torch

from mok_megatron.ops.activation import ActivationSpec, apply_activation
from mok_megatron.ops.grouped_gemm import grouped_linear, offsets_from_counts


def expert_mlp(
    x_RH: torch.Tensor,
    probs_R: torch.Tensor,
    tokens_per_expert_L: torch.Tensor,
    w1_LFH: torch.Tensor,
    w2_LHF: torch.Tensor,
    act: ActivationSpec,
    apply_probs_on_input: bool = False,
) -> torch.Tensor:
    """Inputs: x_RH [R, H], probs_R [R] (router dtype), tokens_per_expert_L [L] (any device, sums to R).
    Output: y_RH [R, H] in x's dtype, already scaled by the router probabilities."""
    if x_RH.shape[0] != probs_R.shape[0]:
        raise ValueError(f"expert_mlp: {x_RH.shape[0]} rows but {probs_R.shape[0]} probabilities")
    if tokens_per_expert_L.shape != (w1_LFH.shape[0],):
        raise ValueError(
            f"expert_mlp: tokens_per_expert has shape {tuple(tokens_per_expert_L.shape)}, "
            f"expected ({w1_LFH.shape[0]},) for {w1_LFH.shape[0]} local experts"
        )
    offs_L = offsets_from_counts(tokens_per_expert_L, x_RH.device)
    if apply_probs_on_input:
        dtype = x_RH.dtype
        x_RH = (probs_R.unsqueeze(-1) * x_RH).to(dtype)
        probs_R = torch.ones_like(probs_R)
    h = grouped_linear(x_RH, w1_LFH, offs_L)
    a = apply_activation(h, act, probs_R)
    return grouped_linear(a, w2_LHF, offs_L)
