"""Fused SwiGLU on fc1's output, optionally times a per-row probability, forward and backward.

Legend: M rows (routed tokens, grouped by expert), F expert FFN width; fc1's output ``h_M2F`` is
``[gate | up]`` (Megatron's layout: ``MoKGroupedMLP.fc1_weight`` holds the gate rows, then the up rows).

Forward:  ``a_MF = silu(gate) * up * p_M`` (p = 1 without probabilities), computed in fp32, rounded once.
Backward (autograd, or ``swiglu_backward`` on its own): from ``h_M2F`` and ``p_M`` (nothing else saved)
and ``da_MF``:
    ``dgate = da * p * up * silu'(gate)``, ``dup = da * p * silu(gate)``, ``dp_M = sum_f da * silu(gate) * up``.

Megatron rounds ``silu(gate) * up`` to the activation dtype before the probability multiply; this kernel
rounds once, so bf16 results may differ from ``ops.activation.apply_activation`` by one bf16 ulp.

How it plugs in: ``ops.activation.apply_activation`` runs it for ``ActivationSpec(SILU, gated=True)`` with
no clamp, no linear offset and no fc1 interleave on CUDA (the other specs keep the torch op), between the two
grouped GEMMs of ``experts.torch_mlp.expert_mlp`` and in its delayed-wgrad / recompute variants.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mok_megatron.kernels import Impl, jit, next_pow2, tl, use_triton


@jit
def _swiglu_fwd_kernel(
    h_ptr,
    p_ptr,
    a_ptr,
    live_ptr,
    num_rows,
    ffn,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_LIVE: tl.constexpr,
):
    if HAS_LIVE:  # rows past the live count are neither read nor written
        num_rows = tl.minimum(num_rows, tl.load(live_ptr).to(tl.int32))
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < num_rows)[:, None] & (cols < ffn)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    h_row = h_ptr + rows64 * (2 * ffn) + cols[None, :]
    gate = tl.load(h_row, mask=mask, other=0).to(tl.float32)
    up = tl.load(h_row + ffn, mask=mask, other=0).to(tl.float32)
    a = gate * tl.sigmoid(gate) * up
    if HAS_PROBS:
        a = a * tl.load(p_ptr + rows, mask=rows < num_rows, other=0).to(tl.float32)[:, None]
    tl.store(a_ptr + rows64 * ffn + cols[None, :], a.to(a_ptr.dtype.element_ty), mask=mask)


@jit
def _swiglu_bwd_kernel(
    h_ptr,
    p_ptr,
    da_ptr,
    dh_ptr,
    dp_ptr,
    live_ptr,
    num_rows,
    ffn,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    HAS_LIVE: tl.constexpr,
):
    """One program per BLOCK_M rows, looping over F so the probability gradient is a plain row sum."""
    if HAS_LIVE:
        num_rows = tl.minimum(num_rows, tl.load(live_ptr).to(tl.int32))
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    rows64 = rows.to(tl.int64)[:, None]
    if HAS_PROBS:
        p = tl.load(p_ptr + rows, mask=row_ok, other=0).to(tl.float32)[:, None]
    dp = tl.zeros([BLOCK_M], dtype=tl.float32)
    for f0 in range(0, ffn, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = row_ok[:, None] & (cols < ffn)[None, :]
        h_row = h_ptr + rows64 * (2 * ffn) + cols[None, :]
        gate = tl.load(h_row, mask=mask, other=0).to(tl.float32)
        up = tl.load(h_row + ffn, mask=mask, other=0).to(tl.float32)
        da = tl.load(da_ptr + rows64 * ffn + cols[None, :], mask=mask, other=0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        if HAS_PROBS:
            dp += tl.sum(da * silu * up, axis=1)
            da = da * p
        dgate = da * up * (sig + silu * (1.0 - sig))
        dup = da * silu
        dh_row = dh_ptr + rows64 * (2 * ffn) + cols[None, :]
        tl.store(dh_row, dgate.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_row + ffn, dup.to(dh_ptr.dtype.element_ty), mask=mask)
    if HAS_PROBS:
        tl.store(dp_ptr + rows, dp.to(dp_ptr.dtype.element_ty), mask=row_ok)


def _blocks(ffn: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_F): tiles of 2048 elements (16 per thread at 4 warps). BLOCK_F <= 256 divides the
    usual FFN widths (768, 1536, 2048) so no lanes idle; wider tiles would waste 25 % at F = 768."""
    block_f = min(next_pow2(max(ffn, 1)), 256)
    return 2048 // block_f, block_f


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_M2F, probs_M, live_rows):
        num_rows, ffn = h_M2F.shape[0], h_M2F.shape[1] // 2
        h_M2F = h_M2F.contiguous()
        a_MF = h_M2F.new_empty(num_rows, ffn)
        ctx.save_for_backward(h_M2F, probs_M, live_rows)
        if num_rows and ffn:
            block_m, block_f = _blocks(ffn)
            grid = (-(-num_rows // block_m), -(-ffn // block_f))
            p = probs_M.contiguous() if probs_M is not None else h_M2F
            _swiglu_fwd_kernel[grid](
                h_M2F,
                p,
                a_MF,
                live_rows if live_rows is not None else h_M2F,
                num_rows,
                ffn,
                block_m,
                block_f,
                HAS_PROBS=probs_M is not None,
                HAS_LIVE=live_rows is not None,
            )
        return a_MF

    @staticmethod
    def backward(ctx, da_MF):
        h_M2F, probs_M, live_rows = ctx.saved_tensors
        dh_M2F, dp_M = _swiglu_backward(h_M2F, probs_M, da_MF, live_rows)
        return dh_M2F, dp_M, None


def _swiglu_backward(h_M2F, probs_M, da_MF, live_rows):
    num_rows, ffn = h_M2F.shape[0], h_M2F.shape[1] // 2
    dh_M2F = torch.empty_like(h_M2F)
    dp_M = None if probs_M is None else torch.empty_like(probs_M)  # every live row is written
    if num_rows and ffn:
        block_m, block_f = _blocks(ffn)
        p = probs_M.contiguous() if probs_M is not None else h_M2F
        _swiglu_bwd_kernel[(-(-num_rows // block_m),)](
            h_M2F,
            p,
            da_MF.contiguous(),
            dh_M2F,
            dh_M2F if dp_M is None else dp_M,
            live_rows if live_rows is not None else h_M2F,
            num_rows,
            ffn,
            block_m,
            block_f,
            HAS_PROBS=probs_M is not None,
            HAS_LIVE=live_rows is not None,
        )
    return dh_M2F, dp_M


def swiglu(
    h_M2F: torch.Tensor,
    probs_M: torch.Tensor | None = None,
    impl: Impl = Impl.AUTO,
    live_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inputs: h_M2F [M, 2F] ([gate | up]); probs_M [M] or None. Output: a_MF [M, F] in h's dtype.
    Differentiable in h and probs (the probability gradient comes back in probs' dtype).
    ``live_rows`` (a one-element integer tensor on h's device, e.g. the grouped GEMMs' last offset): rows at
    and past it are padding no GEMM reads (a sync-free buffer's spare rows); the kernels neither read nor
    write them, so their output and gradient entries are unspecified. The torch path computes them."""
    if h_M2F.dim() != 2 or h_M2F.shape[1] % 2:
        raise ValueError(f"swiglu: h has shape {tuple(h_M2F.shape)}, expected [M, 2F] ([gate | up] halves)")
    if probs_M is not None and probs_M.shape != (h_M2F.shape[0],):
        raise ValueError(f"swiglu: probs has shape {tuple(probs_M.shape)}, expected ({h_M2F.shape[0]},)")
    if not use_triton(impl, h_M2F, "swiglu"):
        return swiglu_reference(h_M2F, probs_M)
    if live_rows is not None and live_rows.numel() != 1:
        raise ValueError(f"swiglu: live_rows has {live_rows.numel()} elements, expected one (a row count)")
    return _SwiGLU.apply(h_M2F, probs_M, live_rows)


def swiglu_reference(h_M2F: torch.Tensor, probs_M: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch, in fp32 and rounded once (the kernel's numerics)."""
    gate, up = h_M2F.float().chunk(2, dim=-1)
    a = F.silu(gate) * up
    if probs_M is not None:
        a = a * probs_M.float().unsqueeze(-1)
    return a.to(h_M2F.dtype)


def swiglu_backward(
    h_M2F: torch.Tensor,
    probs_M: torch.Tensor | None,
    da_MF: torch.Tensor,
    impl: Impl = Impl.AUTO,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backward of ``swiglu`` on its own, for callers that keep fc1's output rather than an autograd
    graph (the same kernel autograd runs). Inputs: h_M2F [M, 2F] (fc1's output, saved by the forward);
    probs_M [M] or None; da_MF [M, F] (the gradient of the activation). Outputs: dh_M2F [M, 2F] in h's
    dtype; dp_M [M] in probs' dtype (None without probabilities)."""
    if h_M2F.dim() != 2 or h_M2F.shape[1] % 2:
        raise ValueError(
            f"swiglu_backward: h has shape {tuple(h_M2F.shape)}, expected [M, 2F] ([gate | up] halves)"
        )
    want = (h_M2F.shape[0], h_M2F.shape[1] // 2)
    if da_MF.shape != want:
        raise ValueError(f"swiglu_backward: da has shape {tuple(da_MF.shape)}, expected {want}")
    if probs_M is not None and probs_M.shape != (h_M2F.shape[0],):
        raise ValueError(
            f"swiglu_backward: probs has shape {tuple(probs_M.shape)}, expected ({h_M2F.shape[0]},)"
        )
    if not use_triton(impl, h_M2F, "swiglu_backward"):
        return swiglu_backward_reference(h_M2F, probs_M, da_MF)
    return _swiglu_backward(h_M2F.contiguous(), probs_M, da_MF, None)


def swiglu_backward_reference(
    h_M2F: torch.Tensor, probs_M: torch.Tensor | None, da_MF: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pure torch, in fp32 and rounded once (the backward kernel's numerics, the formulas at the top)."""
    gate, up = h_M2F.float().chunk(2, dim=-1)
    da = da_MF.float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    dp = None
    if probs_M is not None:
        dp = (da * silu * up).sum(-1).to(probs_M.dtype)
        da = da * probs_M.float().unsqueeze(-1)
    dgate = da * up * (sig + silu * (1.0 - sig))
    dh = torch.cat([dgate, da * silu], dim=-1).to(h_M2F.dtype)
    return dh, dp
