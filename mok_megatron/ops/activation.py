"""Expert activations: the ones Megatron-Core's experts support, with and without a gated linear unit.

Legend:
    M  rows (routed tokens)
    F  expert FFN width on this rank (``moe_ffn_hidden_size / expert_tensor_parallel_size``)

With a GLU the fc1 output ``h_M2F`` holds ``[gate | up]`` halves (Megatron's layout) and the result is
``act(min(gate, c)) * (clamp(up, -c, c) + offset)``; without one it is ``act(h_MF)``. The router
probability of each row is applied after the activation, before fc2, in the activation's dtype
rounding exactly as Megatron's experts do.

On CUDA with Triton the plain SwiGLU (SILU, gated, no clamp, no linear offset, no interleave) runs as the
fused kernel ``mok_megatron.kernels.swiglu.swiglu``: one pass forward (activation and probability scaling,
fp32 math rounded once, so bf16 results may differ from Megatron's two roundings by one ulp), one pass
backward (gate, up and probability gradients), and only ``h`` and the probabilities saved for backward.
Every other spec, and every CPU tensor, runs the torch code below (exact CPU parity with Megatron;
under ``TRITON_INTERPRET=1`` CPU tensors take the kernel too, see ``ops.fast``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mok_megatron.ops.fast import triton_path


class Activation(enum.Enum):
    SILU = "silu"
    GELU = "gelu"
    QUICK_GELU = "quick_gelu"
    RELU = "relu"
    SQUARED_RELU = "squared_relu"


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _squared_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.pow(F.relu(x), 2)


_FUNCS = {
    Activation.SILU: F.silu,
    Activation.GELU: F.gelu,
    Activation.QUICK_GELU: _quick_gelu,
    Activation.RELU: F.relu,
    Activation.SQUARED_RELU: _squared_relu,
}


def activation_from_callable(fn) -> Activation | None:
    """Map a Megatron ``config.activation_func`` to an ``Activation``; None if we do not support it."""
    from megatron.core.activations import squared_relu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    table = {
        F.silu: Activation.SILU,
        F.gelu: Activation.GELU,
        quick_gelu: Activation.QUICK_GELU,
        F.relu: Activation.RELU,
        squared_relu: Activation.SQUARED_RELU,
    }
    return table.get(fn)


@dataclass(frozen=True)
class ActivationSpec:
    """What the experts apply between fc1 and fc2."""

    kind: Activation
    gated: bool
    clamp: float | None = None  # activation_func_clamp_value (GLU only)
    glu_linear_offset: float = 0.0  # added to the linear half of a GLU
    glu_interleave: int | None = None  # moe_mlp_glu_interleave_size: fc1 rows interleaved in blocks

    def fc1_multiplier(self) -> int:
        return 2 if self.gated else 1


def _deinterleave(h_M2F: torch.Tensor, block: int) -> torch.Tensor:
    m, two_f = h_M2F.shape
    return h_M2F.reshape(m, two_f // (2 * block), 2, block).transpose(1, 2).reshape(m, two_f)


def fused_swiglu_applies(spec: ActivationSpec, h: torch.Tensor) -> bool:
    """Whether ``apply_activation`` runs the fused Triton SwiGLU for this spec and tensor."""
    plain = spec.kind is Activation.SILU and spec.gated and spec.clamp is None
    if not (plain and spec.glu_linear_offset == 0.0 and spec.glu_interleave is None):
        return False
    return triton_path(h, "swiglu")


def apply_activation(
    h: torch.Tensor, spec: ActivationSpec, probs_M: torch.Tensor | None, live_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """``act(h) * probs`` (probs may be None). Input ``[M, 2F]`` (gated) or ``[M, F]``; output ``[M, F]``.
    ``live_rows``: rows at and past it are padding no GEMM reads; the fused kernel skips them
    (``kernels.swiglu``), other paths compute them."""
    if fused_swiglu_applies(spec, h):
        from mok_megatron.kernels.swiglu import swiglu

        return swiglu(h, probs_M, live_rows=live_rows)
    fn = _FUNCS[spec.kind]
    if spec.gated:
        if spec.glu_interleave is not None:
            h = _deinterleave(h, spec.glu_interleave)
        gate, up = torch.chunk(h, 2, dim=-1)
        if spec.clamp is not None:
            gate = gate.clamp(min=None, max=spec.clamp)
            up = up.clamp(min=-spec.clamp, max=spec.clamp)
        if spec.glu_linear_offset:
            up = up + spec.glu_linear_offset
        out = fn(gate) * up  # (adding a zero offset would be an extra [M, F] pass; x + 0.0 == x)
    else:
        out = fn(h)
    if probs_M is not None:
        dtype = out.dtype
        out = (out * probs_M.unsqueeze(-1)).to(dtype)
    return out
