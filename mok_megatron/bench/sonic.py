"""SonicMoE's MoE layer as a ``mok bench layer`` peer, with MoK's weights (no copy of the experts' layout).

SonicMoE (Dao-AILab, ``pip install sonic-moe``; QuACK's CuTe-DSL grouped GEMMs) runs a whole MoE layer:
router GEMM, top-k, the gather fused into the up-projection, varlen-K weight gradients, the combine. Its
functional entry ``moe_TC_softmax_topk_layer`` takes the experts' weights as ``fc1.permute(1, 2, 0)``
(``[2F, H, E]``) and ``fc2.permute(1, 2, 0)`` (``[H, F, E]``); with ``concat_layout=True`` fc1's rows are
``[gate; up]``, MoK's (and Megatron's) layout, so the peer reads MoK's tensors as they are.

Routing: SonicMoE routes softmax over the top-k logits (``is_softmax_over_topk=True``), Megatron's default
``softmax`` score function; its router GEMM runs in the input dtype. The benchmark's forced routing makes
those logits exact in bf16 (``bench.routing``), so all layers route alike. Sigmoid or group-limited routing
has no SonicMoE equivalent: such shapes skip the peer with that reason. Gated activations only (SwiGLU),
bf16, Hopper or Blackwell.

Shape suffix legend: T tokens, H hidden, F expert ffn, E experts.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from mok_megatron.bench.torchtitan import PeerUnavailable


def unavailable(shape: dict, dtype, device) -> str | None:
    """Why SonicMoE cannot run this case here, or None."""
    if importlib.util.find_spec("sonicmoe") is None:
        return "SonicMoE not installed (pip install sonic-moe)"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return "SonicMoE needs a Hopper or Blackwell GPU"
    if dtype != torch.bfloat16:
        return "SonicMoE runs bf16 only"
    if shape.get("score", "softmax") != "softmax" or shape.get("groups"):
        return "SonicMoE routes softmax over the top-k only (this shape's router is sigmoid / group-limited)"
    return None


class SonicMoE(nn.Module):
    """``forward(x_T1H)`` returns ``(out_T1H, None)`` like Megatron's layer; the parameters are copies of
    MoK's router ``[E, H]``, fc1 ``[E, 2F, H]`` and fc2 ``[E, H, F]``."""

    def __init__(self, router_EH, fc1_E2FH, fc2_EHF, topk: int):
        super().__init__()
        try:
            from sonicmoe import moe_TC_softmax_topk_layer
            from sonicmoe.enums import ActivationType
        except ImportError as e:
            try:  # older layout: the enum beside the functional API
                from sonicmoe import ActivationType, moe_TC_softmax_topk_layer
            except ImportError:
                raise PeerUnavailable(f"SonicMoE not importable: {e}") from e
        self._layer, self._act = moe_TC_softmax_topk_layer, ActivationType.SWIGLU
        self.topk = topk
        self.router = nn.Parameter(router_EH.detach().clone())
        self.fc1 = nn.Parameter(fc1_E2FH.detach().clone())
        self.fc2 = nn.Parameter(fc2_EHF.detach().clone())

    def forward(self, x_T1H: torch.Tensor):
        x_TH = x_T1H.reshape(-1, x_T1H.shape[-1])
        out_TH, _logits, _freq = self._layer(
            x_TH,
            self.router,
            self.fc1.permute(1, 2, 0),
            None,
            self.fc2.permute(1, 2, 0),
            None,
            self.topk,
            torch.cuda.current_stream().cuda_stream,
            self._act,
            False,
            is_softmax_over_topk=True,
            concat_layout=True,
        )
        return out_TH.view_as(x_T1H), None
