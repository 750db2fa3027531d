"""The router's gating GEMM in fp32 precision on bf16 tensor cores (``moe_router_dtype='fp32'``).

Legend:
    T  tokens on this rank
    H  hidden size
    E  experts (all of them: the router is replicated)

Megatron-Core's ``router_gating_linear`` with ``moe_router_dtype='fp32'`` casts the bf16 input and
weight to fp32 and runs fp32 GEMMs (without TE: CUDA-core FFMA kernels, plus two [T, H] fp32 copies of
the input). On the Qwen3-30B-A3B layer that is ~0.8 ms of a ~8.5 ms fwd+bwd (H200 profile:
docs/results/2026-12-01-fp8-experts/host-profile). The same numbers come from bf16 tensor cores:

* forward: ``logits_TE = x_TH @ w_EH.T``. A product of two bf16 numbers is exact in fp32, so a bf16
  GEMM that accumulates and writes fp32 equals the fp32 GEMM up to summation order.
* backward: the fp32 gradient ``g_TE`` is split into ``g_hi = bf16(g)`` and ``g_lo = bf16(g - g_hi)``
  (``g_hi + g_lo`` carries 16 mantissa bits: relative error <= 2**-17), and each product of the fp32
  GEMM becomes two exact bf16 products: ``dx_TH = [g_hi | g_lo] @ [w; w]`` (one GEMM with K = 2E, one
  final rounding to the input dtype, as Megatron's), ``dw_EH = g_hi.T @ x + g_lo.T @ x`` (one GEMM with
  M = 2E, accumulated in fp32, rounded once to the weight dtype). The split adds at most
  ``2**-16 * sum(|g| |w|)`` (resp. ``|g| |x|``) before the final rounding: invisible except where the sum
  cancels to below 1/256 of its terms.

``router_logits`` takes this path when input and weight are bf16/fp16 and the router dtype is fp32;
anything else (fp32 parameters, fp64 routers, the input dtype as router dtype) returns None so the
caller keeps Megatron's ``router_gating_linear``. ``router_logits_reference`` is the fp32 formula the
tests compare against. On CPU the same split runs with fp32 matmuls of the exact bf16 values (CUDA's
``torch.mm(..., out_dtype=float32)`` has no CPU kernel), so CPU tests check the split arithmetic.
"""

from __future__ import annotations

import torch

_HALF = (torch.bfloat16, torch.float16)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two bf16/fp16 matrices, accumulated and returned in fp32."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _split(g: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    hi = g.to(dtype)
    lo = (g - hi.float()).to(dtype)
    return hi, lo


def input_grad(g_TE: torch.Tensor, w_EH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``g_TE @ w_EH`` with ``g`` split in two bf16 halves: one GEMM (K = 2E), rounded once to ``dtype``."""
    hi_TE, lo_TE = _split(g_TE, dtype)
    w_EH = w_EH.to(dtype)
    return _mm_f32(torch.cat([hi_TE, lo_TE], dim=1), torch.cat([w_EH, w_EH], dim=0)).to(dtype)


def weight_grad_f32(g_TE: torch.Tensor, x_TH: torch.Tensor) -> torch.Tensor:
    """``g_TE.T @ x_TH`` in fp32 with ``g`` split in two bf16 halves: one GEMM (M = 2E), halves summed."""
    hi_TE, lo_TE = _split(g_TE, x_TH.dtype)
    e = g_TE.shape[1]
    dw_2EH = _mm_f32(torch.cat([hi_TE, lo_TE], dim=1).t(), x_TH)
    return dw_2EH[:e] + dw_2EH[e:]


class _RouterGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w_EH, b_E):
        ctx.save_for_backward(x_TH, w_EH)
        ctx.has_bias = b_E is not None
        logits_TE = _mm_f32(x_TH, w_EH.t())
        if b_E is not None:
            logits_TE = logits_TE + b_E.float()
        return logits_TE

    @staticmethod
    def backward(ctx, g_TE):
        x_TH, w_EH = ctx.saved_tensors
        g_TE = g_TE.float()
        dx_TH = input_grad(g_TE, w_EH, x_TH.dtype) if ctx.needs_input_grad[0] else None
        dw_EH = weight_grad_f32(g_TE, x_TH).to(w_EH.dtype) if ctx.needs_input_grad[1] else None
        db_E = g_TE.sum(dim=0).to(w_EH.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx_TH, dw_EH, db_E


def fast_router_supported(x: torch.Tensor, w: torch.Tensor, router_dtype: torch.dtype) -> bool:
    return router_dtype == torch.float32 and x.dtype in _HALF and w.dtype == x.dtype


def router_logits(
    x: torch.Tensor, w_EH: torch.Tensor, b_E: torch.Tensor | None, router_dtype: torch.dtype
) -> torch.Tensor | None:
    """fp32 router logits ``[..., E]`` from bf16 tensor cores, or None where this path does not apply."""
    if not fast_router_supported(x, w_EH, router_dtype):
        return None
    x_TH = x.reshape(-1, x.shape[-1])
    logits_TE = _RouterGemm.apply(x_TH, w_EH, b_E)
    return logits_TE.view(*x.shape[:-1], w_EH.shape[0])


def router_logits_reference(x: torch.Tensor, w_EH: torch.Tensor, b_E: torch.Tensor | None) -> torch.Tensor:
    """Megatron's fp32 formula: cast both to fp32, then GEMM."""
    out = x.float() @ w_EH.float().t()
    return out if b_E is None else out + b_E.float()
