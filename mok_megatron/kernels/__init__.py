"""Triton kernels for the MoE layer's memory-bound steps, each beside its pure-torch reference.

Legend (all kernel modules):
    T  tokens            K  routes per token (router top-k)     E  experts
    H  hidden size       F  expert FFN width                    M  rows of the expert MLP
    R  rows of the expert-major (permuted) buffer, padding included

Modules:
    routing  top-k ids [T, K] -> counts, offsets, aligned offsets, each route's row (no host sync)
    permute  token rows (+ probabilities) -> expert-major rows; optional fused cast; zero padding rows
    combine  expert rows -> per-token (optionally probability-weighted) sum, deterministic, with backward
    swiglu   fused SwiGLU forward/backward on fc1's [gate | up] output, optionally times a per-row prob
    fp8_quant    e4m3 rowwise / per-(expert, column) transposed quantization (the native FP8 GEMMs' operands)
    fp8_quant_reference  the e4m3 quantizers in pure torch (rowwise, 1x128 blockwise, per segment): the
                 references of fp8_quant and fp8_permute, and the FP8 exchange's row packing
    fp8_permute  the permute with rowwise e4m3 quantization fused in (each token quantized once)
    topk     the router's top-k selection, one pass per row (ties to the lower index)
    link_delay   the loopback transport's emulated link time: a one-warp wall-clock spin (GPU only)
    tile_gemm    a grouped GEMM whose row tiles wait on arrival counters (QuACK's sm_90 kernel, CuTe DSL;
                 kernel in tile_gemm_sm90), its tile orders, counter targets and torch references; its
                 epilogue optionally releases per-row-tile done counters
    tile_pull    the dispatch that feeds it: K persistent programs pull (source, expert) chunks expert-major
                 into the receive buffer and release each row tile's counter; its plan and torch reference
    tile_combine the combine driven by tile_gemm's done counters: each token summed once its rows are stored,
                 bitwise the combine's sum

Every public op takes ``impl``: ``Impl.AUTO`` runs Triton on CUDA tensors when Triton is installed and the
torch reference otherwise; ``Impl.TRITON`` / ``Impl.TORCH`` force one (the tests hold them against each other).
Triton kernels also run on CPU tensors under Triton's interpreter, which is chosen when the kernels are
defined: ``TRITON_INTERPRET=1`` must be set before this package is imported.
"""

from __future__ import annotations

import enum
import os

import torch

from mok_megatron.compat import fix_triton_interpreter_index, have_triton

if have_triton():
    import triton
    import triton.language as tl

    jit = triton.jit
else:  # the references still work; ``Impl.TRITON`` raises
    triton = tl = None

    def jit(fn):
        return fn


# Decided once, like triton.jit decides it: kernels defined now run interpreted iff this is set.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
if INTERPRETED and have_triton():
    fix_triton_interpreter_index()


class Impl(enum.Enum):
    AUTO = "auto"  # Triton on CUDA tensors when Triton is installed, else the torch reference
    TRITON = "triton"  # always Triton (CPU tensors need TRITON_INTERPRET=1)
    TORCH = "torch"  # always the pure-torch reference


def use_triton(impl: Impl, x: torch.Tensor, op: str) -> bool:
    """Whether ``op`` runs its Triton kernel for tensors on ``x``'s device; raises when ``impl`` cannot be met."""
    if not isinstance(impl, Impl):
        raise TypeError(f"{op}: impl={impl!r} is not a mok_megatron.kernels.Impl (AUTO, TRITON or TORCH)")
    if impl is Impl.TORCH:
        return False
    runnable = x.device.type == "cuda" or (INTERPRETED and x.device.type == "cpu")
    if impl is Impl.AUTO:
        return have_triton() and runnable
    if not have_triton():
        raise RuntimeError(f"{op}: impl=Impl.TRITON but Triton is not installed; pip install triton")
    if not runnable:
        raise ValueError(
            f"{op}: impl=Impl.TRITON with tensors on {x.device}; Triton runs on CUDA, or on CPU only when "
            "TRITON_INTERPRET=1 is set before mok_megatron.kernels is imported"
        )
    return True


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
