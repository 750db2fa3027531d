"""A plain-PyTorch MoE layer for ``mok bench layer``: the reference a user could write in an afternoon.

Router as Megatron-Core's default (fp32 logits, top-k of the logits, softmax over the k chosen), a stable
sort of the T*K choices into expert order (permute), the expert SwiGLU MLPs as two grouped GEMMs
(``torch._grouped_mm``; a per-expert loop where that op is missing or refuses the inputs), and an
``index_add_`` of the probability-weighted rows back onto their tokens (combine).

Shape suffix legend: T tokens, H hidden, F expert ffn, E experts, K top-k, R = T*K routed rows.
Weights: ``router_EH`` [E, H]; ``fc1_E2FH`` [E, 2F, H] (gate rows first, then up); ``fc2_EHF`` [E, H, F];
the same layout as MoK's ``fc1_weight`` / ``fc2_weight``, so weights copy in without reshaping.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _grouped_mm_works(*weights_EOI: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these weights (dtype, device, 16-byte strides) on 16 rows."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        for w in weights_EOI:
            offsets_E = torch.full((w.shape[0],), 16, device=w.device, dtype=torch.int32)
            x = torch.zeros(16, w.shape[-1], device=w.device, dtype=w.dtype)
            torch._grouped_mm(x, w.detach().transpose(-2, -1), offs=offsets_E)
        return True
    except (RuntimeError, NotImplementedError):  # torch has no kernel for this dtype/device/stride: loop
        return False


class PlainMoE(nn.Module):
    """Sort-based permute + grouped GEMMs; ``forward(x_T1H)`` returns ``(out_T1H, None)`` like Megatron's."""

    def __init__(self, router_EH: torch.Tensor, fc1_E2FH: torch.Tensor, fc2_EHF: torch.Tensor, topk: int):
        super().__init__()
        experts, hidden = router_EH.shape
        if fc1_E2FH.shape[0] != experts or fc2_EHF.shape[:2] != (experts, hidden):
            raise ValueError(
                f"weights disagree: router {tuple(router_EH.shape)}, fc1 {tuple(fc1_E2FH.shape)}, "
                f"fc2 {tuple(fc2_EHF.shape)} (want [E, H], [E, 2F, H], [E, H, F])"
            )
        if not 1 <= topk <= experts:
            raise ValueError(f"topk={topk} must be between 1 and experts={experts}")
        self.topk = topk
        self.router_EH = nn.Parameter(router_EH.detach().clone())
        self.fc1_E2FH = nn.Parameter(fc1_E2FH.detach().clone())
        self.fc2_EHF = nn.Parameter(fc2_EHF.detach().clone())
        self.grouped = _grouped_mm_works(self.fc1_E2FH, self.fc2_EHF)

    @property
    def gemm(self) -> str:
        return "torch._grouped_mm" if self.grouped else "per-expert loop"

    def _gemm(
        self, x_RI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor, counts: list[int] | None
    ):
        if self.grouped:
            return torch._grouped_mm(x_RI, w_EOI.transpose(-2, -1), offs=offsets_E)
        return torch.cat([xe @ we.t() for xe, we in zip(x_RI.split(counts), w_EOI, strict=True)])

    def forward(self, x_T1H: torch.Tensor):
        x_TH = x_T1H.reshape(-1, x_T1H.shape[-1])
        experts, k = self.router_EH.shape[0], self.topk
        logits_TE = x_TH.float() @ self.router_EH.float().t()
        top_TK, ids_TK = torch.topk(logits_TE, k, dim=-1)
        probs_TK = torch.softmax(top_TK, dim=-1)
        order_R = torch.argsort(ids_TK.reshape(-1), stable=True)
        token_R = order_R // k
        counts_E = torch.bincount(ids_TK.reshape(-1), minlength=experts)
        offsets_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        counts = None if self.grouped else counts_E.tolist()
        h_R2F = self._gemm(x_TH[token_R], self.fc1_E2FH, offsets_E, counts)
        gate_RF, up_RF = h_R2F.chunk(2, dim=-1)
        y_RH = self._gemm(F.silu(gate_RF) * up_RF, self.fc2_EHF, offsets_E, counts)
        y_RH = (y_RH.float() * probs_TK.reshape(-1)[order_R, None]).to(x_TH.dtype)
        out_TH = torch.zeros_like(x_TH).index_add_(0, token_R, y_RH)
        return out_TH.view_as(x_T1H), None
