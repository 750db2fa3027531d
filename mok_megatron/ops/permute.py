"""Permute tokens into the expert-major layout and combine expert outputs back, deterministically.

Legend:
    T  local tokens          N  permuted rows          H  hidden size
    K  slots per token (router top-k)

``permute_tokens``: ``x_NH[r] = x_TH[token_idx_N[r]]``. Its gradient is the per-token sum of the row
gradients, computed through the slot map as a gather (no atomics, same order every run).

``combine_tokens``: ``out_TH[t] = sum_k y_NH[row_TK[t, k]]`` over valid slots, accumulated in fp32
(rounded once) in ascending expert order. Its gradient copies each token's gradient to its rows (each row belongs to at
most one slot, so this is a plain indexed copy).

``permute_tokens_reference`` / ``combine_tokens_reference`` are the index_select / index_add versions
(Megatron's unfused path) that the tests hold these against.

On CUDA with Triton the gather-sum runs as ``mok_megatron.kernels.permute.gather_sum_rows`` (one pass,
masked slots never read, fp32 accumulation in the same fixed k order). When every slot is valid (dropless:
the slot map is a permutation of the rows) the token-to-rows copy (permute forward, combine backward) runs
as ``kernels.permute.scatter_rows`` (each token row read once, written to its K rows, one launch), and
``permute_tokens_with_probs`` moves the routing probabilities in the same pass; with invalid slots the
copy is a row gather through the inverse slot map. On CPU everything runs as the torch code below
(the Triton paths too under ``TRITON_INTERPRET=1``: ``ops.fast``).
"""

from __future__ import annotations

import torch

from mok_megatron.ops.fast import triton_path
from mok_megatron.ops.routing import SlotMap


def _fast(t: torch.Tensor) -> bool:
    return triton_path(t, "permute")


def _dense_meta(slots: SlotMap, num_rows: int):
    """Routing metadata for the Triton scatter of a layout whose rows all belong to some slot (``valid_TK
    is None``): one group without padding, so the kernel's zero-fill step has nothing to do."""
    from mok_megatron.kernels.routing import RoutingMeta

    if num_rows != slots.row_TK.numel():
        raise ValueError(
            f"dense permute: {num_rows} rows but {slots.row_TK.numel()} slots; every row needs a slot"
        )
    offs = slots.dense_offsets32
    return RoutingMeta(offs, offs, offs, slots.rows32_TK, num_rows, 1)


def _gather_sum(src_NH: torch.Tensor, slots: SlotMap) -> torch.Tensor:
    num_tokens, k = slots.row_TK.shape
    hidden = src_NH.shape[-1]
    if src_NH.shape[0] == 0 or k == 0:
        return src_NH.new_zeros((num_tokens, hidden))
    if _fast(src_NH):
        from mok_megatron.kernels.permute import gather_sum_rows

        return gather_sum_rows(src_NH, slots.rows32_TK, src_NH.dtype)[0]
    picked_TKH = src_NH.index_select(0, slots.row_TK.reshape(-1)).view(num_tokens, k, hidden)
    if slots.valid_TK is not None:
        picked_TKH = torch.where(slots.valid_TK.unsqueeze(-1), picked_TKH, 0)
    # Reductions accumulate bf16/fp16 in fp32 and round once.
    return picked_TKH.sum(dim=1)


def _scatter_copy(src_TH: torch.Tensor, slots: SlotMap, num_rows: int) -> torch.Tensor:
    num_tokens, k = slots.row_TK.shape
    hidden = src_TH.shape[-1]
    if num_rows == 0 or k == 0:
        return src_TH.new_zeros((num_rows, hidden))
    rows = slots.row_TK.reshape(-1)
    if _fast(src_TH):
        if slots.valid_TK is None:  # every row is exactly one slot's: one scatter pass
            from mok_megatron.kernels.permute import scatter_rows

            return scatter_rows(src_TH, _dense_meta(slots, num_rows), src_TH.dtype)[0]
        # Each row belongs to at most one slot: gather every row's token instead of scattering tokens.
        tok = torch.arange(num_tokens, device=src_TH.device).repeat_interleave(k)
        # Rows no slot owns read an appended zero row (invalid slots all write that spare entry).
        valid = slots.valid_TK.reshape(-1)
        owner = torch.full((num_rows + 1,), num_tokens, dtype=torch.int64, device=src_TH.device)
        owner.index_copy_(0, torch.where(valid, rows, num_rows), torch.where(valid, tok, num_tokens))
        padded = torch.cat([src_TH, src_TH.new_zeros((1, hidden))])
        return padded.index_select(0, owner[:num_rows])
    if slots.valid_TK is not None:
        # Invalid slots write into a spare row that is dropped (no mask indexing: no host sync).
        rows = torch.where(slots.valid_TK.reshape(-1), rows, num_rows)
    out_NH = src_TH.new_zeros((num_rows + 1, hidden))
    out_NH.index_copy_(0, rows, src_TH.unsqueeze(1).expand(num_tokens, k, hidden).reshape(-1, hidden))
    return out_NH[:num_rows]


class _Permute(torch.autograd.Function):
    # The SlotMap rides on ctx (not saved tensors) so that its cached int32 row map is built once per map.
    @staticmethod
    def forward(ctx, x_TH, token_idx_N, slots):
        ctx.slots = slots
        if slots.valid_TK is None and x_TH.shape[0] and _fast(x_TH):
            return _scatter_copy(x_TH.contiguous(), slots, token_idx_N.shape[0])
        return x_TH.index_select(0, token_idx_N)

    @staticmethod
    def backward(ctx, dx_NH):
        return _gather_sum(dx_NH.contiguous(), ctx.slots), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_NH, slots):
        ctx.slots = slots
        ctx.num_rows = y_NH.shape[0]
        return _gather_sum(y_NH, ctx.slots)

    @staticmethod
    def backward(ctx, dout_TH):
        return _scatter_copy(dout_TH.contiguous(), ctx.slots, ctx.num_rows), None


class _PermuteWithRegions(torch.autograd.Function):
    """``_Permute`` that also hands out consecutive row ranges of ``x_TH`` (views), with one gradient:
    the permute's gather-sum, each range's gradient added into its rows in place (no zero-filled
    gradient per range, no concatenation, no full-size sum)."""

    @staticmethod
    def forward(ctx, x_TH, token_idx_N, slots, ranges):
        ctx.set_materialize_grads(False)  # an unused range adds nothing (no zero-filled gradient)
        ctx.slots, ctx.ranges, ctx.x_like = slots, ranges, (x_TH.shape, x_TH.dtype, x_TH.device)
        x_NH = _Permute.forward(ctx, x_TH, token_idx_N, slots)
        return (x_NH, *(x_TH[lo:hi] for lo, hi in ranges))

    @staticmethod
    def backward(ctx, dx_NH, *d_ranges):
        if dx_NH is None:  # the permuted rows fed nothing that needs a gradient
            shape, dtype, device = ctx.x_like
            dx_TH = torch.zeros(shape, dtype=dtype, device=device)
        else:
            dx_TH = _gather_sum(dx_NH.contiguous(), ctx.slots)
        for (lo, hi), d in zip(ctx.ranges, d_ranges, strict=True):
            if d is not None and hi > lo:
                dx_TH[lo:hi].add_(d)
        return dx_TH, None, None, None


def permute_tokens_with_ranges(
    x_TH: torch.Tensor, token_idx_N: torch.Tensor, slots: SlotMap, ranges: tuple[tuple[int, int], ...]
) -> tuple[torch.Tensor, ...]:
    """``(permute_tokens(x_TH, token_idx_N, slots), x_TH[lo:hi] for (lo, hi) in ranges)``, differentiable,
    with the gradient built in one buffer (the pipeline's packed rows and its local regions)."""
    for lo, hi in ranges:
        if not 0 <= lo <= hi <= x_TH.shape[0]:
            raise ValueError(f"range ({lo}, {hi}) is outside the {x_TH.shape[0]} rows of x_TH")
    return _PermuteWithRegions.apply(x_TH, token_idx_N, slots, tuple(ranges))


def permute_tokens(x_TH: torch.Tensor, token_idx_N: torch.Tensor, slots: SlotMap) -> torch.Tensor:
    """Inputs: x_TH [T, H]; token_idx_N [N] int64; slots (row_TK, valid_TK). Output: x_NH [N, H]."""
    return _Permute.apply(x_TH, token_idx_N, slots)


def permute_tokens_with_probs(
    x_TH: torch.Tensor,
    probs_TE: torch.Tensor,
    token_idx_N: torch.Tensor,
    expert_idx_N: torch.Tensor,
    slots: SlotMap,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_NH, probs_N)``: ``permute_tokens`` and ``probs_N[r] = probs_TE[token_idx_N[r], expert_idx_N[r]]``.

    Inputs: x_TH [T, H]; probs_TE [T, E] (router dtype); token_idx_N / expert_idx_N [N] int64; slots.
    Outputs: x_NH [N, H] x's dtype; probs_N [N] probs' dtype. Differentiable in x and probs.
    On CUDA with every slot valid: one Triton pass moves rows and probabilities (``kernels.permute``),
    whose backward is one gather-sum pass for both gradients."""
    num_rows = token_idx_N.shape[0]
    if slots.valid_TK is None and x_TH.shape[0] and num_rows and _fast(x_TH):
        from mok_megatron.kernels.permute import permute

        probs_TK = probs_TE.gather(1, expert_idx_N[slots.row_TK])  # slot (t, k)'s probability
        return permute(x_TH, _dense_meta(slots, num_rows), probs_TK)
    return permute_tokens(x_TH, token_idx_N, slots), probs_TE[token_idx_N, expert_idx_N]


def combine_tokens(y_NH: torch.Tensor, slots: SlotMap) -> torch.Tensor:
    """Inputs: y_NH [N, H] (already scaled by the router probabilities); slots. Output: [T, H]."""
    return _Combine.apply(y_NH, slots)


def permute_tokens_reference(x_TH: torch.Tensor, token_idx_N: torch.Tensor) -> torch.Tensor:
    return x_TH.index_select(0, token_idx_N)


def combine_tokens_reference(y_NH: torch.Tensor, token_idx_N: torch.Tensor, num_tokens: int) -> torch.Tensor:
    out = torch.zeros((num_tokens, y_NH.shape[-1]), dtype=y_NH.dtype, device=y_NH.device)
    return out.index_add(0, token_idx_N, y_NH)
