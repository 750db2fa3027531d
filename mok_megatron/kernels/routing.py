"""Routing metadata on the device from top-k expert ids, without a host synchronisation.

Legend: T tokens, K routes per token, E experts, N = T*K routes (flat, token-major), B blocks of routes,
A alignment, R rows of the expert-major buffer (``num_rows``, a static upper bound).

Layout: expert-major; inside an expert, routes in flat ``(token, k)`` order. With the distinct ids per token
that a router's top-k gives, that is ascending token order: exactly ``ops.routing.dropless_order``. With
``alignment`` A > 1 each expert's rows are padded to a multiple of A (padding after the expert's real rows),
the group sizes Hopper grouped GEMMs like best. Ids outside ``[0, E)`` (e.g. -1 for a dropped route) get no
row (``row_TK == -1``) and are not counted.

Three launches: per block, each route's rank among the block's routes to its expert and the block's
histogram; one program scans the histograms (exclusive per expert) and turns the totals into
counts/offsets; per block, ``row = aligned_start[e] + block_base[b, e] + rank``.

How it plugs in: replaces ``ops.routing.dropless_order`` + ``slot_map`` + ``expert_counts`` and
``ops.grouped_gemm.offsets_from_counts`` when the plan is built from ``topk_idx`` instead of a
``[T, E]`` routing map: ``row_TK`` is the slot map (router k order instead of ascending-expert order),
``aligned_offsets_E`` is the grouped GEMM's ``offs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mok_megatron.kernels import Impl, jit, next_pow2, tl, use_triton

MAX_EXPERTS = 4096


@dataclass(frozen=True)
class RoutingMeta:
    """Where each route goes. All tensors int32 on the ids' device.

    counts_E           routes per expert
    offsets_E          inclusive cumulative counts (``torch._grouped_mm`` offs of the unpadded layout)
    aligned_offsets_E  inclusive cumulative counts rounded up to ``alignment`` (== offsets_E when 1)
    row_TK             row of route (t, k) in the aligned expert-major buffer; -1 for a dropped route
    num_rows           rows to allocate for that buffer (static bound: N + min(E, N) * (alignment - 1))
    """

    counts_E: torch.Tensor
    offsets_E: torch.Tensor
    aligned_offsets_E: torch.Tensor
    row_TK: torch.Tensor
    num_rows: int
    alignment: int

    @property
    def num_experts(self) -> int:
        return self.counts_E.shape[0]


def _validate(topk_idx_TK: torch.Tensor, num_experts: int, alignment: int) -> None:
    if topk_idx_TK.dim() != 2:
        raise ValueError(f"routing_metadata: topk_idx has shape {tuple(topk_idx_TK.shape)}, expected [T, K]")
    if topk_idx_TK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"routing_metadata: topk_idx has dtype {topk_idx_TK.dtype}, expected int32 or int64")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"routing_metadata: num_experts={num_experts}, expected 1..{MAX_EXPERTS}")
    if alignment < 1:
        raise ValueError(f"routing_metadata: alignment={alignment}, expected >= 1 (1 = no padding)")
    if topk_idx_TK.numel() >= 2**31 - num_experts * alignment:
        raise ValueError(f"routing_metadata: {topk_idx_TK.numel()} routes overflow int32 row indices")


def num_rows_bound(num_routes: int, num_experts: int, alignment: int) -> int:
    """Rows of the aligned buffer in the worst case (each non-empty expert padded by alignment - 1)."""
    return num_routes + min(num_experts, num_routes) * (alignment - 1)


def routing_metadata(
    topk_idx_TK: torch.Tensor, num_experts: int, alignment: int = 1, impl: Impl = Impl.AUTO
) -> RoutingMeta:
    """Inputs: topk_idx_TK int32/int64 [T, K] (expert per route; outside [0, E) = dropped).
    Outputs: RoutingMeta (int32 tensors on the ids' device), computed without a host sync."""
    _validate(topk_idx_TK, num_experts, alignment)
    if use_triton(impl, topk_idx_TK, "routing_metadata"):
        return _routing_metadata_triton(topk_idx_TK, num_experts, alignment)
    return routing_metadata_reference(topk_idx_TK, num_experts, alignment)


def routing_metadata_reference(
    topk_idx_TK: torch.Tensor, num_experts: int, alignment: int = 1
) -> RoutingMeta:
    """Pure torch: a stable argsort of the flat ids (dropped routes sort last, under key E)."""
    _validate(topk_idx_TK, num_experts, alignment)
    device = topk_idx_TK.device
    num_tokens, topk = topk_idx_TK.shape
    flat_N = topk_idx_TK.reshape(-1).long()
    live_N = (flat_N >= 0) & (flat_N < num_experts)
    key_N = torch.where(live_N, flat_N, num_experts)
    order_N = torch.argsort(key_N, stable=True)
    pos_N = torch.empty_like(order_N)
    pos_N[order_N] = torch.arange(flat_N.numel(), device=device)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key_N, torch.ones_like(key_N))
    counts_E = counts[:num_experts]
    offsets_E = counts_E.cumsum(0)
    aligned_E = (counts_E + alignment - 1) // alignment * alignment
    aligned_offsets_E = aligned_E.cumsum(0)
    # Position inside the expert, then the expert's aligned start (index E: a dummy for dropped routes).
    zero = counts_E.new_zeros(1)
    start_E1 = torch.cat([offsets_E - counts_E, zero])
    aligned_start_E1 = torch.cat([aligned_offsets_E - aligned_E, zero])
    row_N = pos_N - start_E1[key_N] + aligned_start_E1[key_N]
    row_N = torch.where(live_N, row_N, -1)
    i32 = torch.int32
    return RoutingMeta(
        counts_E=counts_E.to(i32),
        offsets_E=offsets_E.to(i32),
        aligned_offsets_E=aligned_offsets_E.to(i32),
        row_TK=row_N.to(i32).view(num_tokens, topk),
        num_rows=num_rows_bound(flat_N.numel(), num_experts, alignment),
        alignment=alignment,
    )


# ---- Triton -----------------------------------------------------------------------------------------------


@jit
def _rank_in_block_kernel(
    ids_ptr, rank_ptr, hist_ptr, num_routes, num_experts, BLOCK: tl.constexpr, E_P2: tl.constexpr
):
    """rank[i] = routes before i in this block with i's expert; hist[b, e] = routes of the block to e."""
    b = tl.program_id(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_routes
    e = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    live = in_range & (e >= 0) & (e < num_experts)
    experts = tl.arange(0, E_P2)
    onehot = ((e[:, None] == experts[None, :]) & live[:, None]).to(tl.int32)  # [BLOCK, E_P2]
    seen = tl.cumsum(onehot, axis=0)
    rank = tl.sum(seen * onehot, axis=1) - 1  # -1 for dropped routes
    tl.store(rank_ptr + offs, rank, mask=in_range)
    tl.store(hist_ptr + b * num_experts + experts, tl.sum(onehot, axis=0), mask=experts < num_experts)


@jit
def _scan_kernel(
    hist_ptr,
    counts_ptr,
    offsets_ptr,
    aligned_offsets_ptr,
    aligned_start_ptr,
    num_blocks,
    num_experts,
    alignment,
    CHUNK: tl.constexpr,
    E_P2: tl.constexpr,
):
    """One program: hist[b, e] becomes the exclusive count of e's routes in blocks before b (in place)."""
    experts = tl.arange(0, E_P2)
    e_ok = experts < num_experts
    carry = tl.zeros([E_P2], dtype=tl.int32)
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        mask = (blocks < num_blocks)[:, None] & e_ok[None, :]
        ptrs = hist_ptr + blocks[:, None] * num_experts + experts[None, :]
        h = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(h, axis=0) - h + carry[None, :], mask=mask)
        carry = carry + tl.sum(h, axis=0)
    aligned = (carry + alignment - 1) // alignment * alignment
    aligned_offsets = tl.cumsum(aligned, axis=0)
    tl.store(counts_ptr + experts, carry, mask=e_ok)
    tl.store(offsets_ptr + experts, tl.cumsum(carry, axis=0), mask=e_ok)
    tl.store(aligned_offsets_ptr + experts, aligned_offsets, mask=e_ok)
    tl.store(aligned_start_ptr + experts, aligned_offsets - aligned, mask=e_ok)


@jit
def _place_kernel(
    ids_ptr, rank_ptr, base_ptr, aligned_start_ptr, row_ptr, num_routes, num_experts, BLOCK: tl.constexpr
):
    b = tl.program_id(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_routes
    e = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    live = in_range & (e >= 0) & (e < num_experts)
    e = tl.where(live, e, 0)
    rank = tl.load(rank_ptr + offs, mask=in_range, other=0)
    base = tl.load(base_ptr + b * num_experts + e, mask=live, other=0)
    start = tl.load(aligned_start_ptr + e, mask=live, other=0)
    tl.store(row_ptr + offs, tl.where(live, start + base + rank, -1), mask=in_range)


# One-hot tiles of BLOCK x E_P2 int32: 8192 elements keep them in registers at 4 warps.
_TILE = 8192


def _routing_metadata_triton(topk_idx_TK: torch.Tensor, num_experts: int, alignment: int) -> RoutingMeta:
    device = topk_idx_TK.device
    num_tokens, topk = topk_idx_TK.shape
    num_routes = num_tokens * topk
    ids_N = topk_idx_TK.contiguous().view(-1)
    e_p2 = next_pow2(num_experts)
    block = max(16, _TILE // e_p2)
    num_blocks = -(-num_routes // block)
    i32 = dict(dtype=torch.int32, device=device)
    rank_N = torch.empty(num_routes, **i32)
    hist_BE = torch.empty(num_blocks, num_experts, **i32)
    counts_E, offsets_E, aligned_offsets_E, aligned_start_E = torch.empty(4, num_experts, **i32).unbind(0)
    row_N = torch.empty(num_routes, **i32)
    if num_blocks:
        _rank_in_block_kernel[(num_blocks,)](ids_N, rank_N, hist_BE, num_routes, num_experts, block, e_p2)
    _scan_kernel[(1,)](
        hist_BE,
        counts_E,
        offsets_E,
        aligned_offsets_E,
        aligned_start_E,
        num_blocks,
        num_experts,
        alignment,
        CHUNK=max(1, _TILE // e_p2),
        E_P2=e_p2,
    )
    if num_blocks:
        _place_kernel[(num_blocks,)](
            ids_N, rank_N, hist_BE, aligned_start_E, row_N, num_routes, num_experts, block
        )
    return RoutingMeta(
        counts_E=counts_E,
        offsets_E=offsets_E,
        aligned_offsets_E=aligned_offsets_E,
        row_TK=row_N.view(num_tokens, topk),
        num_rows=num_rows_bound(num_routes, num_experts, alignment),
        alignment=alignment,
    )
