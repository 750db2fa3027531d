"""Why the per-(segment, column) FP8 quantization for the weight gradients runs at ~2 TB/s (session 6).

Variants of the two passes behind ``kernels.fp8_quant.quantize_segments_t``, each checked bitwise
against the product kernels, timed separately (median of 30 CUDA-event-timed calls, one GPU):

    amax  loop     the product's ``_segment_amax_kernel`` (a cross-thread max every row block)
    amax  acc      an elementwise running max in registers, one reduction at the end
    cast  loop     the product's ``_segment_cast_kernel`` (IEEE division, transposed write)
    cast  recip    the same with a multiply by 1/scale (not bitwise: diagnosis of the division's cost)
    cast  trans    the product's math, the tile transposed with ``tl.trans`` before a store along M
    cast  rowmaj   the same writing untransposed (not the layout the GEMM takes: diagnosis of the write)

GB/s counts the bf16 bytes read (amax) or read + e4m3 written (cast).

    python benchmarks/fp8_seg_probe2.py
"""

from __future__ import annotations

import itertools
import os
import statistics

import torch
import triton
import triton.language as tl

import mok_megatron.kernels.fp8_quant as Q
from mok_megatron.bench.layer import time_steps
from mok_megatron.kernels.fp8_quant import _segment_bounds


def _time(fn, iters=30, warmup=3):
    return statistics.median(time_steps(fn, iters, warmup)) * 1e3


@triton.jit
def _amax_acc(
    x_ptr, offs_ptr, s_ptr, num_rows, width, num_segments, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr
):
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < width
    start, end = _segment_bounds(offs_ptr, g, num_rows, num_segments)
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        mask = (rows < end)[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * width + cols[None, :], mask=mask, other=0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    amax = tl.max(acc, axis=0)
    scale = tl.where(amax > 0, tl.math.fdiv(amax, 448.0, ieee_rounding=True), 1.0)
    tl.store(s_ptr + g * width + cols, scale, mask=col_ok)


@triton.jit
def _cast_variant(
    x_ptr,
    offs_ptr,
    s_ptr,
    q_ptr,
    num_rows,
    width,
    num_segments,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RECIP: tl.constexpr,
    ROWMAJ: tl.constexpr,
    TRANS: tl.constexpr,
    TRANS32: tl.constexpr = False,
):
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < width
    start, end = _segment_bounds(offs_ptr, g, num_rows, num_segments)
    scale = tl.load(s_ptr + g * width + cols, mask=col_ok, other=1.0)
    inv = 1.0 / scale
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        mask = (rows < end)[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * width + cols[None, :], mask=mask, other=0)
        if RECIP:
            y = x.to(tl.float32) * inv[None, :]
        else:
            y = tl.math.fdiv(x.to(tl.float32), scale[None, :], ieee_rounding=True)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        if TRANS32:  # transpose the fp32 tile, cast after
            tl.store(
                q_ptr + cols.to(tl.int64)[:, None] * num_rows + rows[None, :],
                tl.trans(y).to(q_ptr.dtype.element_ty),
                mask=tl.trans(mask),
            )
            continue
        y = y.to(q_ptr.dtype.element_ty)
        if ROWMAJ:
            tl.store(q_ptr + rows.to(tl.int64)[:, None] * width + cols[None, :], y, mask=mask)
        elif TRANS:  # transpose the tile in registers / shared memory, then store along M
            tl.store(
                q_ptr + cols.to(tl.int64)[:, None] * num_rows + rows[None, :],
                tl.trans(y),
                mask=tl.trans(mask),
            )
        else:
            tl.store(q_ptr + cols.to(tl.int64)[None, :] * num_rows + rows[:, None], y, mask=mask)


@triton.jit
def _cast_pack4(
    x_ptr,
    offs_ptr,
    s_ptr,
    q32_ptr,  # the e4m3 [K, M] output viewed as int32 [K, M / 4]
    num_rows,
    width,
    num_segments,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Four consecutive rows of a column packed into one 32-bit word before the transposed store."""
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < width
    start, end = _segment_bounds(offs_ptr, g, num_rows, num_segments)
    scale = tl.load(s_ptr + g * width + cols, mask=col_ok, other=1.0)
    j = tl.arange(0, BLOCK_M // 4)
    i4 = tl.arange(0, 4)
    for m0 in range(start, end, BLOCK_M):
        r = m0 + 4 * j[:, None, None] + i4[None, :, None]
        mask = (r < end) & col_ok[None, None, :]
        x = tl.load(x_ptr + r.to(tl.int64) * width + cols[None, None, :], mask=mask, other=0)
        y = tl.math.fdiv(x.to(tl.float32), scale[None, None, :], ieee_rounding=True)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv)
        b = y.to(tl.uint8, bitcast=True).to(tl.int32)
        w = tl.sum(b << (8 * i4)[None, :, None], axis=1)
        words = m0 // 4 + j
        wmask = (4 * words < end)[:, None] & col_ok[None, :]
        tl.store(q32_ptr + cols.to(tl.int64)[None, :] * (num_rows // 4) + words[:, None], w, mask=wmask)


ONLY = os.environ.get("PROBE_ONLY", "amax,cast").split(",")  # e.g. "cast loop,cast pack4"
DEVICE = os.environ.get("PROBE_DEVICE", "cuda")  # "cpu" + TRITON_INTERPRET=1: a smoke run on tiny shapes
CASES = {  # name: (rows M, columns K, segments G)
    "dsv3 x [32768, 7168] G8": (32768, 7168, 8),
    "dsv3 dh [32768, 4096] G8": (32768, 4096, 8),
    "dsv3 act [32768, 2048] G8": (32768, 2048, 8),
}
TILES = [
    (bm, bk, w)
    for bm, bk, w in itertools.product((16, 32, 64, 128), (32, 64, 128, 256), (2, 4, 8))
    if 1024 <= bm * bk <= 16384
]


def run_case(name: str, m: int, k: int, g: int) -> None:
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    offs = (torch.arange(1, g + 1, device=DEVICE, dtype=torch.int32) * (m // g)).contiguous()
    want_q, want_s = Q.quantize_segments_t(x, offs)
    s_G1K = torch.empty(g + 1, k, dtype=torch.float32, device=DEVICE)
    q = torch.empty(k, m, dtype=torch.float8_e4m3fn, device=DEVICE)
    read_gb, write_gb = 2 * m * k / 1e6, m * k / 1e6
    base = (Q.SEG_BLOCK_M, Q.SEG_BLOCK_K, Q.SEG_WARPS)

    def grid(bk):
        return (g + 1, triton.cdiv(k, bk))

    def loop_amax(bm, bk, w):
        Q._segment_amax_kernel[grid(bk)](x, offs, s_G1K, m, k, g, bm, bk, num_warps=w)

    def acc_amax(bm, bk, w):
        _amax_acc[grid(bk)](x, offs, s_G1K, m, k, g, bm, bk, num_warps=w)

    def cast(bm, bk, w, recip=False, rowmaj=False, trans=False, trans32=False, pack4=False):
        if pack4:
            _cast_pack4[grid(bk)](x, offs, s_G1K, q.view(torch.int32), m, k, g, bm, bk, num_warps=w)
            return
        _cast_variant[grid(bk)](
            x, offs, s_G1K, q, m, k, g, bm, bk, recip, rowmaj, trans, trans32, num_warps=w
        )

    print(f"\n== {name}")
    for label, fn in (("amax loop", loop_amax), ("amax acc", acc_amax)) if "amax" in ONLY else ():
        rows = []
        for t in TILES:
            fn(*t)
            assert torch.equal(s_G1K[:g], want_s), (label, t)
            rows.append((_time(lambda t=t, fn=fn: fn(*t)), t))
        cur = [r for r in rows if r[1] == base]
        best = sorted(rows)[:4]
        print(
            f"{label}: product tile {base} {cur[0][0]:.3f} ms ({read_gb / cur[0][0]:.0f} GB/s)"
            if cur
            else label
        )
        for ms, t in best:
            print(f"   {t}: {ms:.3f} ms ({read_gb / ms:.0f} GB/s)")
    Q._segment_amax_kernel[grid(base[1])](x, offs, s_G1K, m, k, g, base[0], base[1], num_warps=base[2])
    variants = (
        ("cast loop", {}),
        ("cast pack4", {"pack4": True}),
        ("cast trans32", {"trans32": True}),
        ("cast trans", {"trans": True}),
        ("cast trans recip", {"trans": True, "recip": True}),
        ("cast recip", {"recip": True}),
        ("cast rowmaj", {"rowmaj": True}),
    )
    for label, kw in [v for v in variants if v[0] in ONLY or "cast" in ONLY]:
        rows = []
        for t in TILES:
            cast(*t, **kw)
            if (
                not kw.get("recip") and not kw.get("rowmaj") and DEVICE != "cpu"
            ):  # the interpreter rounds e4m3 wrongly (fp8_quant._q_buffer)
                assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), (label, t)
            rows.append((_time(lambda t=t, kw=kw: cast(*t, **kw)), t))
        best = sorted(rows)[:4]
        print(f"{label}:")
        for ms, t in best:
            print(f"   {t}: {ms:.3f} ms ({(read_gb + write_gb) / ms:.0f} GB/s)")
    clone = _time(lambda: x.clone())
    print(f"reference: x.clone() {clone:.3f} ms ({2 * read_gb / clone:.0f} GB/s read + write)")


if DEVICE == "cpu":
    CASES = {"smoke [64, 96] G3": (64, 96, 3)}
    TILES = [(16, 32, 2), (32, 64, 4)]
for name, (m, k, g) in CASES.items():
    run_case(name, m, k, g)
