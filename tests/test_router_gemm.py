"""The fp32 router GEMM on bf16 tensor cores: the split arithmetic against Megatron's fp32 formula.

On CPU ``_mm_f32`` multiplies the exact bf16 values in fp32, so these tests check the hi/lo split and the
stacking of the two halves; the GPU test (tests/test_gpu.py) runs the CUDA ``out_dtype`` GEMMs.
"""

from __future__ import annotations

import pytest
import torch

from mok_megatron.ops.router_gemm import router_logits, router_logits_reference


def _case(t=64, h=96, e=16, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(e, h, generator=g) * 0.05).bfloat16().requires_grad_()
    b = (torch.randn(e, generator=g) * 0.1).bfloat16().requires_grad_() if bias else None
    dy = torch.randn(t, e, generator=g)
    return x, w, b, dy


def _grads(fn, x, w, b, dy):
    out = fn(x, w, b)
    params = [x, w] + ([b] if b is not None else [])
    grads = torch.autograd.grad(out, params, dy)
    return out, grads


def _megatron(x, w, b):
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    return router_gating_linear(x, w, b, torch.float32)


@pytest.mark.parametrize("bias", [False, True])
def test_matches_megatron_fp32_router(bias):
    x, w, b, dy = _case(bias=bias)
    out, grads = _grads(lambda *a: router_logits(*a, torch.float32), x, w, b, dy)
    ref, ref_grads = _grads(_megatron, x, w, b, dy)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    # Each result is rounded once to bf16 like Megatron's; before that the split may add
    # 2**-16 * sum of |terms| (documented bound), so allow one bf16 ulp plus that.
    terms = [dy.abs() @ w.detach().float().abs(), dy.abs().t() @ x.detach().float().abs()]
    if bias:
        terms.append(dy.abs().sum(0))
    for got, want, t in zip(grads, ref_grads, terms, strict=True):
        assert got.dtype == want.dtype
        err = (got.float() - want.float()).abs()
        assert (err <= 2**-7 * want.float().abs() + 2**-16 * t + 1e-30).all(), err.max()


def test_split_keeps_sixteen_bits():
    # Before rounding, the split gradients must be far closer to fp32 than one bf16 rounding of g.
    from mok_megatron.ops.router_gemm import input_grad, weight_grad_f32

    x, w, _, dy = _case(t=256, e=8, seed=3)
    x, w = x.detach(), w.detach()
    dw_ref = dy.t() @ x.float()
    dw_one_rounding = dy.bfloat16().float().t() @ x.float()
    err_split = (weight_grad_f32(dy, x) - dw_ref).abs().max()
    err_one = (dw_one_rounding - dw_ref).abs().max()
    assert err_split < err_one / 50, (err_split, err_one)
    dx_ref = dy @ w.float()
    dx_split = input_grad(dy, w, torch.float32)  # no final rounding: fp32 out
    dx_one = dy.bfloat16().float() @ w.float()
    assert (dx_split - dx_ref).abs().max() < (dx_one - dx_ref).abs().max() / 50


def test_other_dtypes_fall_back():
    x, w, _, _ = _case()
    assert router_logits(x, w, None, torch.bfloat16) is None  # router dtype = input dtype
    assert router_logits(x, w, None, torch.float64) is None
    assert router_logits(x.float(), w.float(), None, torch.float32) is None  # fp32 params
    ref = router_logits_reference(x, w, None)
    torch.testing.assert_close(router_logits(x, w, None, torch.float32), ref, rtol=1e-6, atol=1e-6)


def test_leading_dims_kept():
    x, w, _, _ = _case(t=24)
    out = router_logits(x.view(6, 4, -1), w, None, torch.float32)
    assert out.shape == (6, 4, w.shape[0])
