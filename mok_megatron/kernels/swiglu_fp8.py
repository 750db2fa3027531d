"""SwiGLU forward / backward with the FP8 rowwise quantization of their output fused in (native FP8 experts).

Legend: M rows (a multiple of PART in the FP8 experts' padded layouts, any M here), F FFN width, fc1's output
``h_M2F = [gate | up]``, B = ceil(M / PART) blocks of PART rows.

    swiglu_fp8_fwd(h_M2F, p_M)        -> a_MF, (q_MF e4m3, s_M fp32, part_BF)
    swiglu_fp8_bwd(h_M2F, p_M, da_MF) -> dh_M2F, dp_M, (q_M2F e4m3, s_M fp32, part_B2F)

``a`` / ``dh`` / ``dp`` are ``kernels.swiglu``'s (the same arithmetic, bitwise); ``(q, s)`` is
``quantize_rowwise`` of that bf16 output and ``part`` its per-PART-row-block column amax, i.e. what
``kernels.fp8_quant.quantize_rowwise_partials`` would compute in a second pass over it: fc2's forward
operand (a) and fc1's dgrad operand (dh), plus what their weight gradients' per-(expert, column) scales need.
Each program owns PART rows: pass 1 computes the activation (or its gradient) per F block, stores it and keeps
the running row amax and the block's column amax; pass 2 reads the rows it just wrote (L2) and stores e4m3.
So the output is read back from L2 instead of HBM, and one launch goes away per operand.

How it plugs in: ``fp8.token_experts`` (the native FP8 experts on token rows) for SwiGLU without clamp,
offset or interleave on CUDA; the references run elsewhere.
"""

from __future__ import annotations

import torch

from mok_megatron.kernels import Impl, jit, next_pow2, tl, use_triton
from mok_megatron.kernels.fp8_quant import PARTIAL_ROWS, _finish, _q_buffer, quantize_rowwise
from mok_megatron.kernels.swiglu import _blocks, swiglu_reference

BLOCK_F_MAX = 256  # columns per step (16 rows x 256 = 4096 elements per tile)


@jit
def _cast_rows(src_ptr, q_ptr, rows64, row_ok, width, scale, BLOCK_F: tl.constexpr):
    """Pass 2: rows ``rows64`` of a row-major [*, width] tensor / scale -> e4m3 (clamped to +-448)."""
    for f0 in range(0, width, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = row_ok[:, None] & (cols < width)[None, :]
        v = tl.load(src_ptr + rows64 * width + cols[None, :], mask=mask, other=0).to(tl.float32)
        y = tl.math.fdiv(v, scale[:, None], ieee_rounding=True)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(q_ptr + rows64 * width + cols[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)


@jit
def _scale(amax):
    return tl.where(amax > 0, tl.math.fdiv(amax, 448.0, ieee_rounding=True), 1.0)


@jit
def _swiglu_fp8_fwd_kernel(
    h_ptr,
    p_ptr,
    a_ptr,
    q_ptr,
    s_ptr,
    part_ptr,
    num_rows,
    ffn,
    PART: tl.constexpr,
    BLOCK_F: tl.constexpr,
    HAS_PROBS: tl.constexpr,
):
    block = tl.program_id(0)
    rows = block * PART + tl.arange(0, PART)
    row_ok = rows < num_rows
    rows64 = rows.to(tl.int64)[:, None]
    if HAS_PROBS:
        p = tl.load(p_ptr + rows, mask=row_ok, other=0).to(tl.float32)[:, None]
    amax = tl.zeros([PART], dtype=tl.float32)
    for f0 in range(0, ffn, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        col_ok = cols < ffn
        mask = row_ok[:, None] & col_ok[None, :]
        h_row = h_ptr + rows64 * (2 * ffn) + cols[None, :]
        gate = tl.load(h_row, mask=mask, other=0).to(tl.float32)
        up = tl.load(h_row + ffn, mask=mask, other=0).to(tl.float32)
        a = gate * tl.sigmoid(gate) * up
        if HAS_PROBS:
            a = a * p
        a = a.to(a_ptr.dtype.element_ty)
        tl.store(a_ptr + rows64 * ffn + cols[None, :], a, mask=mask)
        mag = tl.abs(a.to(tl.float32))
        amax = tl.maximum(amax, tl.max(mag, axis=1))
        col_max = tl.max(mag, axis=0)
        tl.store(
            part_ptr + block.to(tl.int64) * ffn + cols, col_max.to(part_ptr.dtype.element_ty), mask=col_ok
        )
    scale = _scale(amax)
    tl.store(s_ptr + rows, scale, mask=row_ok)
    tl.debug_barrier()  # pass 2 reads rows other threads of this program wrote
    _cast_rows(a_ptr, q_ptr, rows64, row_ok, ffn, scale, BLOCK_F)


@jit
def _swiglu_fp8_bwd_kernel(
    h_ptr,
    p_ptr,
    da_ptr,
    dh_ptr,
    dp_ptr,
    q_ptr,
    s_ptr,
    part_ptr,  # fp32 [B, 2F], zero-filled: column amaxes gathered with atomic max (order-free: exact)
    num_rows,
    ffn,
    num_blocks,
    PART: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
    HAS_PROBS: tl.constexpr,
):
    """``kernels.swiglu._swiglu_bwd_kernel``'s tiles and arithmetic (so dp's row sums are bitwise the same),
    plus each row's amax, the PART-row column amaxes and pass 2's cast."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    rows64 = rows.to(tl.int64)[:, None]
    if HAS_PROBS:
        p = tl.load(p_ptr + rows, mask=row_ok, other=0).to(tl.float32)[:, None]
    dp = tl.zeros([BLOCK_M], dtype=tl.float32)
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for f0 in range(0, ffn, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        col_ok = cols < ffn
        mask = row_ok[:, None] & col_ok[None, :]
        h_row = h_ptr + rows64 * (2 * ffn) + cols[None, :]
        gate = tl.load(h_row, mask=mask, other=0).to(tl.float32)
        up = tl.load(h_row + ffn, mask=mask, other=0).to(tl.float32)
        da = tl.load(da_ptr + rows64 * ffn + cols[None, :], mask=mask, other=0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        if HAS_PROBS:
            dp += tl.sum(da * silu * up, axis=1)
            da = da * p
        dgate = (da * up * (sig + silu * (1.0 - sig))).to(dh_ptr.dtype.element_ty)
        dup = (da * silu).to(dh_ptr.dtype.element_ty)
        dh_row = dh_ptr + rows64 * (2 * ffn) + cols[None, :]
        tl.store(dh_row, dgate, mask=mask)
        tl.store(dh_row + ffn, dup, mask=mask)
        mg, mu = tl.abs(dgate.to(tl.float32)), tl.abs(dup.to(tl.float32))
        amax = tl.maximum(amax, tl.maximum(tl.max(mg, axis=1), tl.max(mu, axis=1)))
        _column_max(part_ptr, mg, cols, col_ok, 0, ffn, num_blocks, PART, BLOCK_M, BLOCK_F)
        _column_max(part_ptr, mu, cols, col_ok, ffn, ffn, num_blocks, PART, BLOCK_M, BLOCK_F)
    if HAS_PROBS:
        tl.store(dp_ptr + rows, dp.to(dp_ptr.dtype.element_ty), mask=row_ok)
    scale = _scale(amax)
    tl.store(s_ptr + rows, scale, mask=row_ok)
    tl.debug_barrier()  # pass 2 reads rows other threads of this program wrote
    _cast_rows(dh_ptr, q_ptr, rows64, row_ok, 2 * ffn, scale, BLOCK_F)


@jit
def _column_max(
    part_ptr,
    mag,
    cols,
    col_ok,
    col0,
    ffn,
    num_blocks,
    PART: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """Atomic max of the tile's per-PART-row-block column amaxes into part [B, 2F] at column col0 + cols
    (masked rows are 0, which changes no max; a max in any order is exact)."""
    if BLOCK_M >= PART:
        per = tl.max(tl.reshape(mag, [BLOCK_M // PART, PART, BLOCK_F]), axis=1)
        blocks = tl.program_id(0) * (BLOCK_M // PART) + tl.arange(0, BLOCK_M // PART)
        ptrs = part_ptr + blocks.to(tl.int64)[:, None] * (2 * ffn) + col0 + cols[None, :]
        tl.atomic_max(ptrs, per, mask=(blocks < num_blocks)[:, None] & col_ok[None, :])
    else:
        block = (tl.program_id(0) * BLOCK_M) // PART
        ptrs = part_ptr + block.to(tl.int64) * (2 * ffn) + col0 + cols
        tl.atomic_max(ptrs, tl.max(mag, axis=0), mask=col_ok & (block < num_blocks))


def _block_f(ffn: int) -> int:
    return min(next_pow2(max(ffn, 1)), BLOCK_F_MAX)


def _check(h_M2F, probs_M, op):
    if h_M2F.dim() != 2 or h_M2F.shape[1] % 2:
        raise ValueError(f"{op}: h has shape {tuple(h_M2F.shape)}, expected [M, 2F] ([gate | up] halves)")
    if probs_M is not None and probs_M.shape != (h_M2F.shape[0],):
        raise ValueError(f"{op}: probs has shape {tuple(probs_M.shape)}, expected ({h_M2F.shape[0]},)")


def _partials_reference(x_MK: torch.Tensor) -> torch.Tensor:
    rows, width = x_MK.shape
    blocks = torch.nn.functional.pad(x_MK.abs().float(), (0, 0, 0, -rows % PARTIAL_ROWS))
    return blocks.view(-1, PARTIAL_ROWS, width).amax(dim=1).to(x_MK.dtype)


def _quantized_reference(x_MK: torch.Tensor):
    q, s = quantize_rowwise(x_MK, Impl.TORCH)
    return q, s, _partials_reference(x_MK)


def swiglu_fp8_fwd(h_M2F: torch.Tensor, probs_M: torch.Tensor | None = None, impl: Impl = Impl.AUTO):
    """Not differentiable (``fp8.token_experts`` owns the autograd). Module docstring for the outputs."""
    _check(h_M2F, probs_M, "swiglu_fp8_fwd")
    if not use_triton(impl, h_M2F, "swiglu_fp8_fwd"):
        a_MF = swiglu_reference(h_M2F, probs_M)
        return a_MF, _quantized_reference(a_MF)
    num_rows, ffn = h_M2F.shape[0], h_M2F.shape[1] // 2
    h_M2F = h_M2F.contiguous()
    dev = h_M2F.device
    a_MF = h_M2F.new_empty(num_rows, ffn)
    q_MF = _q_buffer((num_rows, ffn), dev)
    s_M = torch.empty(num_rows, dtype=torch.float32, device=dev)
    part_BF = torch.empty(-(-num_rows // PARTIAL_ROWS), ffn, dtype=h_M2F.dtype, device=dev)
    if num_rows and ffn:
        p = probs_M.contiguous() if probs_M is not None else h_M2F
        _swiglu_fp8_fwd_kernel[(part_BF.shape[0],)](
            h_M2F, p, a_MF, q_MF, s_M, part_BF, num_rows, ffn, PARTIAL_ROWS, _block_f(ffn),
            HAS_PROBS=probs_M is not None, num_warps=4,
        )  # fmt: skip
    return a_MF, (_finish(q_MF), s_M, part_BF)


def swiglu_fp8_bwd(h_M2F, probs_M, da_MF, impl: Impl = Impl.AUTO):
    """``(dh_M2F, dp_M | None, (q, s, part))``: ``kernels.swiglu``'s backward and dh quantized rowwise."""
    _check(h_M2F, probs_M, "swiglu_fp8_bwd")
    if da_MF.shape != (h_M2F.shape[0], h_M2F.shape[1] // 2):
        raise ValueError(f"swiglu_fp8_bwd: da has shape {tuple(da_MF.shape)}, expected [M, F] of h's M and F")
    if not use_triton(impl, h_M2F, "swiglu_fp8_bwd"):
        dh_M2F, dp_M = swiglu_bwd_reference(h_M2F, probs_M, da_MF)
        return dh_M2F, dp_M, _quantized_reference(dh_M2F)
    num_rows, ffn = h_M2F.shape[0], h_M2F.shape[1] // 2
    dev = h_M2F.device
    dh_M2F = torch.empty_like(h_M2F)
    dp_M = None if probs_M is None else torch.empty_like(probs_M)
    q_M2F = _q_buffer((num_rows, 2 * ffn), dev)
    s_M = torch.empty(num_rows, dtype=torch.float32, device=dev)
    # fp32 block amaxes (exact: |bf16| values), filled by atomic max; the segment quantization reads any dtype
    part_B2F = torch.zeros(-(-num_rows // PARTIAL_ROWS), 2 * ffn, dtype=torch.float32, device=dev)
    if num_rows and ffn:
        block_m, block_f = _blocks(ffn)  # kernels.swiglu's backward tiles: its dp bitwise
        p = probs_M.contiguous() if probs_M is not None else h_M2F
        _swiglu_fp8_bwd_kernel[(-(-num_rows // block_m),)](
            h_M2F.contiguous(), p, da_MF.contiguous(), dh_M2F, dh_M2F if dp_M is None else dp_M, q_M2F, s_M,
            part_B2F, num_rows, ffn, part_B2F.shape[0], PARTIAL_ROWS, block_m, block_f,
            HAS_PROBS=probs_M is not None,
        )  # fmt: skip
    return dh_M2F, dp_M, (_finish(q_M2F), s_M, part_B2F)


def swiglu_bwd_reference(h_M2F, probs_M, da_MF):
    """The backward of ``swiglu_reference`` by autograd (fp32 math, rounded once to h's / probs' dtype)."""
    with torch.enable_grad():
        h = h_M2F.detach().requires_grad_()
        p = None if probs_M is None else probs_M.detach().requires_grad_()
        a = swiglu_reference(h, p)
        grads = torch.autograd.grad(a, [t for t in (h, p) if t is not None], da_MF)
    return grads[0], (grads[1] if p is not None else None)
