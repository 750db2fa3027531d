"""A floor for ``mok bench layer``: the layer's six expert GEMMs alone, timed like the layers.

Legend:
    R  routed rows (tokens x top-k), grouped by expert with the case's rows per expert
    H  hidden size;  F  expert FFN size (fc1 is 2F wide: gate and up)
    E  experts

Any MoE layer whose experts run on ``torch._grouped_mm`` does at least these GEMMs (MoK, plain PyTorch and
torchtitan do; Megatron+TE's ``TEGroupedMLP`` uses cuBLAS instead), so their time is what routing,
permute, activation, combine and the host add to. The GEMMs are exactly MoK's calls
(``ops.grouped_gemm``): forward fc1 ``x_RH @ w1_E(2F)H^T`` and fc2 ``a_RF @ w2_EHF^T``; backward the two
dgrads and the two wgrads. Inputs are random with the case's rows per expert; timing as the layers
(``bench_timing.time_phases``: fwd, bwd, fwd+bwd synced, back to back), on CPU too (tiny shapes in tests).
"""

from __future__ import annotations

from mok_megatron.bench.timing import time_phases


def gemm_bound(shape: dict, expert_rows: list[int], dtype, device, iters: int, warmup: int) -> dict:
    """{phase: {"ms", "min_ms"}} for the six expert GEMMs of one fwd+bwd at ``expert_rows`` per expert."""
    return time_phases(*gemm_steps(shape, expert_rows, dtype, device), lambda: None, iters, warmup)


def gemm_steps(shape: dict, expert_rows: list[int], dtype, device):
    """(forward, backward) closures over random operands (made here, on ``device``) for ``time_phases``."""
    import torch

    from mok_megatron.ops.grouped_gemm import _dgrad, _fwd, _wgrad

    e, h, f = shape["experts"], shape["hidden"], shape["ffn"]
    if len(expert_rows) != e:
        raise ValueError(f"gemm_bound: {len(expert_rows)} row counts for {e} experts; pass one per expert")
    rows = sum(expert_rows)
    offs_E = torch.tensor(expert_rows, device=device).cumsum(0).to(torch.int32)
    g = torch.Generator(device=device).manual_seed(3)

    def rand(*size):
        return (torch.randn(*size, generator=g, device=device) * 0.1).to(dtype)

    x_RH, a_RF, dy_RH, dh_R2F = rand(rows, h), rand(rows, f), rand(rows, h), rand(rows, 2 * f)
    w1_E2FH, w2_EHF = rand(e, 2 * f, h), rand(e, h, f)

    def forward():
        _fwd(x_RH, w1_E2FH, offs_E)
        _fwd(a_RF, w2_EHF, offs_E)

    def backward(_):
        _dgrad(dy_RH, w2_EHF, offs_E)
        _wgrad(dy_RH, a_RF, offs_E)
        _dgrad(dh_R2F, w1_E2FH, offs_E)
        _wgrad(dh_R2F, x_RH, offs_E)

    return forward, backward
