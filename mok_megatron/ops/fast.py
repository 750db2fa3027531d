"""When the layer's ops take their Triton kernels (``mok_megatron.kernels``) instead of the torch code.

On CUDA tensors when Triton is installed; on CPU tensors only under Triton's interpreter
(``TRITON_INTERPRET=1`` set before the kernels are imported, as the CPU tests do), so that the wired kernel
paths are testable without a GPU. A plain CPU run never imports Triton and keeps the torch code (the
exact CPU parity with Megatron's layer).
"""

from __future__ import annotations

import os

import torch


def triton_path(t: torch.Tensor, op: str) -> bool:
    """Whether ``op`` on tensors like ``t`` runs its Triton kernel (``Impl.AUTO``'s rule)."""
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    from mok_megatron.compat import have_triton

    if not have_triton():
        return False
    from mok_megatron.kernels import Impl, use_triton

    return use_triton(Impl.AUTO, t, op)
