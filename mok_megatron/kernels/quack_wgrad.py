"""The experts' weight gradient accumulated in place by QuACK's varlen-K GEMM (CuTe DSL, Hopper and later).

Legend: M rows (grouped by local expert), N output features, K input features, G groups (local experts).

``accumulate_(out_GNK, dy_MN, x_MK, offs_G)``: ``out_GNK[g] += dy_g^T @ x_g`` for the rows of group ``g``,
one launch for every group: QuACK's ``gemm_add_inplace`` with ``A = dy_MN.t()`` (``[N, M]``, M the ragged
reduction dimension), ``B = x_MK`` and ``cu_seqlens_k = [0, *offs_G]``. The products accumulate in fp32
and are added to ``out`` in its own dtype by the epilogue (a TMA reduce-add store), so an fp32
``main_grad`` receives the unrounded sum: no bf16 weight-gradient tensor is ever made. A group without
rows gets its accumulator zeroed and adds nothing.

Operands QuACK takes (``quack.gemm_sm90.GemmSm90.is_valid_dtypes`` in quack-kernels 0.4.1): A and B in
bf16 or fp16 (same dtype; fp32 operands are not accepted), out in fp32, bf16 or fp16. Varlen-K needs A
M-major and B N-major, i.e. ``dy_MN`` and ``x_MK`` with unit column stride, and TMA needs every row
stride 16-byte aligned. ``supports`` checks exactly these; elsewhere ``ops.wgrad_accumulate`` runs its
portable path, which is this kernel's reference (``tests/test_wgrad_accumulation.py`` holds them
against each other on a GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mok_megatron.compat import have_quack, quack_gemm_add_inplace

_OPERAND_DTYPES = (torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(out_GNK: torch.Tensor, dy_MN: torch.Tensor, x_MK: torch.Tensor) -> bool:
    """Whether QuACK is installed and its varlen-K GEMM accepts these tensors on this device."""
    if dy_MN.device.type != "cuda" or not have_quack():
        return False
    if torch.cuda.get_device_capability(dy_MN.device)[0] < 9:
        return False
    if dy_MN.dtype not in _OPERAND_DTYPES or x_MK.dtype != dy_MN.dtype or out_GNK.dtype not in _OUT_DTYPES:
        return False
    if not (dy_MN.is_contiguous() and x_MK.is_contiguous() and out_GNK.is_contiguous()):
        return False
    n, k = dy_MN.shape[1], x_MK.shape[1]
    return (
        (n * dy_MN.element_size()) % 16 == 0
        and (k * x_MK.element_size()) % 16 == 0
        and (k * out_GNK.element_size()) % 16 == 0
    )


def accumulate_(out_GNK: torch.Tensor, dy_MN: torch.Tensor, x_MK: torch.Tensor, offs_G: torch.Tensor) -> None:
    """``out_GNK[g] += dy_MN[rows of g].T @ x_MK[rows of g]`` in one QuACK launch; no host sync.
    The caller checks ``supports`` and the shapes (``ops.wgrad_accumulate.grouped_wgrad_accumulate_``)."""
    cu_seqlens = F.pad(offs_G.to(torch.int32), (1, 0))  # [G + 1]: 0, then the inclusive offsets
    quack_gemm_add_inplace()(dy_MN.t(), x_MK, out_GNK, cu_seqlens_k=cu_seqlens, tuned=False)
