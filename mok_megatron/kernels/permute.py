"""Permute: token rows (and their router probabilities) into the expert-major buffer, deterministically.

Legend: T tokens, K routes per token, H hidden, E experts, R rows of the buffer (``RoutingMeta.num_rows``).

``x_RH[row_TK[t, k]] = x_TH[t]`` (cast to ``out_dtype``) and ``probs_R[row_TK[t, k]] = probs_TK[t, k]``; every
row no route lands on (alignment padding, the tail past ``aligned_offsets_E[-1]``) is zero, so grouped GEMMs and
their weight gradients over padded groups see zeros. The backward is the per-token gather-sum
``dx_TH[t] = sum_k dx_RH[row_TK[t, k]]`` in fp32, fixed k order, no atomics.

The two row-movement kernels live here and are shared with ``combine`` (whose forward is the gather-sum and
whose backward is the scatter):
    _scatter_kernel     one program per token: read its row once, write it (times an optional per-route
                        scale, optionally dotted with the destination rows of a second buffer) to its K rows;
                        extra programs zero the rows no route lands on
    _gather_sum_kernel  one program per (token, H block): sum the token's K rows (optionally weighted)

How it plugs in: ``ops.permute.permute_tokens_with_probs`` (``engine.plain.dispatch_preprocess``) runs
``permute`` for dropless layouts on CUDA, rows and probabilities in one pass, with a one-group ``RoutingMeta``
built from the plan's slot map; ``scatter_rows`` is also the combine backward there, and ``gather_sum_rows``
the combine forward and permute backward. ``kernels.routing.routing_metadata`` (aligned groups) is not yet
what the plan is built from.
"""

from __future__ import annotations

import torch

from mok_megatron.kernels import Impl, jit, next_pow2, tl, use_triton
from mok_megatron.kernels.routing import RoutingMeta

BLOCK_H_MAX = 2048  # elements of a token row per step of the scatter (16 B per thread at 4 warps, bf16)
FILL_ROWS = 8  # zero rows per step of a fill program
FILL_PROGRAMS_MAX = 512  # fill programs loop over the (device-sized) fill range with this stride


@jit
def _scatter_kernel(
    src_ptr,  # [T, H] token rows
    row_ptr,  # [T, K] int32 destination rows, -1 = dropped
    scale_ptr,  # [T, K] per-route factor (HAS_SCALE)
    dst_ptr,  # [R, H] expert-major rows
    other_ptr,  # [R, H] rows dotted with the source (HAS_DOT)
    dot_ptr,  # [T, K] the dots (HAS_DOT)
    psrc_ptr,  # [T, K] per-route values moved along (HAS_PROBS)
    pdst_ptr,  # [R] their expert-major copy (HAS_PROBS)
    offsets_ptr,  # [E] inclusive offsets, unpadded
    aligned_offsets_ptr,  # [E] inclusive offsets, aligned
    num_tokens,
    hidden,
    num_rows,
    num_experts,
    fill_stride,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    E_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FILL_ROWS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_DOT: tl.constexpr,
    HAS_PROBS: tl.constexpr,
):
    pid = tl.program_id(0)
    ks = tl.arange(0, K_P2)
    if pid < num_tokens:
        t = pid.to(tl.int64)
        if HAS_PROBS:
            rows_k = tl.load(row_ptr + t * K + ks, mask=ks < K, other=-1)
            p = tl.load(psrc_ptr + t * K + ks, mask=ks < K, other=0)
            tl.store(pdst_ptr + rows_k, p.to(pdst_ptr.dtype.element_ty), mask=rows_k >= 0)
        dots = tl.zeros([K_P2], dtype=tl.float32)
        for h0 in range(0, hidden, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            in_row = cols < hidden
            x = tl.load(src_ptr + t * hidden + cols, mask=in_row, other=0).to(tl.float32)
            for k in tl.static_range(K):
                row = tl.load(row_ptr + t * K + k).to(tl.int64)
                ok = in_row & (row >= 0)
                v = x
                if HAS_SCALE:
                    v = x * tl.load(scale_ptr + t * K + k).to(tl.float32)
                tl.store(dst_ptr + row * hidden + cols, v.to(dst_ptr.dtype.element_ty), mask=ok)
                if HAS_DOT:
                    y = tl.load(other_ptr + row * hidden + cols, mask=ok, other=0).to(tl.float32)
                    dots = tl.where(ks == k, dots + tl.sum(x * y, axis=0), dots)
        if HAS_DOT:
            tl.store(dot_ptr + t * K + ks, dots.to(dot_ptr.dtype.element_ty), mask=ks < K)
    else:
        pad, num_fill = _fill_setup(offsets_ptr, aligned_offsets_ptr, num_rows, num_experts, E_P2)
        zeros = tl.zeros([FILL_ROWS, BLOCK_H], dtype=tl.float32).to(dst_ptr.dtype.element_ty)
        for q0 in range((pid - num_tokens) * FILL_ROWS, num_fill, fill_stride):
            rows, q_ok = _fill_rows(q0, pad, num_fill, offsets_ptr, num_experts, FILL_ROWS)
            if HAS_PROBS:
                tl.store(
                    pdst_ptr + rows,
                    tl.zeros([FILL_ROWS], tl.float32).to(pdst_ptr.dtype.element_ty),
                    mask=q_ok,
                )
            for h0 in range(0, hidden, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                mask = q_ok[:, None] & (cols < hidden)[None, :]
                tl.store(dst_ptr + rows[:, None] * hidden + cols[None, :], zeros, mask=mask)


@jit
def _fill_setup(offsets_ptr, aligned_offsets_ptr, num_rows, num_experts, E_P2: tl.constexpr):
    """The rows no route lands on, numbered q = 0.. (expert 0's padding, expert 1's, ..., the tail):
    ``(pad_E, num_fill)`` with pad_e = aligned_offsets[e] - offsets[e] (huge past E)."""
    experts = tl.arange(0, E_P2)
    e_ok = experts < num_experts
    offsets = tl.load(offsets_ptr + experts, mask=e_ok, other=0)
    pad = tl.load(aligned_offsets_ptr + experts, mask=e_ok, other=0) - offsets
    pad = tl.where(e_ok, pad, 2147483647)
    return pad, num_rows - tl.load(offsets_ptr + num_experts - 1)


@jit
def _fill_rows(q0, pad, num_fill, offsets_ptr, num_experts, FILL_ROWS: tl.constexpr):
    """Rows (int64) of fill numbers q0 .. q0 + FILL_ROWS - 1 and their mask: fill row q sits in expert
    e = #{e : pad_e <= q} (E: the tail) at row q + offsets[min(e, E-1)]."""
    q = q0 + tl.arange(0, FILL_ROWS)
    q_ok = q < num_fill
    e = tl.sum((pad[None, :] <= q[:, None]).to(tl.int32), axis=1)
    e = tl.minimum(e, num_experts - 1)
    return (q + tl.load(offsets_ptr + e, mask=q_ok, other=0)).to(tl.int64), q_ok


@jit
def _gather_sum_kernel(
    src_ptr,  # [R, H] expert-major rows
    row_ptr,  # [T, K] int32 rows, -1 = dropped
    weight_ptr,  # [T, K] per-route weight (HAS_WEIGHT)
    out_ptr,  # [T, H]
    psrc_ptr,  # [R] per-row values gathered back (HAS_PROBS)
    pdst_ptr,  # [T, K] (HAS_PROBS; 0 for dropped routes)
    hidden,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_PROBS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(K):  # fixed order, fp32: the same bits every run
        row = tl.load(row_ptr + t * K + k).to(tl.int64)
        ok = row >= 0
        y = tl.load(src_ptr + row * hidden + cols, mask=in_row & ok, other=0).to(tl.float32)
        if HAS_WEIGHT:
            y = y * tl.load(weight_ptr + t * K + k, mask=ok, other=0).to(tl.float32)
        acc += y
    tl.store(out_ptr + t * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=in_row)
    if HAS_PROBS:
        if hb == 0:
            ks = tl.arange(0, K_P2)
            rows_k = tl.load(row_ptr + t * K + ks, mask=ks < K, other=-1)
            p = tl.load(psrc_ptr + rows_k, mask=rows_k >= 0, other=0)
            tl.store(pdst_ptr + t * K + ks, p.to(pdst_ptr.dtype.element_ty), mask=ks < K)


def scatter_rows(
    src_TH: torch.Tensor,
    meta: RoutingMeta,
    out_dtype: torch.dtype,
    scale_TK: torch.Tensor | None = None,
    other_RH: torch.Tensor | None = None,
    probs_TK: torch.Tensor | None = None,
    fill: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Triton launcher: ``(dst_RH, dots_TK | None, probs_R | None)``. ``dots_TK[t, k]`` = fp32 dot of the
    unscaled ``src_TH[t]`` with ``other_RH[row_TK[t, k]]``, returned in ``scale_TK``'s dtype. ``fill`` False:
    the rows no route lands on are left unwritten (no fill programs)."""
    num_tokens, hidden = src_TH.shape
    topk = meta.row_TK.shape[1]
    num_rows = meta.num_rows
    dst_RH = torch.empty(num_rows, hidden, dtype=out_dtype, device=src_TH.device)
    dots_TK = (
        None
        if other_RH is None
        else torch.empty(num_tokens, topk, dtype=scale_TK.dtype, device=src_TH.device)
    )
    probs_R = None if probs_TK is None else torch.empty(num_rows, dtype=probs_TK.dtype, device=src_TH.device)
    if num_rows == 0 or (num_tokens == 0 and not fill):  # nothing to move (or fill)
        return dst_RH, dots_TK, probs_R
    block_h = min(next_pow2(hidden), BLOCK_H_MAX)
    fill_programs = min(-(-num_rows // FILL_ROWS), FILL_PROGRAMS_MAX) if fill else 0
    src_TH = src_TH.contiguous()
    dummy = dst_RH
    _scatter_kernel[(num_tokens + fill_programs,)](
        src_TH,
        meta.row_TK,
        dummy if scale_TK is None else scale_TK.contiguous(),
        dst_RH,
        dummy if other_RH is None else other_RH.contiguous(),
        dummy if dots_TK is None else dots_TK,
        dummy if probs_TK is None else probs_TK.contiguous(),
        dummy if probs_R is None else probs_R,
        meta.offsets_E,
        meta.aligned_offsets_E,
        num_tokens,
        hidden,
        num_rows,
        meta.num_experts,
        max(fill_programs, 1) * FILL_ROWS,
        K=topk,
        K_P2=next_pow2(topk),
        E_P2=next_pow2(meta.num_experts),
        BLOCK_H=block_h,
        FILL_ROWS=FILL_ROWS,
        HAS_SCALE=scale_TK is not None,
        HAS_DOT=other_RH is not None,
        HAS_PROBS=probs_TK is not None,
        num_warps=4 if block_h <= 1024 else 8,
    )
    return dst_RH, dots_TK, probs_R


GATHER_BLOCK_H = 1024


def gather_sum_rows(
    src_RH: torch.Tensor,
    row_TK: torch.Tensor,
    out_dtype: torch.dtype,
    weight_TK: torch.Tensor | None = None,
    probs_R: torch.Tensor | None = None,
    probs_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton launcher: ``(out_TH, probs_TK | None)`` with ``out_TH[t] = sum_k w[t, k] * src_RH[row_TK[t, k]]``."""
    num_tokens, topk = row_TK.shape
    hidden = src_RH.shape[1]
    out_TH = torch.empty(num_tokens, hidden, dtype=out_dtype, device=src_RH.device)
    probs_TK = None
    if probs_R is not None:
        # Every entry is written (0 for a dropped route): no zero fill needed.
        probs_TK = torch.empty(num_tokens, topk, dtype=probs_dtype or probs_R.dtype, device=src_RH.device)
    if num_tokens == 0:
        return out_TH, probs_TK
    block_h = min(next_pow2(max(hidden, 1)), GATHER_BLOCK_H)
    src_RH = src_RH.contiguous()
    _gather_sum_kernel[(num_tokens, max(1, -(-hidden // block_h)))](
        src_RH,
        row_TK,
        out_TH if weight_TK is None else weight_TK.contiguous(),
        out_TH,
        out_TH if probs_R is None else probs_R.contiguous(),
        out_TH if probs_TK is None else probs_TK,
        hidden,
        K=topk,
        K_P2=next_pow2(topk),
        BLOCK_H=block_h,
        HAS_WEIGHT=weight_TK is not None,
        HAS_PROBS=probs_R is not None,
    )
    return out_TH, probs_TK


# ---- the op -----------------------------------------------------------------------------------------------


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, probs_TK, meta, out_dtype, fill):
        ctx.meta = meta
        ctx.x_dtype = x_TH.dtype
        ctx.probs_dtype = None if probs_TK is None else probs_TK.dtype
        x_RH, _, probs_R = scatter_rows(x_TH, meta, out_dtype, probs_TK=probs_TK, fill=fill)
        if probs_R is None:
            return x_RH, x_RH.new_empty(0)
        return x_RH, probs_R

    @staticmethod
    def backward(ctx, dx_RH, dprobs_R):
        want_probs = ctx.probs_dtype is not None and ctx.needs_input_grad[1]
        dx_TH, dprobs_TK = gather_sum_rows(
            dx_RH,
            ctx.meta.row_TK,
            ctx.x_dtype,
            probs_R=dprobs_R if want_probs else None,
            probs_dtype=ctx.probs_dtype,
        )
        return dx_TH, dprobs_TK, None, None, None


def _validate(x_TH: torch.Tensor, meta: RoutingMeta, probs_TK: torch.Tensor | None, op: str) -> None:
    if x_TH.dim() != 2 or x_TH.shape[0] != meta.row_TK.shape[0]:
        raise ValueError(
            f"{op}: x has shape {tuple(x_TH.shape)}, expected [T, H] with T = {meta.row_TK.shape[0]} tokens "
            "of the routing metadata"
        )
    if probs_TK is not None and probs_TK.shape != meta.row_TK.shape:
        raise ValueError(
            f"{op}: probs has shape {tuple(probs_TK.shape)}, expected {tuple(meta.row_TK.shape)}"
        )
    check_devices(op, meta, x=x_TH, probs=probs_TK)


def check_devices(op: str, meta: RoutingMeta, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != meta.row_TK.device:
            raise ValueError(
                f"{op}: {name} is on {t.device} but the routing metadata is on {meta.row_TK.device}"
            )


def permute(
    x_TH: torch.Tensor,
    meta: RoutingMeta,
    probs_TK: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    impl: Impl = Impl.AUTO,
    zero_spare_rows: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inputs: x_TH [T, H]; meta from routing_metadata; probs_TK [T, K] or None; out_dtype (default x's).
    Outputs: x_RH [R, H] out_dtype (zero rows where no route lands), probs_R [R] probs' dtype or None.
    Differentiable in x and probs. ``zero_spare_rows`` False (alignment 1 only: no padding inside the groups):
    the rows past the last group, which no grouped GEMM reads (a static buffer's spare rows), are left
    unwritten instead of zeroed (the Triton path; the torch path zeroes them)."""
    _validate(x_TH, meta, probs_TK, "permute")
    if not zero_spare_rows and meta.alignment != 1:
        raise ValueError(
            f"permute: zero_spare_rows=False with alignment {meta.alignment}: padding inside the groups must "
            "be zero; leave zero_spare_rows=True for aligned layouts."
        )
    out_dtype = out_dtype or x_TH.dtype
    if not use_triton(impl, x_TH, "permute"):
        return permute_reference(x_TH, meta, probs_TK, out_dtype)
    x_RH, probs_R = _Permute.apply(x_TH, probs_TK, meta, out_dtype, zero_spare_rows)
    return x_RH, (probs_R if probs_TK is not None else None)


def permute_reference(
    x_TH: torch.Tensor,
    meta: RoutingMeta,
    probs_TK: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pure torch: ``index_copy`` into zeros; dropped routes go to a spare row that is cut off (no host sync)."""
    num_tokens, topk = meta.row_TK.shape
    out_dtype = out_dtype or x_TH.dtype
    rows_N = meta.row_TK.reshape(-1).long()
    rows_N = torch.where(rows_N >= 0, rows_N, meta.num_rows)
    # Cast after the expand: the backward then sums each token's K row gradients in x's dtype (fp32 for fp32 x).
    src_NH = (
        x_TH.unsqueeze(1).expand(num_tokens, topk, x_TH.shape[1]).reshape(-1, x_TH.shape[1]).to(out_dtype)
    )
    x_RH = x_TH.new_zeros(meta.num_rows + 1, x_TH.shape[1], dtype=out_dtype).index_copy(0, rows_N, src_NH)
    probs_R = None
    if probs_TK is not None:
        probs_R = probs_TK.new_zeros(meta.num_rows + 1).index_copy(0, rows_N, probs_TK.reshape(-1))[:-1]
    return x_RH[:-1], probs_R
