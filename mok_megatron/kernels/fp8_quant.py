"""E4M3 quantization kernels for the native FP8 expert GEMMs (``fp8.native``), each beside its torch reference.

Legend: R rows, H row width (the scaled dimension), M rows split into G segments (inclusive int32 ends
``offs_G``, a device tensor), K columns, N rows of one expert's weight.

    quantize_rowwise      x [..., H]  -> q [..., H] e4m3, scale [...] fp32         one scale per row
    quantize_segments_t   x_MK        -> q_KM e4m3 (the TRANSPOSE, row-major), scale_GK fp32
                          one scale per (segment, column): the wgrad operands, whose contraction runs
                          over each expert's rows (``torch._scaled_grouped_mm`` takes A = dy^T [N, M] and
                          B = x [M, K] column-major, i.e. x^T [K, M] row-major)
    quantize_weight_t     w_GNK       -> q_GKN e4m3 (the per-expert transpose, row-major), scale_GK fp32
                          one scale per (expert, column k) over N: the dgrad's B operand; the same kernel as
                          ``quantize_segments_t`` with G segments of N rows and a per-expert output block

Numerics are the references' (``fp8.quantize``): ``scale = amax / 448`` (all-zero group: 1), ``q =
e4m3(clamp(x / scale, +-448))``, both divisions IEEE round-to-nearest (``tl.math.fdiv(..., ieee_rounding=True)``;
Triton's plain ``/`` is approximate on NVIDIA GPUs), the cast round-to-nearest-even. So the kernels are
bitwise equal to the references (tests/test_fp8_quant_kernels.py holds them to that, on CPU interpreted and
on the GPU).

Kernels:
    _rowwise_kernel       BLOCK_R rows per program; a row up to ONE_PASS_MAX wide is read once (amax, scale,
                          cast from registers), wider rows in two sweeps (the second mostly from L2)
    _segment_amax_kernel  pass 1: one program per (segment, BLOCK_K columns), looping over the segment's
                          rows: per-column amax -> scale. No atomics: each program owns its scales
    _segment_cast_kernel  pass 2: the same ownership; scale, cast, write transposed
Rows past the last offset form one extra segment (scale computed and dropped, like the reference), so every
q element is written. Segment programs loop over device-side bounds: no host read of ``offs``.

How it plugs in: ``fp8.native`` calls these on CUDA tensors (``Impl.AUTO``), the references elsewhere.
"""

from __future__ import annotations

import torch

from mok_megatron.fp8.quantize import E4M3, _check_input, quantize_segments
from mok_megatron.fp8.quantize import quantize_rowwise as quantize_rowwise_reference
from mok_megatron.kernels import INTERPRETED, Impl, jit, next_pow2, tl, use_triton

ONE_PASS_MAX = 8192  # widest row read once into registers (DeepSeek-V3 H = 7168 fits)
TWO_PASS_BLOCK = 4096
ROWWISE_TILE = 4096  # elements per program of the rowwise kernel (BLOCK_R * BLOCK_H for narrow rows)
SEG_BLOCK_M, SEG_BLOCK_K = 64, 64  # segment tiles: 128 B bf16 row pieces read, 64 B fp8 column pieces written


@jit
def _rowwise_kernel(
    x_ptr, q_ptr, s_ptr, num_rows, width, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, ONE_PASS: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    base = rows.to(tl.int64)[:, None] * width
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_H)
        mask = row_ok[:, None] & (cols < width)[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, tl.math.fdiv(amax, 448.0, ieee_rounding=True), 1.0)
        y = tl.math.fdiv(x, scale[:, None], ieee_rounding=True)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(q_ptr + base + cols[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK_R], dtype=tl.float32)
        for h0 in range(0, width, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            mask = row_ok[:, None] & (cols < width)[None, :]
            x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        scale = tl.where(amax > 0, tl.math.fdiv(amax, 448.0, ieee_rounding=True), 1.0)
        for h0 in range(0, width, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            mask = row_ok[:, None] & (cols < width)[None, :]
            x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0).to(tl.float32)
            y = tl.math.fdiv(x, scale[:, None], ieee_rounding=True)
            y = tl.minimum(tl.maximum(y, -448.0), 448.0)
            tl.store(q_ptr + base + cols[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows, scale, mask=row_ok)


@jit
def _segment_bounds(offs_ptr, g, num_rows, num_segments):
    """Rows [start, end) of segment g; g == num_segments is the spare tail past the last offset."""
    prev = tl.load(offs_ptr + tl.maximum(tl.minimum(g, num_segments) - 1, 0))
    cur = tl.load(offs_ptr + tl.maximum(tl.minimum(g, num_segments - 1), 0))
    start = tl.minimum(tl.where(g > 0, prev, 0), num_rows)
    end = tl.where(g < num_segments, tl.minimum(cur, num_rows), num_rows)
    return start, tl.maximum(end, start)


@jit
def _segment_amax_kernel(
    x_ptr,  # [M, K] row-major
    offs_ptr,  # [G] int32 inclusive segment ends
    s_ptr,  # [G + 1, K] fp32 scales (row G: the spare tail)
    num_rows,
    width,
    num_segments,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < width
    start, end = _segment_bounds(offs_ptr, g, num_rows, num_segments)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        mask = (rows < end)[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * width + cols[None, :], mask=mask, other=0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=0))
    scale = tl.where(amax > 0, tl.math.fdiv(amax, 448.0, ieee_rounding=True), 1.0)
    tl.store(s_ptr + g * width + cols, scale, mask=col_ok)


@jit
def _segment_cast_kernel(
    x_ptr,  # [M, K] row-major
    offs_ptr,  # [G] int32 inclusive segment ends
    s_ptr,  # [G + 1, K] fp32 scales from pass 1
    q_ptr,  # e4m3 out: element (m, k) of segment g at start_g * seg_mul + k * stride_k + (m - start_g)
    num_rows,
    width,
    num_segments,
    seg_mul,  # 1 for q_KM (stride_k = M); K for per-expert blocks q_GKN (stride_k = N)
    stride_k,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < width
    start, end = _segment_bounds(offs_ptr, g, num_rows, num_segments)
    scale = tl.load(s_ptr + g * width + cols, mask=col_ok, other=1.0)
    out_base = q_ptr + start.to(tl.int64) * seg_mul - start + cols.to(tl.int64)[None, :] * stride_k
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        mask = (rows < end)[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * width + cols[None, :], mask=mask, other=0)
        y = tl.math.fdiv(x.to(tl.float32), scale[None, :], ieee_rounding=True)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(out_base + rows[:, None], y.to(q_ptr.dtype.element_ty), mask=mask)


# ---- wrappers -------------------------------------------------------------------------------------------------


def _q_buffer(shape, device) -> torch.Tensor:
    """The kernels' q output. Interpreted on CPU, an fp32 buffer cast to e4m3 by torch afterwards
    (``_finish``): Triton's interpreter rounds fp32 -> e4m3 wrongly when the mantissa carries into the
    exponent (127.8 -> 64, not 128; triton 3.8 ``interpreter._convert_float``). Everything else (amax,
    scales, division, clamp, the layout) is the kernel's own; on the GPU the cast is the hardware's
    ``cvt.rn.satfinite`` and the q buffer is e4m3."""
    emulate = INTERPRETED and torch.device(device).type == "cpu"
    return torch.empty(shape, dtype=torch.float32 if emulate else E4M3, device=device)


def _finish(q: torch.Tensor) -> torch.Tensor:
    return q if q.dtype == E4M3 else q.to(E4M3)


def _rowwise_blocks(width: int) -> tuple[int, int, bool, int]:
    """(BLOCK_R, BLOCK_H, ONE_PASS, num_warps)."""
    if width <= ONE_PASS_MAX:
        block_h = next_pow2(width)
        block_r = max(1, ROWWISE_TILE // block_h)
        return block_r, block_h, True, 8 if block_r * block_h > 4096 else 4
    return 1, TWO_PASS_BLOCK, False, 8


def quantize_rowwise(x: torch.Tensor, impl: Impl = Impl.AUTO) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs: x fp32/bf16/fp16 [..., H]. Outputs: q e4m3 [..., H] (contiguous), scale fp32 [...]."""
    _check_input(x, "quantize_rowwise")
    if not use_triton(impl, x, "quantize_rowwise"):
        q, scale = quantize_rowwise_reference(x)
        return q.contiguous(), scale
    width = x.shape[-1]
    x_RH = x.contiguous().view(-1, width)
    num_rows = x_RH.shape[0]
    q_RH = _q_buffer((num_rows, width), x.device)
    s_R = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows:
        block_r, block_h, one_pass, warps = _rowwise_blocks(width)
        _rowwise_kernel[(-(-num_rows // block_r),)](
            x_RH, q_RH, s_R, num_rows, width, block_r, block_h, one_pass, num_warps=warps
        )
    return _finish(q_RH).view(x.shape), s_R.view(x.shape[:-1])


def _segments(x_MK, offs_G, q, seg_mul: int, stride_k: int) -> torch.Tensor:
    """Both passes into ``q``; returns the [G, K] scales."""
    num_rows, width = x_MK.shape
    groups = offs_G.shape[0]
    s_G1K = torch.empty(groups + 1, width, dtype=torch.float32, device=x_MK.device)
    if width:
        grid = (groups + 1, -(-width // SEG_BLOCK_K))
        offs = offs_G if groups else torch.zeros(1, dtype=torch.int32, device=x_MK.device)
        _segment_amax_kernel[grid](x_MK, offs, s_G1K, num_rows, width, groups, SEG_BLOCK_M, SEG_BLOCK_K)
        _segment_cast_kernel[grid](
            x_MK,
            offs,
            s_G1K,
            q,
            num_rows,
            width,
            groups,
            seg_mul,
            stride_k,
            SEG_BLOCK_M,
            SEG_BLOCK_K,
            num_warps=4,
        )
    return s_G1K[:groups]


def _check_offsets(offs_G: torch.Tensor, x: torch.Tensor, what: str) -> None:
    if offs_G.dim() != 1 or offs_G.dtype != torch.int32 or offs_G.device != x.device:
        raise ValueError(
            f"{what}: offsets {tuple(offs_G.shape)} {offs_G.dtype} on {offs_G.device}; expected [G] int32 "
            f"inclusive segment ends on {x.device}"
        )


def quantize_segments_t(
    x_MK: torch.Tensor, offs_G: torch.Tensor, impl: Impl = Impl.AUTO
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs: x fp32/bf16/fp16 [M, K]; offs int32 [G] inclusive row ends (device, not read on the host).
    Outputs: q e4m3 [K, M] row-major (x's transpose), scale fp32 [G, K] (one per segment and column)."""
    _check_input(x_MK, "quantize_segments_t")
    if x_MK.dim() != 2:
        raise ValueError(f"quantize_segments_t: x has shape {tuple(x_MK.shape)}, expected [M, K]")
    _check_offsets(offs_G, x_MK, "quantize_segments_t")
    if not use_triton(impl, x_MK, "quantize_segments_t"):
        return quantize_segments_t_reference(x_MK, offs_G)
    x_MK = x_MK.contiguous()
    q_KM = _q_buffer((x_MK.shape[1], x_MK.shape[0]), x_MK.device)
    scale_GK = _segments(x_MK, offs_G, q_KM, 1, x_MK.shape[0])
    return _finish(q_KM), scale_GK


def quantize_segments_t_reference(x_MK: torch.Tensor, offs_G: torch.Tensor):
    q_KM, scale_GK = quantize_segments(x_MK.t(), offs_G)
    return q_KM.contiguous(), scale_GK


def quantize_weight_t(w_GNK: torch.Tensor, impl: Impl = Impl.AUTO) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs: w fp32/bf16/fp16 [G, N, K]. Outputs: q e4m3 [G, K, N] row-major (each expert's transpose),
    scale fp32 [G, K] (one per expert and k, over N) -- ``quantize_rowwise(w.transpose(-2, -1))``."""
    _check_input(w_GNK, "quantize_weight_t")
    if w_GNK.dim() != 3:
        raise ValueError(f"quantize_weight_t: w has shape {tuple(w_GNK.shape)}, expected [G, N, K]")
    if not use_triton(impl, w_GNK, "quantize_weight_t"):
        return quantize_weight_t_reference(w_GNK)
    groups, n, k = w_GNK.shape
    x_MK = w_GNK.contiguous().view(groups * n, k)
    offs_G = torch.arange(1, groups + 1, device=w_GNK.device, dtype=torch.int32) * n
    q_GKN = _q_buffer((groups, k, n), w_GNK.device)
    scale_GK = _segments(x_MK, offs_G, q_GKN, k, n)
    return _finish(q_GKN), scale_GK


def quantize_weight_t_reference(w_GNK: torch.Tensor):
    q_GKN, scale_GK = quantize_rowwise_reference(w_GNK.transpose(-2, -1))
    return q_GKN.contiguous(), scale_GK.contiguous()
