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

import functools
from dataclasses import dataclass

import torch


def expert_counts(routing_map_TE: torch.Tensor) -> torch.Tensor:
    """Rows per expert ``[E]`` (int64, on device)."""
    return routing_map_TE.sum(dim=0, dtype=torch.int64)


def dropless_order(routing_map_TE: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_idx_N, expert_idx_N)`` of the expert-major layout; ``num_rows`` = routing_map.sum().

    The routed ``(expert, token)`` pairs of the ``[E, T]`` map in row-major order are exactly this layout:
    ``torch.nonzero_static`` lists them with a static row count (no host sync, no sort of T*E keys)."""
    pairs_N2 = torch.nonzero_static(routing_map_TE.t(), size=num_rows)
    return pairs_N2[:, 1], pairs_N2[:, 0]


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
    """Each token's rows in the permuted layout: ``row_TK`` (int64), valid where ``valid_TK`` (bool).

    ``valid_TK is None`` means every slot is valid (dropless: every token has exactly K rows).
    ``rows32_TK`` is the same map as the Triton kernels take it (int32, -1 for an invalid slot), built once
    per map and shared by permute, combine and their backwards (as is ``dense_offsets32``)."""

    row_TK: torch.Tensor
    valid_TK: torch.Tensor | None = None

    @functools.cached_property
    def rows32_TK(self) -> torch.Tensor:
        rows = self.row_TK if self.valid_TK is None else torch.where(self.valid_TK, self.row_TK, -1)
        return rows.to(torch.int32)

    @functools.cached_property
    def dense_offsets32(self) -> torch.Tensor:
        """``[T * K]`` as a one-element int32 device tensor: with every slot valid the rows are exactly the
        slots, one group without padding (the offsets the Triton scatter takes)."""
        return torch.full((1,), self.row_TK.numel(), dtype=torch.int32, device=self.row_TK.device)


def slot_map(token_idx_N: torch.Tensor, live_N: torch.Tensor | None, num_tokens: int, topk: int) -> SlotMap:
    """Slot map of an expert-major layout whose row ``r`` holds token ``token_idx_N[r]``.

    ``live_N`` marks the rows that carry a non-zero probability (None: all of them, and then every
    token must own exactly ``topk`` rows, as in dropless routing). A stable sort of the rows by token
    keeps each token's rows in ascending expert order: O(N log N), no [T, E] temporaries, no host sync.
    """
    if live_N is None:
        if token_idx_N.shape[0] != num_tokens * topk:
            raise ValueError(
                f"slot_map: {token_idx_N.shape[0]} rows for {num_tokens} tokens x top-{topk}; pass live_N "
                "when tokens do not all own exactly top-k rows"
            )
        order = torch.argsort(token_idx_N, stable=True)
        return SlotMap(row_TK=order.view(num_tokens, topk))
    device = token_idx_N.device
    num_rows = token_idx_N.shape[0]
    k = min(topk, max(num_rows, 1))
    if num_rows == 0:
        return SlotMap(
            row_TK=torch.zeros(num_tokens, k, dtype=torch.int64, device=device),
            valid_TK=torch.zeros(num_tokens, k, dtype=torch.bool, device=device),
        )
    # Sort rows by (token, live first); stability keeps ascending expert order inside each group.
    key_N = token_idx_N * 2 + (~live_N).to(token_idx_N.dtype)
    order = torch.argsort(key_N, stable=True)
    sorted_key = key_N[order]
    first = 2 * torch.arange(num_tokens, device=device, dtype=key_N.dtype)
    start_T = torch.searchsorted(sorted_key, first)
    live_T = torch.searchsorted(sorted_key, first + 1) - start_T
    slot = torch.arange(k, device=device)
    valid_TK = slot.view(1, -1) < live_T.view(-1, 1)
    idx_TK = (start_T.view(-1, 1) + slot.view(1, -1)).clamp(max=num_rows - 1)
    row_TK = torch.where(valid_TK, order[idx_TK], 0)
    return SlotMap(row_TK=row_TK, valid_TK=valid_TK)
