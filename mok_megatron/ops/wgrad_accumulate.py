"""The experts' weight gradient accumulated in place: ``out_GNK[g] += dy_g^T @ x_g`` per local expert.

Legend (shape suffixes): M rows (grouped by local expert), N output features of the GEMM, K input
features, G groups (local experts); ``offs_G`` int32 inclusive row offsets (as in ``ops.grouped_gemm``).

Why: Megatron's ``gradient_accumulation_fusion`` (its default) has every linear add its weight gradient
straight into the fp32 ``param.main_grad`` (beta = 1) instead of returning a gradient tensor, which
saves the fresh bf16 ``[G, N, K]`` gradient and DDP's hook adding it into ``main_grad``.
``experts.torch_mlp`` calls this op when the fusion is on. Measured on an H200 (``benchmarks/wgrad.py``): one
QuACK call into fp32 costs 3.86 ms against torch's bf16 GEMM's 3.80 on a DeepSeek-V3 EP slice, 2.57
against 1.86 on Qwen3-30B-A3B (its fp32 output moves twice the bytes); the add it saves was not timed.
Several calls into one accumulator each read and write all of it (4 calls: 5.30 and 8.05 ms), so a layer
call's weight gradient is best one call over all its rows (the late-wgrad gate's merged GEMM).

``grouped_wgrad_accumulate_`` chooses once per call, from the tensors alone (no host sync):
    QuACK  ``kernels.quack_wgrad``: one varlen-K GEMM whose epilogue adds the fp32 accumulator into
           ``out`` (CUDA sm90+, bf16/fp16 operands, QuACK installed: ``pip install 'mok-megatron[quack]'``)
    torch  the portable path: ``out += ops.grouped_gemm._wgrad(dy, x, offs)`` (torch's grouped GEMM in the
           operands' dtype), or the per-expert loop where that kernel cannot run (fp64, strides not
           16-byte aligned, CUDA before sm80; one host read of the offsets). It is the QuACK path's
           reference; the two differ by the rounding of the product to the operand dtype before the add.
"""

from __future__ import annotations

import torch

from mok_megatron.kernels import quack_wgrad
from mok_megatron.ops import grouped_gemm as gg


def _check(out_GNK, dy_MN, x_MK, offs_G) -> None:
    if dy_MN.dim() != 2 or x_MK.dim() != 2 or out_GNK.dim() != 3 or dy_MN.shape[0] != x_MK.shape[0]:
        raise ValueError(
            f"grouped_wgrad_accumulate_: dy {tuple(dy_MN.shape)}, x {tuple(x_MK.shape)} and out "
            f"{tuple(out_GNK.shape)} do not fit; expected dy [M, N], x [M, K] and out [G, N, K]."
        )
    g, n, k = out_GNK.shape
    if (n, k) != (dy_MN.shape[1], x_MK.shape[1]) or offs_G.shape != (g,):
        raise ValueError(
            f"grouped_wgrad_accumulate_: out {tuple(out_GNK.shape)} needs dy [M, {n}], x [M, {k}] and offs "
            f"({g},); got dy {tuple(dy_MN.shape)}, x {tuple(x_MK.shape)}, offs {tuple(offs_G.shape)}."
        )
    if dy_MN.dtype != x_MK.dtype:
        raise ValueError(
            f"grouped_wgrad_accumulate_: dy is {dy_MN.dtype} and x is {x_MK.dtype}; they must share a dtype "
            "(cast one before the call)."
        )
    if not out_GNK.is_floating_point():
        raise ValueError(f"grouped_wgrad_accumulate_: out is {out_GNK.dtype}; it must be a floating dtype")


def portable_accumulate_(out_GNK, dy_MN, x_MK, offs_G) -> None:
    """``out += grouped wgrad`` through torch: the grouped GEMM where it runs, else the per-expert loop."""
    if x_MK.shape[0] == 0:
        return
    w_like = torch.empty(out_GNK.shape, dtype=x_MK.dtype, device="meta")  # what kernel_supports reads
    if gg.kernel_supports(x_MK, w_like):
        out_GNK.add_(gg._wgrad(dy_MN, x_MK, offs_G))
        return
    counts = torch.diff(offs_G.long(), prepend=offs_G.new_zeros(1, dtype=torch.long)).tolist()
    rows = sum(counts)  # rows past the last offset (a sync-free buffer's) belong to no group
    dy_g_rows, x_g_rows = torch.split(dy_MN[:rows], counts), torch.split(x_MK[:rows], counts)
    for g, (dy_g, x_g) in enumerate(zip(dy_g_rows, x_g_rows, strict=True)):
        if dy_g.shape[0]:
            out_GNK[g].add_(dy_g.t() @ x_g)


def grouped_wgrad_accumulate_(
    out_GNK: torch.Tensor,
    dy_MN: torch.Tensor,
    x_MK: torch.Tensor,
    offs_G: torch.Tensor,
    *,
    use_quack: bool | None = None,
) -> torch.Tensor:
    """``out_GNK[g] += dy_MN[rows of g].T @ x_MK[rows of g]`` in place; returns ``out_GNK``.

    Inputs: out_GNK [G, N, K] (fp32 ``main_grad``, or bf16/fp16), dy_MN [M, N] and x_MK [M, K] in one
    dtype (bf16, fp16 or fp32), offs_G [G] int32 inclusive row offsets on their device (offs_G[-1] <= M: rows past it, as in a sync-free
    receive buffer, belong to no group and add nothing).
    Groups without rows add nothing. ``use_quack``: None picks QuACK where ``kernels.quack_wgrad.supports``
    says it runs, False forces the portable path, True requires QuACK (raises where it cannot run)."""
    _check(out_GNK, dy_MN, x_MK, offs_G)
    dy_MN, x_MK = dy_MN.contiguous(), x_MK.contiguous()
    quack = quack_wgrad.supports(out_GNK, dy_MN, x_MK) if use_quack is not False else False
    if use_quack and not quack:
        raise ValueError(
            f"grouped_wgrad_accumulate_: use_quack=True, but QuACK cannot run here (device {dy_MN.device}, "
            f"operands {dy_MN.dtype}, out {out_GNK.dtype}, N={dy_MN.shape[1]}, K={x_MK.shape[1]}); it needs "
            "CUDA sm90+, bf16/fp16 operands, 16-byte aligned rows and pip install 'mok-megatron[quack]'."
        )
    with torch.no_grad():  # a gradient sink, not a differentiable op (backward_dw runs with grad mode on)
        if quack:
            quack_wgrad.accumulate_(out_GNK, dy_MN, x_MK, offs_G)
        else:
            portable_accumulate_(out_GNK, dy_MN, x_MK, offs_G)
    return out_GNK
