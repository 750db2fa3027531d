"""What the GPU tests share: which kernels this GPU can run, and one MoE layer's steps and errors.

needs_sm90_quack          skip mark: an sm_90 GPU with quack-kernels 0.4.x (the tile kernels' GEMM)
layer_steps(...)          ``steps`` forward + backward passes under the config's quantization context:
                          (output, input gradient, expert weight gradients in MoK's layout), fp32;
                          ``grads`` reads the gradients by parameter name (default: ``.grad`` as is)
rel(a, b)                 relative Frobenius error of ``a`` against ``b``
"""

from __future__ import annotations

import pytest
import torch


def sm90_with_quack() -> bool:
    """An sm_90 GPU and a QuACK that the waiting GEMM can be built on."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        return False
    try:
        from mok_megatron.compat import require_quack_tile_gemm

        require_quack_tile_gemm()
    except ImportError:
        return False
    return True


needs_sm90_quack = pytest.mark.skipif(
    not sm90_with_quack(), reason="needs an sm_90 GPU and quack-kernels 0.4.x"
)


def expert_grads(layer) -> dict:
    """The experts' weight gradients by parameter name, fp32."""
    return {n: p.grad.float() for n, p in layer.named_parameters() if p.grad is not None and "experts" in n}


def layer_steps(layer, cfg, x, dout, steps: int, grads=expert_grads):
    from mok_megatron.compat import quantization_context
    from mok_megatron.experts.checkpoint import convert_state_dict

    for _ in range(steps):
        layer.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        with quantization_context(cfg):
            out, _ = layer(xi)
        out.backward(dout)
    return out.detach().float(), xi.grad.float(), convert_state_dict(grads(layer), "mok")


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
