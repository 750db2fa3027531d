"""Permute with the FP8 quantization fused in: token rows -> rowwise-e4m3 expert-major rows, each token
quantized once.

Legend: T tokens, K routes per token, H hidden, E experts, P rows of the expert-major buffer
(``RoutingMeta.num_rows``, alignment padding and the spare tail included).

    quantize_permute   x_TH -> q_PH e4m3, s_P fp32, src_P int32
        bitwise ``quantize_rowwise(permute(x_TH, meta))`` (``kernels.fp8_quant``, ``kernels.permute``):
        a route's row is a copy of its token's row, so its rowwise scale and e4m3 values are the token's;
        rows no route lands on are 0 with scale 1 (what quantizing a zero row gives) and ``src`` -1.
        ``src_P[r]``: the token whose row r is, the map the weight gradient's per-(expert, column)
        quantization reads the token rows through (``fp8_quant.quantize_segments_t_rows``), so no bf16
        copy of the permuted rows is ever written.

Why: on the DeepSeek-V3 slice (T 4096, K 8, H 7168) the unfused pair writes the permuted rows in bf16
(470 MB), reads them back to quantize, and writes e4m3 (235 MB); fused, each token row is read once
(59 MB) and only the e4m3 rows are written. The same kernel is the backward of the combine feeding fc2's
FP8 gradient GEMMs (the combine's backward is this permute of the output gradient).

Kernel:
    _quantize_permute_kernel  one program per token: the row's amax (one read of a row up to
                              ONE_PASS_MAX wide, else two sweeps), scale, cast, K stores of the e4m3 row,
                              its scale and the token index; extra programs fill the rows no route lands
                              on (``kernels.permute._fill_rows``)

How it plugs in: ``experts.fp8_mlp`` (the native FP8 experts on token rows at EP = 1).
"""

from __future__ import annotations

import torch

from mok_megatron.kernels.fp8_quant_reference import _check_input
from mok_megatron.kernels import Impl, jit, next_pow2, tl, use_triton
from mok_megatron.kernels.fp8_quant import ONE_PASS_MAX, TWO_PASS_BLOCK, _finish, _q_buffer, quantize_rowwise
from mok_megatron.kernels.permute import (
    FILL_PROGRAMS_MAX,
    FILL_ROWS,
    _fill_rows,
    _fill_setup,
    _validate,
    permute_reference,
)
from mok_megatron.kernels.routing import RoutingMeta


FILL_BLOCK_H = 1024  # columns per store of a fill program (zero rows)


@jit
def _scale(amax):
    return tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)


@jit
def _quantize_permute_kernel(
    x_ptr,  # [T, H] token rows
    row_ptr,  # [T, K] int32 destination rows, -1 = dropped
    q_ptr,  # e4m3 [P, H]
    s_ptr,  # fp32 [P]
    src_ptr,  # int32 [P]
    offsets_ptr,  # [E] inclusive offsets, unpadded
    aligned_offsets_ptr,  # [E] inclusive offsets, aligned
    num_tokens,
    width,
    num_rows,
    num_experts,
    fill_stride,
    K: tl.constexpr,
    E_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ONE_PASS: tl.constexpr,
    FILL_ROWS: tl.constexpr,
    FILL_H: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < num_tokens:
        t = pid.to(tl.int64)
        base = x_ptr + t * width
        if ONE_PASS:  # the row lives in registers: one read
            cols = tl.arange(0, BLOCK_H)
            ok = cols < width
            x = tl.load(base + cols, mask=ok, other=0).to(tl.float32)
            scale = _scale(tl.max(tl.abs(x), axis=0))
            y = tl.math.div_rn(x, scale)
            y = tl.minimum(tl.maximum(y, -448.0), 448.0).to(q_ptr.dtype.element_ty)
            for k in tl.static_range(K):
                row = tl.load(row_ptr + t * K + k).to(tl.int64)
                tl.store(q_ptr + row * width + cols, y, mask=ok & (row >= 0))
        else:  # two sweeps, the second mostly from L2
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
            for h0 in range(0, width, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                x = tl.load(base + cols, mask=cols < width, other=0).to(tl.float32)
                acc = tl.maximum(acc, tl.abs(x))
            scale = _scale(tl.max(acc, axis=0))
            for h0 in range(0, width, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                ok = cols < width
                x = tl.load(base + cols, mask=ok, other=0).to(tl.float32)
                y = tl.math.div_rn(x, scale)
                y = tl.minimum(tl.maximum(y, -448.0), 448.0).to(q_ptr.dtype.element_ty)
                for k in tl.static_range(K):
                    row = tl.load(row_ptr + t * K + k).to(tl.int64)
                    tl.store(q_ptr + row * width + cols, y, mask=ok & (row >= 0))
        for k in tl.static_range(K):
            row = tl.load(row_ptr + t * K + k).to(tl.int64)
            if row >= 0:
                tl.store(s_ptr + row, scale)
                tl.store(src_ptr + row, pid)
    else:
        pad, num_fill = _fill_setup(offsets_ptr, aligned_offsets_ptr, num_rows, num_experts, E_P2)
        zeros = tl.zeros([FILL_ROWS, FILL_H], dtype=tl.float32).to(q_ptr.dtype.element_ty)
        for q0 in range((pid - num_tokens) * FILL_ROWS, num_fill, fill_stride):
            rows, q_ok = _fill_rows(q0, pad, num_fill, offsets_ptr, num_experts, FILL_ROWS)
            tl.store(s_ptr + rows, tl.full([FILL_ROWS], 1.0, tl.float32), mask=q_ok)
            tl.store(src_ptr + rows, tl.full([FILL_ROWS], -1, tl.int32), mask=q_ok)
            for h0 in range(0, width, FILL_H):
                cols = h0 + tl.arange(0, FILL_H)
                mask = q_ok[:, None] & (cols < width)[None, :]
                tl.store(q_ptr + rows[:, None] * width + cols[None, :], zeros, mask=mask)


def quantize_permute(
    x_TH: torch.Tensor, meta: RoutingMeta, impl: Impl = Impl.AUTO
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs: x_TH fp32/bf16/fp16 [T, H]; meta from ``kernels.routing.routing_metadata``.
    Outputs: q_PH e4m3 [P, H], s_P fp32 [P], src_P int32 [P] (module docstring). Not differentiable."""
    _check_input(x_TH, "quantize_permute")
    _validate(x_TH, meta, None, "quantize_permute")
    if not use_triton(impl, x_TH, "quantize_permute"):
        return quantize_permute_reference(x_TH, meta)
    num_tokens, width = x_TH.shape
    num_rows = meta.num_rows
    dev = x_TH.device
    q_PH = _q_buffer((num_rows, width), dev)
    s_P = torch.empty(num_rows, dtype=torch.float32, device=dev)
    src_P = torch.empty(num_rows, dtype=torch.int32, device=dev)
    if num_rows == 0:
        return _finish(q_PH), s_P, src_P
    one_pass = width <= ONE_PASS_MAX
    block_h = next_pow2(width) if one_pass else TWO_PASS_BLOCK
    fill_programs = min(-(-num_rows // FILL_ROWS), FILL_PROGRAMS_MAX)
    _quantize_permute_kernel[(num_tokens + fill_programs,)](
        x_TH.contiguous(),
        meta.row_TK,
        q_PH,
        s_P,
        src_P,
        meta.offsets_E,
        meta.aligned_offsets_E,
        num_tokens,
        width,
        num_rows,
        meta.num_experts,
        fill_programs * FILL_ROWS,
        K=meta.row_TK.shape[1],
        E_P2=next_pow2(meta.num_experts),
        BLOCK_H=block_h,
        ONE_PASS=one_pass,
        FILL_ROWS=FILL_ROWS,
        FILL_H=min(block_h, FILL_BLOCK_H),
        num_warps=8 if block_h >= 4096 else 4,
    )
    return _finish(q_PH), s_P, src_P


def permute_sources(meta: RoutingMeta) -> torch.Tensor:
    """``src_P`` int32 [P]: the token of each row of the expert-major buffer, -1 where no route lands."""
    num_tokens, topk = meta.row_TK.shape
    rows_N = meta.row_TK.reshape(-1).long()
    rows_N = torch.where(rows_N >= 0, rows_N, meta.num_rows)
    tok_N = torch.arange(num_tokens, device=rows_N.device, dtype=torch.int32).repeat_interleave(topk)
    src = torch.full((meta.num_rows + 1,), -1, dtype=torch.int32, device=rows_N.device)
    return src.index_copy(0, rows_N, tok_N)[:-1]


def quantize_permute_reference(x_TH: torch.Tensor, meta: RoutingMeta):
    """Pure torch: permute, then quantize rowwise."""
    x_PH, _ = permute_reference(x_TH, meta)
    q_PH, s_P = quantize_rowwise(x_PH, Impl.TORCH)
    return q_PH, s_P, permute_sources(meta)
