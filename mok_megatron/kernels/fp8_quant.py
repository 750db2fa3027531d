"""E4M3 quantization kernels for the native FP8 expert GEMMs (``ops.fp8_grouped_gemm``), each beside its torch reference.

Legend: R rows, H row width (the scaled dimension), M rows split into G segments (inclusive int32 ends
``offs_G``, a device tensor), K columns, N rows of one expert's weight.

    quantize_rowwise      x [..., H]  -> q [..., H] e4m3, scale [...] fp32         one scale per row
    quantize_rowwise_partials  x_MK   -> the same q, scale, and p [ceil(M / 16), K]: each 16-row block's
                          column amax, which ``quantize_segments_t(x, offs, partials=p)`` turns into the
                          segment scales without reading x for them (segments made of whole blocks)
    quantize_segments_t   x_MK        -> q_KM e4m3 (the TRANSPOSE, row-major), scale_GK fp32
                          one scale per (segment, column): the wgrad operands, whose contraction runs
                          over each expert's rows (``torch._scaled_grouped_mm`` takes A = dy^T [N, M] and
                          B = x [M, K] column-major, i.e. x^T [K, M] row-major)
    quantize_weight_t     w_GNK       -> q_GKN e4m3 (the per-expert transpose, row-major), scale_GK fp32
                          one scale per (expert, column k) over N: the dgrad's B operand, by the column-block
                          kernel (``_weight_t_kernel``); where N is too tall for its blocks to stay in L2,
                          by the segment kernels of ``quantize_segments_t`` (G segments of N rows, a
                          per-expert output block)
    quantize_rowwise_scatter      x_RH -> the rowwise q/scale of its per-expert padded layout [P, H]
    quantize_segments_t_scatter   x_RK -> the segment q^T/scale of its per-expert padded layout [K, P]
                          bitwise ``ops.align.pad_rows`` followed by the unpadded op, without the bf16 padded
                          copy (rows map by ``PadPlan.dest_R`` / shifted segment starts; padding stays 0)

Numerics are the references' (``kernels.fp8_quant_reference``): ``scale = amax / 448`` (all-zero group: 1),
``q = e4m3(clamp(x / scale, +-448))``, both divisions IEEE round-to-nearest (``tl.math.div_rn``: Triton's plain
``/`` is approximate on NVIDIA GPUs, and Triton 3.6's ``tl.math.fdiv`` ignores ``ieee_rounding=True``), the
cast round-to-nearest-even. So the kernels are bitwise equal to the references
(tests/test_fp8_quant_kernels.py holds them to that, on CPU interpreted and on the GPU).

Kernels:
    _rowwise_kernel       BLOCK_R rows per program; a row up to ONE_PASS_MAX wide is read once (amax, scale,
                          cast from registers), wider rows in two sweeps (the second mostly from L2)
    _rowwise_partial_kernel  one program per 16-row block: the one-pass rowwise cast of its rows, plus the
                          block's column amax
    _segment_amax_kernel  pass 1: one program per (segment, BLOCK_K columns), looping over the segment's
                          rows with an elementwise running max: per-column amax -> scale. No atomics: each
                          program owns its scales
    _segment_cast_kernel  pass 2: the same ownership; scale, cast, write transposed (SHIFT: segment g's
                          rows start at row ``dst_offs[g - 1]`` of the output, the padded layout). PACK: where
                          the segment's output span is word-aligned (start, length, stride multiples of 4:
                          every segment of the 16-row padded layouts the FP8 experts use), four rows of a
                          column go out as one 32-bit store; elsewhere byte-wise stores. FROM_PARTIAL: the
                          scales come from the block amaxes (whole-block segments) or x's rows (the others)
                          in the same program, and pass 1 is skipped
    _weight_t_kernel      both passes over one expert's column block [N, BLOCK_K] in one program: the
                          amax read (evict-last), then the cast re-reading the block from L2 (evict-first)
                          and writing it transposed, packed as above where N % 4 == 0. Persistent: two
                          programs per SM take the tiles in turn, BLOCK_K chosen by ``weight_t_plan``. Each
                          cast step writes >= 256 rows of a column: 16-byte stores, each warp 512 contiguous
                          bytes along N where N is a multiple of 64 (sm_90 PTX)
Rows past the last offset form one extra segment (scale computed and dropped, like the reference), so every
q element is written. Segment programs loop over device-side bounds: no host read of ``offs``.

Measured (H200): byte-wise transposed e4m3 stores held the cast pass
to ~2 TB/s (0.347 ms on the DeepSeek-V3 x operand [32768, 7168]; the same pass writing untransposed: 0.196);
packed words 0.225 ms. One program per (segment, BLOCK_K columns): a segment holding most rows runs on few SMs.
The weights' transposed quantization on the segment kernels read w twice from HBM: 8 calls took 4.1 ms of a
profiled FP8 training step of the Qwen3-30B-A3B preset (fc1 w [128, 1536, 2048], fc2 [128, 2048, 768], bf16),
~0.51 ms each, about twice one read of w plus the e4m3 write at HBM speed; ``_weight_t_kernel`` reads w from
HBM once and its second read mostly from L2: 0.70 / 0.36 ms on those fc1 / fc2 weights against 0.99 / 0.47
for the segment kernels (``python -m benchmarks.kernels --weights``, both weights of Qwen3 and DeepSeek-V3).

How it plugs in: ``ops.fp8_grouped_gemm`` calls these on CUDA tensors (``Impl.AUTO``), the references elsewhere.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from mok_megatron.kernels import fp8_quant_reference as quantize
from mok_megatron.kernels.fp8_quant_reference import E4M3, _check_input, quantize_segments
from mok_megatron.kernels.fp8_quant_reference import quantize_rowwise as quantize_rowwise_reference
from mok_megatron.kernels import INTERPRETED, Impl, jit, next_pow2, tl, use_triton

ONE_PASS_MAX = 8192  # widest row read once into registers (DeepSeek-V3 H = 7168 fits)
TWO_PASS_BLOCK = 4096
ROWWISE_TILE = 4096  # elements per program of the rowwise kernel (BLOCK_R * BLOCK_H for narrow rows)
# Segment tiles (rows, columns, warps); module constants read at each call. H200 (bf16 DeepSeek-V3 wgrad
# operands, measured on one H200): the amax pass with a running max took 0.129 / ~0.096 ms on x
# [32768, 7168] / dh [32768, 4096] at (32, 64, 8) against 0.157 / 0.126 before; the cast pass with packed
# words 0.225 ms on x at (128, 64, 4) against 0.347 for the best byte-wise store tile.
AMAX_TILE = (32, 64, 8)
PACK_TILE = (128, 64, 4)
CAST_TILE = (128, 32, 2)  # byte-wise stores (the fastest tile measured on one H200)
PARTIAL_ROWS = 16  # rows per block amax of quantize_rowwise_partials (the FP8 experts pad segments to 16)
# Column-block weight kernel (``_weight_t_kernel``, ``weight_t_plan``): each program reads its block twice
# (amax, then cast; the second read from L2 where the blocks in flight fit there: at two programs per SM and
# BLOCK_K 32 they fill an H200's L2 from N ~ 3,100 rows on, and the DeepSeek-V3 weights below, N 4096 and
# 7168, were still the fastest at that plan, its loads in flight counting more than the L2 hits). Two
# programs of 8 warps per SM (persistent, a static tile
# schedule; sm_90 compiles: 95-128 registers per thread, so two fit an SM's 64K): on one H200, bf16,
# against the segment kernels' two full passes, 1.42x / 1.30x on Qwen3-30B-A3B's fc1 / fc2 weights and
# 1.22x / 1.51x on the DeepSeek-V3 slice's at BLOCK_K 32 (1.36 / 1.29 / 1.34 / 1.40x at 16); one program of
# 16 warps per SM was 0.87-1.23x (``python -m benchmarks.kernels --weights``, docs/performance.md).
WEIGHT_T_BLOCK_KS = (32, 16)  # candidate BLOCK_K, widest first (16 bf16 columns: one 32-byte sector)
WEIGHT_T_PROGRAMS_PER_SM = 2
WEIGHT_T_L2_LIMIT = 1.0  # narrowest blocks, one per SM, filling more of the L2 than this: segment kernels
WEIGHT_T_WARPS = 8
WEIGHT_T_AMAX_TILE = 16384  # elements per amax step at WEIGHT_T_WARPS: 32 KB of bf16 loads in flight
WEIGHT_T_CAST_TILE = 8192  # elements per cast step at WEIGHT_T_WARPS: >= 256 rows at BLOCK_K 32
# The loads' L2 eviction hints (``_load_rows``'s EVICT), constants of the kernels that pass them
NO_HINT, EVICT_LAST, EVICT_FIRST = (tl.constexpr(i) for i in range(3)) if tl is not None else range(3)
INTERPRETED_LIMITS = (4, 1 << 20)  # (SMs, L2 bytes) the plan assumes for CPU tensors under the interpreter


@jit
def _rowwise_kernel(
    x_ptr,  # [R, H] row-major
    q_ptr,  # e4m3 [R, H], or [P, H] with HAS_DEST
    s_ptr,  # fp32 [R], or [P] with HAS_DEST
    dest_ptr,  # int64 [R] output row of each input row (HAS_DEST)
    num_rows,
    width,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ONE_PASS: tl.constexpr,
    HAS_DEST: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    base = rows.to(tl.int64)[:, None] * width
    if HAS_DEST:
        out_rows = tl.load(dest_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        out_rows = rows.to(tl.int64)
    out_base = out_rows[:, None] * width
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_H)
        mask = row_ok[:, None] & (cols < width)[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
        y = tl.math.div_rn(x, scale[:, None])
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(q_ptr + out_base + cols[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK_R], dtype=tl.float32)
        for h0 in range(0, width, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            mask = row_ok[:, None] & (cols < width)[None, :]
            x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
        for h0 in range(0, width, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            mask = row_ok[:, None] & (cols < width)[None, :]
            x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0).to(tl.float32)
            y = tl.math.div_rn(x, scale[:, None])
            y = tl.minimum(tl.maximum(y, -448.0), 448.0)
            tl.store(q_ptr + out_base + cols[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + out_rows, scale, mask=row_ok)


@jit
def _rowwise_partial_kernel(
    x_ptr,  # [R, H] row-major, H <= ONE_PASS_MAX
    q_ptr,  # e4m3 [R, H]
    s_ptr,  # fp32 [R]
    p_ptr,  # x's dtype [ceil(R / PART), H]: amax of |x| over each PART-row block, per column
    num_rows,
    width,
    PART: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``_rowwise_kernel`` (one pass) over the PART rows of one block, also keeping their column amax:
    what the weight gradient's per-(segment, column) scales need, read here at no extra pass over x."""
    block = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < width
    cmax = tl.zeros([BLOCK_H], dtype=tl.float32)
    for r0 in range(0, PART, BLOCK_R):  # a loop, not unrolled: one row block live at a time
        rows = block * PART + r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < num_rows
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * width + cols[None, :], mask=mask, other=0).to(
            tl.float32
        )
        a = tl.abs(x)
        cmax = tl.maximum(cmax, tl.max(a, axis=0))
        amax = tl.max(a, axis=1)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
        y = tl.math.div_rn(x, scale[:, None])
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(
            q_ptr + rows.to(tl.int64)[:, None] * width + cols[None, :],
            y.to(q_ptr.dtype.element_ty),
            mask=mask,
        )
        tl.store(s_ptr + rows, scale, mask=row_ok)
    tl.store(p_ptr + block.to(tl.int64) * width + cols, cmax.to(p_ptr.dtype.element_ty), mask=col_ok)


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
    src_ptr=None,  # SRC: int32 [M] row m is x's row src[m] (-1: a zero row)
    SRC: tl.constexpr = False,
):
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < width
    start, end = _segment_bounds(offs_ptr, g, num_rows, num_segments)
    amax = _column_amax(x_ptr, src_ptr, cols, col_ok, start, end, width, BLOCK_M, BLOCK_K, SRC, NO_HINT)
    tl.store(s_ptr + g * width + cols, _scale_of(amax), mask=col_ok)


@jit
def _load_rows(ptr, src_ptr, rows, row_ok, cols, mask, width, SRC: tl.constexpr, EVICT: tl.constexpr):
    """Elements (rows, cols) of a row-major [*, width] tensor (0 where masked); with SRC row m is the
    tensor's row ``src[m]`` (-1: a zero row). ``rows``/``row_ok`` broadcast against ``cols``/``mask``.
    EVICT: the loads' L2 eviction hint, ``NO_HINT``, ``EVICT_LAST`` or ``EVICT_FIRST`` (an int: Triton 3.6
    compiles neither a string default nor a string argument of a nested function as a constant)."""
    if SRC:
        src = tl.load(src_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        ptrs = ptr + src * width + cols
        mask = mask & (src >= 0)
    else:
        ptrs = ptr + rows.to(tl.int64) * width + cols
    if EVICT == EVICT_LAST:
        v = tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_last")
    elif EVICT == EVICT_FIRST:
        v = tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")
    else:
        v = tl.load(ptrs, mask=mask, other=0)
    return v


@jit
def _column_amax(
    ptr,
    src_ptr,
    cols,
    col_ok,
    lo,
    hi,
    width,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SRC: tl.constexpr,
    EVICT: tl.constexpr,
):
    """max |v| over rows [lo, hi) of a row-major [*, width] tensor, per column of ``cols``: an elementwise
    running max, reduced over the rows once at the end (a cross-thread reduction every row block ran the
    amax pass 10-35 % slower on one H200)."""
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for m0 in range(lo, hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = (rows < hi)[:, None]
        mask = row_ok & col_ok[None, :]
        v = _load_rows(ptr, src_ptr, rows[:, None], row_ok, cols[None, :], mask, width, SRC, EVICT)
        acc = tl.maximum(acc, tl.abs(v.to(tl.float32)))
    return tl.max(acc, axis=0)


@jit
def _scale_of(amax):
    return tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)


@jit
def _to_e4m3(x, scale, ty):
    """The segment and weight kernels' cast: IEEE ``x / scale``, clamped to +-448, rounded to ``ty``."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    return tl.minimum(tl.maximum(y, -448.0), 448.0).to(ty)


@jit
def _segment_cast_kernel(
    x_ptr,  # [M, K] row-major
    offs_ptr,  # [G] int32 inclusive segment ends
    s_ptr,  # [G + 1, K] fp32 scales from pass 1
    q_ptr,  # e4m3 out: element (m, k) of segment g at dst_g * seg_mul + k * stride_k + (m - start_g)
    q32_ptr,  # the same buffer as int32 words (PACK)
    dst_offs_ptr,  # [G] int32 inclusive segment ends in the output (SHIFT); dst_g = start of segment g there
    num_rows,
    num_out_rows,  # SHIFT: rows of the output layout (P)
    width,
    num_segments,
    seg_mul,  # 1 for q_KM (stride_k = M); K for per-expert blocks q_GKN (stride_k = N)
    stride_k,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SHIFT: tl.constexpr,  # segments start at other rows in the output (padding); rows past the last end dropped
    PACK: tl.constexpr,  # q32_ptr is valid: segments whose output span is word-aligned store 4 rows per word
    p_ptr=None,  # FROM_PARTIAL: x's PART-row block amax [ceil(M / PART), K] (``_rowwise_partial_kernel``)
    FROM_PARTIAL: tl.constexpr = False,  # compute (and store) the scales here instead of reading pass 1's
    PART: tl.constexpr = 16,
    src_ptr=None,  # SRC: int32 [M] row m is x's row src[m] (-1: a zero row); not with FROM_PARTIAL
    SRC: tl.constexpr = False,
):
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < width
    start, end = _segment_bounds(offs_ptr, g, num_rows, num_segments)
    if SHIFT:
        dst, dst_end = _segment_bounds(dst_offs_ptr, g, num_out_rows, num_segments)
        end = tl.where(g < num_segments, end, start)
    else:
        dst, dst_end = start, end
    if FROM_PARTIAL:
        scale = _scale_from_partials(
            x_ptr, p_ptr, cols, col_ok, start, end, num_rows, width, PART, BLOCK_M, BLOCK_K
        )
        tl.store(s_ptr + g * width + cols, scale, mask=col_ok)
    else:
        scale = tl.load(s_ptr + g * width + cols, mask=col_ok, other=1.0)
    # Packed: the segment's output starts on a word and owns whole words (its rows, then padding rows
    # nobody else writes, which get the zeros of masked loads): four rows of a column go out as one
    # 32-bit store. The byte-wise transposed store ran at ~2 TB/s, this at ~3 TB/s (one H200).
    packed = (
        ((dst * seg_mul) % 4 == 0)
        & (stride_k % 4 == 0)
        & ((dst_end - dst) % 4 == 0)
        & (end - start <= dst_end - dst)
    )
    if PACK:
        if packed:
            _cast_words(
                x_ptr,
                src_ptr,
                q_ptr,
                q32_ptr,
                scale,
                cols,
                col_ok,
                start,
                end,
                (dst.to(tl.int64) * seg_mul) // 4,
                (end - start + 3) // 4,
                stride_k // 4,
                width,
                BLOCK_M,
                SRC,
                NO_HINT,
            )
        else:
            _cast_bytes(
                x_ptr,
                src_ptr,
                q_ptr,
                scale,
                cols,
                col_ok,
                start,
                end,
                dst,
                seg_mul,
                stride_k,
                width,
                BLOCK_M,
                SRC,
                NO_HINT,
            )
    else:
        _cast_bytes(
            x_ptr,
            src_ptr,
            q_ptr,
            scale,
            cols,
            col_ok,
            start,
            end,
            dst,
            seg_mul,
            stride_k,
            width,
            BLOCK_M,
            SRC,
            NO_HINT,
        )


@jit
def _scale_from_partials(
    x_ptr,
    p_ptr,
    cols,
    col_ok,
    start,
    end,
    num_rows,
    width,
    PART: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """A segment's per-column scale from the PART-row block amaxes when its rows are whole blocks (start
    on a block, end on a block or at the last row), else from x's rows (any segment stays correct)."""
    if (start % PART == 0) & ((end % PART == 0) | (end == num_rows)):
        amax = _column_amax(
            p_ptr,
            p_ptr,
            cols,
            col_ok,
            start // PART,
            (end + PART - 1) // PART,
            width,
            BLOCK_M,
            BLOCK_K,
            False,
            NO_HINT,
        )
    else:
        amax = _column_amax(x_ptr, x_ptr, cols, col_ok, start, end, width, BLOCK_M, BLOCK_K, False, NO_HINT)
    return _scale_of(amax)


@jit
def _cast_bytes(
    x_ptr,
    src_ptr,
    q_ptr,
    scale,
    cols,
    col_ok,
    start,
    end,
    dst,
    seg_mul,
    stride_k,
    width,
    BLOCK_M: tl.constexpr,
    SRC: tl.constexpr,
    EVICT: tl.constexpr,
):
    """The cast pass's byte-wise transposed store (any layout): element (m, k) of rows [start, end) to
    ``q[dst * seg_mul + k * stride_k + (m - start)]``."""
    out_base = q_ptr + dst.to(tl.int64) * seg_mul - start + cols.to(tl.int64)[None, :] * stride_k
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = (rows < end)[:, None]
        mask = row_ok & col_ok[None, :]
        x = _load_rows(x_ptr, src_ptr, rows[:, None], row_ok, cols[None, :], mask, width, SRC, EVICT)
        tl.store(out_base + rows[:, None], _to_e4m3(x, scale[None, :], q_ptr.dtype.element_ty), mask=mask)


@jit
def _cast_words(
    x_ptr,
    src_ptr,
    q_ptr,
    q32_ptr,
    scale,
    cols,
    col_ok,
    start,
    end,
    dst_word,
    seg_words,
    word_stride_k,
    width,
    BLOCK_M: tl.constexpr,
    SRC: tl.constexpr,
    EVICT: tl.constexpr,
):
    """The cast pass's packed transposed store where the output span is word-aligned: rows [start, end)
    of column k go to the ``seg_words`` = ceil((end - start) / 4) words from ``q32[dst_word + k *
    word_stride_k]`` on, four rows per 32-bit store (rows past ``end`` in the last word: the zeros of
    masked loads). Word index and mask are built from a counter that starts at 0 so that the compiler can
    prove the alignment of vector stores where the caller's arguments are multiples of 16."""
    j = tl.arange(0, BLOCK_M // 4)
    i4 = tl.arange(0, 4)
    word_base = dst_word + cols.to(tl.int64)[None, :] * word_stride_k
    for m in range(0, end - start, BLOCK_M):
        rows = start + m + 4 * j[:, None, None] + i4[None, :, None]  # [BLOCK_M / 4, 4, 1]
        mask = (rows < end) & col_ok[None, None, :]
        x = _load_rows(x_ptr, src_ptr, rows, rows < end, cols[None, None, :], mask, width, SRC, EVICT)
        y = _to_e4m3(x, scale[None, None, :], q_ptr.dtype.element_ty)
        b = y.to(tl.uint8, bitcast=True).to(tl.int32)
        words = tl.sum(b << (8 * i4)[None, :, None], axis=1)  # little-endian: row 4w + i in byte i
        w_idx = m // 4 + j
        w_mask = (w_idx < seg_words)[:, None] & col_ok[None, :]
        tl.store(q32_ptr + word_base + w_idx[:, None], words, mask=w_mask)


@jit
def _weight_t_kernel(
    w_ptr,  # [G, N, K] row-major, read as [G * N, K]
    q_ptr,  # e4m3 [G, K, N]: element (g, n, k) of w at g * K * N + k * N + n
    q32_ptr,  # the same buffer as int32 words (PACK)
    s_ptr,  # fp32 [G, K]
    rows,  # N
    width,  # K
    words,  # N // 4: int32 words per column of one expert's q (PACK)
    num_tiles,  # G * ceil(K / BLOCK_K)
    BLOCK_N: tl.constexpr,  # rows per step of the cast pass
    BLOCK_K: tl.constexpr,
    AMAX_N: tl.constexpr,  # rows per step of the amax pass
    PACK: tl.constexpr,  # N % 4 == 0 and q is e4m3: four rows of a column per 32-bit store
):
    """Tile t is expert t // ceil(K / BLOCK_K)'s column block [N, BLOCK_K]; program p takes tiles p, p + P,
    ... (P programs, ``weight_t_plan``). Pass 1 reads the block with an evict-last hint and keeps the
    per-column amax; pass 2 reads it again (from L2 where it stayed) with an evict-first hint, casts and
    writes it transposed. Scale and cast are the segment kernels' (``_scale_of``,
    ``_to_e4m3``, ``_cast_words`` / ``_cast_bytes``)."""
    col_blocks = tl.cdiv(width, BLOCK_K)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        g = tile // col_blocks
        cols = (tile - g * col_blocks) * BLOCK_K + tl.arange(0, BLOCK_K)
        col_ok = cols < width
        start = g * rows
        end = start + rows
        amax = _column_amax(w_ptr, w_ptr, cols, col_ok, start, end, width, AMAX_N, BLOCK_K, False, EVICT_LAST)
        scale = _scale_of(amax)
        tl.store(s_ptr + g * width + cols, scale, mask=col_ok)
        if PACK:
            _cast_words(
                w_ptr,
                w_ptr,
                q_ptr,
                q32_ptr,
                scale,
                cols,
                col_ok,
                start,
                end,
                g.to(tl.int64) * width * words,
                words,
                words,
                width,
                BLOCK_N,
                False,
                EVICT_FIRST,
            )
        else:
            _cast_bytes(
                w_ptr,
                w_ptr,
                q_ptr,
                scale,
                cols,
                col_ok,
                start,
                end,
                start,
                width,
                rows,
                width,
                BLOCK_N,
                False,
                EVICT_FIRST,
            )


# ---- wrappers -------------------------------------------------------------------------------------------------


def _q_buffer(shape, device, zero: bool = False) -> torch.Tensor:
    """The kernels' q output. Interpreted on CPU, an fp32 buffer cast to e4m3 by torch afterwards
    (``_finish``): Triton's interpreter rounds fp32 -> e4m3 wrongly when the mantissa carries into the
    exponent (127.8 -> 64, not 128; triton 3.8 ``interpreter._convert_float``). Everything else (amax,
    scales, division, clamp, the layout) is the kernel's own; on the GPU the cast is the hardware's
    ``cvt.rn.satfinite`` and the q buffer is e4m3."""
    if INTERPRETED and torch.device(device).type == "cpu":
        return (torch.zeros if zero else torch.empty)(shape, dtype=torch.float32, device=device)
    if zero:  # e4m3 0 is the zero byte
        return torch.zeros(shape, dtype=torch.uint8, device=device).view(E4M3)
    return torch.empty(shape, dtype=E4M3, device=device)


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
            x_RH, q_RH, s_R, s_R, num_rows, width, block_r, block_h, one_pass, False, num_warps=warps
        )
    return _finish(q_RH).view(x.shape), s_R.view(x.shape[:-1])


def _segments(
    x_MK,
    offs_G,
    q,
    seg_mul: int,
    stride_k: int,
    dst_offs_G=None,
    num_out_rows: int = 0,
    partials=None,
    src_M=None,
):
    """Both passes into ``q``; returns the [G, K] scales. ``dst_offs_G``: segment ends in q (padding).
    ``partials``: x's PARTIAL_ROWS-row block amaxes (``quantize_rowwise_partials``): no amax pass.
    ``src_M``: int32 [M], row m is ``x[src_M[m]]`` (-1: zero); x then holds the source rows."""
    num_rows, width = (src_M.shape[0] if src_M is not None else x_MK.shape[0]), x_MK.shape[1]
    src = src_M if src_M is not None else x_MK
    groups = offs_G.shape[0]
    s_G1K = torch.empty(groups + 1, width, dtype=torch.float32, device=x_MK.device)
    if width:
        offs = offs_G if groups else torch.zeros(1, dtype=torch.int32, device=x_MK.device)
        shift = dst_offs_G is not None
        dst = dst_offs_G if shift and groups else offs
        if partials is None:
            am, ak, aw = AMAX_TILE
            _segment_amax_kernel[(groups + 1, -(-width // ak))](
                x_MK, offs, s_G1K, num_rows, width, groups, am, ak, src, src_M is not None, num_warps=aw
            )
        # Words need an e4m3 buffer (not the interpreter's fp32 stand-in) whose rows view as int32.
        pack = q.dtype == E4M3 and q.shape[-1] % 4 == 0
        cm, ck, cw = PACK_TILE if pack else CAST_TILE
        _segment_cast_kernel[(groups + 1, -(-width // ck))](
            x_MK,
            offs,
            s_G1K,
            q,
            q.view(torch.int32) if pack else q,
            dst,
            num_rows,
            num_out_rows,
            width,
            groups,
            seg_mul,
            stride_k,
            cm,
            ck,
            shift,
            pack,
            partials,
            partials is not None,
            PARTIAL_ROWS,
            src,
            src_M is not None,
            num_warps=cw,
        )
    return s_G1K[:groups]


def _check_offsets(offs_G: torch.Tensor, x: torch.Tensor, what: str) -> None:
    if offs_G.dim() != 1 or offs_G.dtype != torch.int32 or offs_G.device != x.device:
        raise ValueError(
            f"{what}: offsets {tuple(offs_G.shape)} {offs_G.dtype} on {offs_G.device}; expected [G] int32 "
            f"inclusive segment ends on {x.device}"
        )


def quantize_segments_t(
    x_MK: torch.Tensor, offs_G: torch.Tensor, impl: Impl = Impl.AUTO, partials: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs: x fp32/bf16/fp16 [M, K]; offs int32 [G] inclusive row ends (device, not read on the host);
    ``partials``: what ``quantize_rowwise_partials(x)`` returned third (the amax pass is skipped where the
    segments are whole PARTIAL_ROWS-row blocks; ignored by the reference, which gives the same result).
    Outputs: q e4m3 [K, M] row-major (x's transpose), scale fp32 [G, K] (one per segment and column)."""
    _check_input(x_MK, "quantize_segments_t")
    if x_MK.dim() != 2:
        raise ValueError(f"quantize_segments_t: x has shape {tuple(x_MK.shape)}, expected [M, K]")
    _check_offsets(offs_G, x_MK, "quantize_segments_t")
    if not use_triton(impl, x_MK, "quantize_segments_t"):
        return quantize_segments_t_reference(x_MK, offs_G)
    x_MK = x_MK.contiguous()
    q_KM = _q_buffer((x_MK.shape[1], x_MK.shape[0]), x_MK.device)
    if partials is not None and partials.shape != (-(-x_MK.shape[0] // PARTIAL_ROWS), x_MK.shape[1]):
        raise ValueError(
            f"quantize_segments_t: partials {tuple(partials.shape)} do not fit x {tuple(x_MK.shape)}; pass "
            "the third output of quantize_rowwise_partials(x)"
        )
    scale_GK = _segments(x_MK, offs_G, q_KM, 1, x_MK.shape[0], partials=partials)
    return _finish(q_KM), scale_GK


def quantize_rowwise_partials(
    x_MK: torch.Tensor, impl: Impl = Impl.AUTO
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``quantize_rowwise`` of x [M, K] plus, on the Triton path, the amax of |x| over each block of
    ``PARTIAL_ROWS`` rows per column ([ceil(M / PARTIAL_ROWS), K], x's dtype: exact) for a later
    ``quantize_segments_t(x, offs, partials=...)``: the weight gradient's scales without a second amax
    read of x (one pass over x serves both layouts' amaxes). Elsewhere (the reference) the third output
    is None and ``quantize_segments_t`` computes the scales from x (the same values)."""
    _check_input(x_MK, "quantize_rowwise_partials")
    if x_MK.dim() != 2:
        raise ValueError(f"quantize_rowwise_partials: x has shape {tuple(x_MK.shape)}, expected [M, K]")
    rows, width = x_MK.shape
    if not use_triton(impl, x_MK, "quantize_rowwise_partials") or width > ONE_PASS_MAX:
        q, s = quantize_rowwise(x_MK, impl)
        return q, s, None
    x_MK = x_MK.contiguous()
    q_MK = _q_buffer((rows, width), x_MK.device)
    s_M = torch.empty(rows, dtype=torch.float32, device=x_MK.device)
    p_BK = torch.empty(-(-rows // PARTIAL_ROWS), width, dtype=x_MK.dtype, device=x_MK.device)
    if rows:
        block_h = next_pow2(width)
        block_r = min(PARTIAL_ROWS, max(1, ROWWISE_TILE // block_h))
        warps = 8 if block_r * block_h > 4096 else 4
        _rowwise_partial_kernel[(p_BK.shape[0],)](
            x_MK, q_MK, s_M, p_BK, rows, width, PARTIAL_ROWS, block_r, block_h, num_warps=warps
        )
    return _finish(q_MK), s_M, p_BK


def quantize_segments_t_reference(x_MK: torch.Tensor, offs_G: torch.Tensor):
    q_KM, scale_GK = quantize_segments(x_MK.t(), offs_G)
    return q_KM.contiguous(), scale_GK


def gather_rows(x_TK: torch.Tensor, src_M: torch.Tensor) -> torch.Tensor:
    """``x_MK[m] = x_TK[src_M[m]]``, a zero row where ``src_M[m]`` is -1 (no host sync)."""
    padded = torch.cat([x_TK, x_TK.new_zeros(1, x_TK.shape[1])])
    idx = torch.where(src_M >= 0, src_M.long(), x_TK.shape[0])
    return padded.index_select(0, idx)


def quantize_segments_t_rows(
    x_TK: torch.Tensor, src_M: torch.Tensor, offs_G: torch.Tensor, impl: Impl = Impl.AUTO
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_segments_t(gather_rows(x_TK, src_M), offs_G)`` without building the gathered rows:
    each pass reads row m from ``x_TK[src_M[m]]`` (the weight gradient's operand taken straight from the
    token rows the permute copied, ``kernels.fp8_permute``).

    Inputs: x fp32/bf16/fp16 [T, K]; src int32 [M] (-1: a zero row); offs int32 [G] inclusive ends over
    the M rows. Outputs: q e4m3 [K, M] row-major, scale fp32 [G, K]."""
    _check_input(x_TK, "quantize_segments_t_rows")
    if x_TK.dim() != 2 or src_M.dim() != 1 or src_M.dtype != torch.int32 or src_M.device != x_TK.device:
        raise ValueError(
            f"quantize_segments_t_rows: x {tuple(x_TK.shape)}, src {tuple(src_M.shape)} {src_M.dtype} on "
            f"{src_M.device}; expected x [T, K] and src [M] int32 on {x_TK.device}"
        )
    _check_offsets(offs_G, x_TK, "quantize_segments_t_rows")
    if not use_triton(impl, x_TK, "quantize_segments_t_rows"):
        return quantize_segments_t_reference(gather_rows(x_TK, src_M), offs_G)
    x_TK = x_TK.contiguous()
    q_KM = _q_buffer((x_TK.shape[1], src_M.shape[0]), x_TK.device)
    scale_GK = _segments(x_TK, offs_G, q_KM, 1, src_M.shape[0], src_M=src_M)
    return _finish(q_KM), scale_GK


def quantize_weight_t(
    w_GNK: torch.Tensor, impl: Impl = Impl.AUTO, blocks: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs: w fp32/bf16/fp16 [G, N, K]. Outputs: q e4m3 [G, K, N] row-major (each expert's transpose),
    scale fp32 [G, K] (one per expert and k, over N) -- ``quantize_rowwise(w.transpose(-2, -1))``.

    Triton (CUDA, or CPU under the interpreter): with ``blocks`` (the default) the column-block kernel with
    the launch of ``weight_t_plan`` (1.22-1.51x the segment kernels on one H200, ``WEIGHT_T_PROGRAMS_PER_SM``'s
    note), falling back to the segment kernels (an amax pass, then a cast pass) where that plan is None, i.e.
    N too tall for a column block of 16 per SM to stay in L2 (bf16 on an H200: N > ~12K rows); ``blocks=False``:
    the segment kernels. Both give the same bits.
    """
    _check_input(w_GNK, "quantize_weight_t")
    if w_GNK.dim() != 3:
        raise ValueError(f"quantize_weight_t: w has shape {tuple(w_GNK.shape)}, expected [G, N, K]")
    if not use_triton(impl, w_GNK, "quantize_weight_t"):
        return quantize_weight_t_reference(w_GNK)
    w_GNK = w_GNK.contiguous()
    plan = weight_t_plan(w_GNK) if blocks else None
    if plan is None:
        return _weight_t_segments(w_GNK)
    return _weight_t_blocks(w_GNK, plan)


class WeightTPlan(NamedTuple):
    """One launch of ``_weight_t_kernel``: its tiles and how many programs share them."""

    block_n: int  # rows per cast step
    block_k: int  # columns per tile
    amax_n: int  # rows per amax step
    warps: int
    programs: int


def _device_limits(device: torch.device) -> tuple[int, int]:
    """(SMs, L2 bytes); the interpreter's CPU stands in as ``INTERPRETED_LIMITS``."""
    if device.type != "cuda":
        return INTERPRETED_LIMITS
    return _cuda_limits(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_limits(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.L2_cache_size


def weight_t_plan(
    w_GNK: torch.Tensor,
    programs_per_sm: int | None = None,
    block_k: int | None = None,
    warps: int | None = None,
) -> WeightTPlan | None:
    """The column-block kernel's launch for w [G, N, K] on its device, or None where it does not apply:
    N so tall that one block of the narrowest width per SM fills more than ``WEIGHT_T_L2_LIMIT`` of the
    L2 (its second read would come from HBM; the generic two-kernel path runs each read at full
    occupancy instead).

    Programs per SM and BLOCK_K: ``WEIGHT_T_PROGRAMS_PER_SM`` and the widest of ``WEIGHT_T_BLOCK_KS`` that
    leaves every program a tile, else the narrowest (fewer programs than SMs x programs per SM then: one per
    tile). ``programs_per_sm`` / ``block_k`` / ``warps`` fix them. Steps: ``WEIGHT_T_AMAX_TILE`` / ``WEIGHT_T_CAST_TILE`` elements at
    ``WEIGHT_T_WARPS`` warps, in proportion at other warps (the same elements, so registers, per thread),
    no more rows than N (rounded up to a power of two)."""
    groups, n, k = w_GNK.shape
    sms, l2 = _device_limits(w_GNK.device)
    col_bytes = n * w_GNK.element_size()  # one column of one expert
    if sms * col_bytes * WEIGHT_T_BLOCK_KS[-1] > WEIGHT_T_L2_LIMIT * l2:
        return None
    per_sm = programs_per_sm or WEIGHT_T_PROGRAMS_PER_SM
    block_ks = [block_k] if block_k else WEIGHT_T_BLOCK_KS
    fits = [bk for bk in block_ks if groups * -(-k // bk) >= sms * per_sm]
    block_k = fits[0] if fits else block_ks[-1]
    warps = warps or WEIGHT_T_WARPS
    tall = max(16, next_pow2(n))
    return WeightTPlan(
        block_n=max(16, min(WEIGHT_T_CAST_TILE * warps // WEIGHT_T_WARPS // block_k, tall)),
        block_k=block_k,
        amax_n=max(16, min(WEIGHT_T_AMAX_TILE * warps // WEIGHT_T_WARPS // block_k, tall)),
        warps=warps,
        programs=max(1, min(groups * -(-k // block_k), sms * per_sm)),
    )


def _weight_t_blocks(w_GNK: torch.Tensor, plan: WeightTPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_weight_t`` of a contiguous w by ``_weight_t_kernel``."""
    groups, n, k = w_GNK.shape
    q_GKN = _q_buffer((groups, k, n), w_GNK.device)
    scale_GK = torch.empty(groups, k, dtype=torch.float32, device=w_GNK.device)
    tiles = groups * -(-k // plan.block_k)
    if tiles:
        # Words need an e4m3 buffer (not the interpreter's fp32 stand-in) whose rows view as int32.
        pack = q_GKN.dtype == E4M3 and n % 4 == 0
        _weight_t_kernel[(min(plan.programs, tiles),)](
            w_GNK,
            q_GKN,
            q_GKN.view(torch.int32) if pack else q_GKN,
            scale_GK,
            n,
            k,
            n // 4,
            tiles,
            plan.block_n,
            plan.block_k,
            plan.amax_n,
            pack,
            num_warps=plan.warps,
        )
    return _finish(q_GKN), scale_GK


def _weight_t_segments(w_GNK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_weight_t`` of a contiguous w by the generic segment kernels (G segments of N rows, a
    per-expert output block): an amax pass, then a cast pass reading w again."""
    groups, n, k = w_GNK.shape
    x_MK = w_GNK.view(groups * n, k)
    offs_G = torch.arange(1, groups + 1, device=w_GNK.device, dtype=torch.int32) * n
    q_GKN = _q_buffer((groups, k, n), w_GNK.device)
    scale_GK = _segments(x_MK, offs_G, q_GKN, k, n)
    return _finish(q_GKN), scale_GK


def quantize_weight_t_reference(w_GNK: torch.Tensor):
    q_GKN, scale_GK = quantize_rowwise_reference(w_GNK.transpose(-2, -1))
    return q_GKN.contiguous(), scale_GK.contiguous()


# ---- quantize straight into a per-expert padded layout (fc1's input on the native FP8 path) ------------------


def quantize_rowwise_scatter(
    x_RH: torch.Tensor, dest_R: torch.Tensor, num_rows: int, impl: Impl = Impl.AUTO
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rowwise`` of the padded buffer ``ops.align.pad_rows(x_RH, plan)`` without building it.

    Inputs: x fp32/bf16/fp16 [R, H]; dest int64 [R] (``PadPlan.dest_R``: distinct rows < ``num_rows``).
    Outputs: q e4m3 [P, H], scale fp32 [P]; rows no input lands on are 0 with scale 1 (what quantizing a
    zero row gives), so this is bitwise the unfused pad-then-quantize."""
    _check_input(x_RH, "quantize_rowwise_scatter")
    if x_RH.dim() != 2 or dest_R.shape != (x_RH.shape[0],) or dest_R.dtype != torch.int64:
        raise ValueError(
            f"quantize_rowwise_scatter: x {tuple(x_RH.shape)}, dest {tuple(dest_R.shape)} {dest_R.dtype}; "
            "expected x [R, H] and dest [R] int64 (ops.align.PadPlan.dest_R)"
        )
    if not use_triton(impl, x_RH, "quantize_rowwise_scatter"):
        return quantize_rowwise_scatter_reference(x_RH, dest_R, num_rows)
    rows, width = x_RH.shape
    x_RH = x_RH.contiguous()
    q_PH = _q_buffer((num_rows, width), x_RH.device, zero=True)
    s_P = torch.ones(num_rows, dtype=torch.float32, device=x_RH.device)
    if rows and width:
        block_r, block_h, one_pass, warps = _rowwise_blocks(width)
        _rowwise_kernel[(-(-rows // block_r),)](
            x_RH, q_PH, s_P, dest_R, rows, width, block_r, block_h, one_pass, True, num_warps=warps
        )
    return _finish(q_PH), s_P


def quantize_rowwise_scatter_reference(x_RH, dest_R, num_rows):
    x_PH = x_RH.new_zeros(num_rows, x_RH.shape[1]).index_copy_(0, dest_R, x_RH)
    return quantize_rowwise(x_PH, Impl.TORCH)


def quantize_segments_t_scatter(
    x_RK: torch.Tensor, offs_G: torch.Tensor, dst_offs_G: torch.Tensor, num_rows: int, impl: Impl = Impl.AUTO
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_segments_t`` of the padded buffer without building it: segment g's rows (ends
    ``offs_G``, over x's R rows) start at row ``dst_offs_G[g - 1]`` (0 for g = 0) of the P = ``num_rows``
    padded rows; every other padded row is zero. Rows past ``offs_G[-1]`` are dropped.

    Inputs: x [R, K]; offs, dst_offs int32 [G] (``PadPlan.offsets_E`` and the GEMM's padded ``offs``).
    Outputs: q e4m3 [K, P] row-major, scale fp32 [G, K] -- bitwise ``quantize_segments_t(pad(x), dst_offs)``
    (zero rows change no amax; an empty or all-zero segment gets scale 1 either way)."""
    _check_input(x_RK, "quantize_segments_t_scatter")
    if x_RK.dim() != 2:
        raise ValueError(f"quantize_segments_t_scatter: x has shape {tuple(x_RK.shape)}, expected [R, K]")
    _check_offsets(offs_G, x_RK, "quantize_segments_t_scatter")
    _check_offsets(dst_offs_G, x_RK, "quantize_segments_t_scatter")
    if dst_offs_G.shape != offs_G.shape:
        raise ValueError(
            f"quantize_segments_t_scatter: {offs_G.shape[0]} segment ends but {dst_offs_G.shape[0]} padded "
            "ends; expected one padded end per segment"
        )
    if not use_triton(impl, x_RK, "quantize_segments_t_scatter"):
        return quantize_segments_t_scatter_reference(x_RK, offs_G, dst_offs_G, num_rows)
    x_RK = x_RK.contiguous()
    q_KP = _q_buffer((x_RK.shape[1], num_rows), x_RK.device, zero=True)
    scale_GK = _segments(x_RK, offs_G, q_KP, 1, num_rows, dst_offs_G, num_rows)
    return _finish(q_KP), scale_GK


def quantize_segments_t_scatter_reference(x_RK, offs_G, dst_offs_G, num_rows):
    rows = x_RK.shape[0]
    seg_R = quantize.segment_ids(offs_G, rows)
    live = seg_R < offs_G.shape[0]
    starts = torch.cat([offs_G.new_zeros(1), offs_G[:-1]]).long()
    dst_starts = torch.cat([dst_offs_G.new_zeros(1), dst_offs_G[:-1]]).long()
    dest = torch.arange(rows, device=x_RK.device)[live] + (dst_starts - starts)[seg_R[live]]
    x_PK = x_RK.new_zeros(num_rows, x_RK.shape[1]).index_copy_(0, dest, x_RK[live])
    return quantize_segments_t_reference(x_PK, dst_offs_G)
