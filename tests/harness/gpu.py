"""What the GPU tests share: which kernels this GPU can run, and one MoE layer's steps and errors.

needs_sm90_quack          skip mark: an sm_90 GPU with quack-kernels 0.4.x (the tile kernels' GEMM)
watched(args, env, hang)  ``python args`` in a subprocess that must print "ok" last within GPU_TIMEOUT_S: a
                          waiting kernel whose releaser never runs spins forever, and the test then fails
layer_steps(...)          ``steps`` forward + backward passes under the config's quantization context:
                          (output, input gradient, expert weight gradients in MoK's layout), fp32;
                          ``grads`` reads the gradients by parameter name (default: ``.grad`` as is)
rel(a, b)                 relative Frobenius error of ``a`` against ``b``
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent.parent
GPU_TIMEOUT_S = 300  # QuACK compiles its kernels once (tens of seconds each); a hang ends here
# a subprocess's NCCL group and symmetric memory create no NVLink multicast objects
MULTICAST_OFF = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")


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


def watched(args: list, env: dict, hang: str) -> None:
    """``python args`` in a subprocess under the watchdog: it must end within GPU_TIMEOUT_S printing "ok"
    last; past the limit the test fails with ``hang``."""
    try:
        r = subprocess.run(
            [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=GPU_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{hang} after {GPU_TIMEOUT_S} s")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


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
