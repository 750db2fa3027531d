"""The experts' fc1 grouped GEMM reading its rows straight from token order: QuACK's gather-A GEMM (CuTe DSL,
Hopper and later), no permuted copy of the input.

Legend: T tokens (rows of ``x_TH``), H = K input features, M rows of the expert-major layout, N output
features, G groups (local experts); ``idx32_M`` int32 token of each row (every entry in ``[0, T)``);
``cu_G1`` int32 ``[0, *offs_G]`` (QuACK's ``cu_seqlens``).

Three calls, one launch each, no host sync:
    forward      ``y_MN[r] = x_TH[idx[r]] @ w_GNK[g(r)].T``: ``gemm(x_TH, w_GNK.mT, cu_seqlens_m=cu_G1,
                 A_idx=idx32_M)`` (varlen-M, A's rows gathered while loading the tile)
    wgrad        ``dW_GNK[g] = dy_g^T @ x_TH[idx_g]``: ``gemm(x_TH.t(), dy_MN, out=dW_GNK.mT,
                 cu_seqlens_k=cu_G1, A_idx=idx32_M)`` (varlen-K, A's columns gathered: ``x_TH.t()`` is
                 ``[K, T]`` with unit row stride, the M-major A varlen-K needs; QuACK gathers A only, so the
                 result is ``dW^T``, written through the M-major view ``dW_GNK.mT``)
    accumulate_  the same product added into ``out_GNK`` (fp32 ``main_grad``) by QuACK's ``gemm_add_inplace``
The input gradient needs no gather (``dx_MK = dy_MN @ w_g``, then a per-token sum): ``ops.gather_gemm``
runs it on torch's grouped GEMM.

What QuACK takes (quack-kernels 0.4.1; ``supports`` checks it): A and B bf16 or fp16, one dtype
(``GemmSm90.is_valid_dtypes``); ``A_idx`` int32 with a 16-byte aligned start (``make_fake_varlen_args``:
``divisibility=4``); varlen-M needs A K-major and out N-major, varlen-K A M-major and B N-major (asserts in
``quack.gemm.gemm``); every row stride 16-byte aligned (TMA, and 16-byte gather loads). There is no
sentinel index: an entry outside ``[0, T)`` reads out of bounds, so ``ops.gather_gemm`` redirects padding
rows to row 0 and masks them. ``tuned=False`` takes QuACK's default tile config (no autotuning pass on the
first call); its sm90 default (cluster N = 1) is one gather-A accepts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mok_megatron.compat import have_quack, quack_gemm, quack_gemm_add_inplace

_OPERAND_DTYPES = (torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(x_TH: torch.Tensor, w_GNK: torch.Tensor) -> bool:
    """Whether QuACK is installed and its gather-A GEMMs accept ``x_TH`` and ``w_GNK`` on this device."""
    if x_TH.device.type != "cuda" or not have_quack():
        return False
    if torch.cuda.get_device_capability(x_TH.device)[0] < 9:
        return False
    if x_TH.dtype not in _OPERAND_DTYPES or w_GNK.dtype != x_TH.dtype:
        return False
    if not (x_TH.is_contiguous() and w_GNK.is_contiguous()):
        return False
    _, n, k = w_GNK.shape
    item = x_TH.element_size()
    return (k * item) % 16 == 0 and (n * item) % 16 == 0


def cu_seqlens(offs_G: torch.Tensor) -> torch.Tensor:
    """``[0, *offs_G]`` as int32 (QuACK's ``cu_seqlens_m`` / ``cu_seqlens_k``)."""
    return F.pad(offs_G.to(torch.int32), (1, 0))


def index32(idx_M: torch.Tensor) -> torch.Tensor:
    """``idx_M`` as the int32 ``A_idx`` QuACK loads (contiguous, 16-byte aligned start)."""
    idx = idx_M.to(torch.int32).contiguous()
    return idx if idx.data_ptr() % 16 == 0 else idx.clone()


def forward(
    x_TH: torch.Tensor, idx32_M: torch.Tensor, w_GNK: torch.Tensor, cu_G1: torch.Tensor
) -> torch.Tensor:
    """``y_MN`` in x's dtype; the caller checks ``supports``."""
    return quack_gemm()(x_TH, w_GNK.mT, cu_seqlens_m=cu_G1, A_idx=idx32_M, tuned=False)


def wgrad(
    dy_MN: torch.Tensor, x_TH: torch.Tensor, idx32_M: torch.Tensor, cu_G1: torch.Tensor
) -> torch.Tensor:
    """``dW_GNK`` (a new tensor in dy's dtype, contiguous); a group without rows gets zeros."""
    g, n, k = cu_G1.shape[0] - 1, dy_MN.shape[1], x_TH.shape[1]
    dw_GNK = torch.empty((g, n, k), dtype=dy_MN.dtype, device=dy_MN.device)
    quack_gemm()(x_TH.t(), dy_MN, out=dw_GNK.mT, cu_seqlens_k=cu_G1, A_idx=idx32_M, tuned=False)
    return dw_GNK


def accumulate_(
    out_GNK: torch.Tensor, dy_MN: torch.Tensor, x_TH: torch.Tensor, idx32_M: torch.Tensor, cu_G1: torch.Tensor
) -> None:
    """``out_GNK[g] += dy_g^T @ x_TH[idx_g]`` (fp32 accumulator added in ``out``'s dtype, one launch)."""
    if out_GNK.dtype not in _OUT_DTYPES or not out_GNK.is_contiguous():
        raise ValueError(
            f"quack_gather.accumulate_: out is {out_GNK.dtype}, contiguous={out_GNK.is_contiguous()}; it must be "
            "a contiguous fp32, bf16 or fp16 [G, N, K] tensor (a param.main_grad)."
        )
    quack_gemm_add_inplace()(x_TH.t(), dy_MN, out_GNK.mT, cu_seqlens_k=cu_G1, A_idx=idx32_M, tuned=False)
