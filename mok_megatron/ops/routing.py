"""Routing metadata on the device, without host synchronisation.

Legend:
    T  local tokens (rows of the layer input on this rank)
    E  global experts
    K  router top-k (routes per token that carry a non-zero probability)
    N  permuted rows sent from this rank (expert-major: all rows of expert 0, then expert 1, ...)
    C  expert capacity (drop-and-pad mode)

The permuted layout is Megatron's: rows of expert ``e`` come in ascending token order. Row ``r`` of the
layout holds token ``token_idx_N[r]`` for expert ``expert_idx_N[r]``.

The *slot map* ``row_TK`` / ``valid_TK`` lists, for each token, the rows that carry its non-zero-
probability routes, in ascending expert order. Combine sums a token's rows through it with a gather
(deterministic, no atomics), and the gradient of the permute is the same gather-sum. Rows whose
probability is zero (capacity padding, router padding for quantization) are left out: the experts
multiply their output by that zero, so they contribute exactly nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def expert_counts(routing_map_TE: torch.Tensor) -> torch.Tensor:
    """Rows per expert ``[E]`` (int64, on device)."""
    return routing_map_TE.sum(dim=0, dtype=torch.int64)


def dropless_order(routing_map_TE: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_idx_N, expert_idx_N)`` of the expert-major layout; ``num_rows`` = routing_map.sum()."""
    num_tokens = routing_map_TE.shape[0]
    flat = routing_map_TE.t().reshape(-1).argsort(descending=True, stable=True)[:num_rows]
    return flat % num_tokens, flat // num_tokens


def capacity_order(routing_map_TE: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-and-pad layout: exactly ``capacity`` rows per expert, routed tokens first.

    With ``moe_pad_expert_input_to_capacity`` Megatron's router marks exactly ``capacity`` tokens per
    expert (``capacity <= T``), so every row of the layout is a routed (possibly zero-probability)
    token, as in Megatron's alltoall dispatcher.
    """
    num_tokens, num_experts = routing_map_TE.shape
    if capacity > num_tokens:
        raise ValueError(
            f"drop-and-pad: expert capacity {capacity} exceeds the {num_tokens} local tokens, so "
            "experts cannot be padded with distinct tokens (Megatron's dispatcher fails here too). "
            "Lower moe_expert_capacity_factor to at most num_moe_experts / moe_router_topk, or turn "
            "off moe_pad_expert_input_to_capacity."
        )
    order = routing_map_TE.t().to(torch.int8).argsort(dim=-1, descending=True, stable=True)
    token_idx = order[:, :capacity].reshape(-1)
    expert_idx = torch.arange(num_experts, device=routing_map_TE.device).repeat_interleave(capacity)
    return token_idx, expert_idx


@dataclass(frozen=True)
class SlotMap:
    """Each token's rows in the permuted layout: ``row_TK`` (int64) where ``valid_TK`` (bool)."""

    row_TK: torch.Tensor
    valid_TK: torch.Tensor


def slot_map(
    routing_map_TE: torch.Tensor,
    probs_TE: torch.Tensor,
    expert_offsets_E: torch.Tensor,
    topk: int,
) -> SlotMap:
    """Slot map for a layout whose expert ``e`` rows start at ``expert_offsets_E[e]``.

    ``routing_map_TE`` is the map the layout was built from (padded or not); a (t, e) route is in
    the slot map if it is routed and its probability is non-zero. At most ``topk`` such routes exist
    per token (Megatron's router gives non-zero probability only to a token's top-k experts).
    """
    num_tokens, num_experts = routing_map_TE.shape
    device = routing_map_TE.device
    # Position of token t among the routed tokens of expert e (valid where routed).
    pos_TE = torch.cumsum(routing_map_TE.to(torch.int64), dim=0) - 1
    row_TE = expert_offsets_E.view(1, -1) + pos_TE
    live_TE = routing_map_TE & (probs_TE != 0)
    k = min(topk, num_experts)
    expert_ids = torch.arange(num_experts, device=device).view(1, -1)
    key_TE = torch.where(live_TE, expert_ids, num_experts)
    e_TK = key_TE.sort(dim=1).values[:, :k]
    valid_TK = e_TK < num_experts
    row_TK = torch.where(valid_TK, row_TE.gather(1, e_TK.clamp(max=num_experts - 1)), 0)
    return SlotMap(row_TK=row_TK, valid_TK=valid_TK)
