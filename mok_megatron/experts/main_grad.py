"""Megatron's ``gradient_accumulation_fusion`` contract for the experts' weights.

With ``config.gradient_accumulation_fusion`` (Megatron's default; ``--no-gradient-accumulation-fusion``
turns it off) and a weight that has ``main_grad`` (Megatron's DDP gives every parameter an fp32 view into
its gradient buffer), a layer adds its weight gradient straight into ``weight.main_grad`` and hands
autograd a dummy gradient instead of the real one, as
``megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication.backward`` does:

    where the weight has ``grad_added_to_main_grad`` (DDP sets it False on every parameter and at every
    ``zero_grad_buffer``): the weight gradient returned is a dummy of the weight's shape and dtype
    (``torch.zeros`` when ``weight.zero_out_wgrad``, else ``torch.empty``), and
    ``grad_added_to_main_grad = True`` tells DDP's backward post-hook not to add ``param.grad`` into
    ``main_grad`` again (it adds it only when ``zero_out_wgrad``, which is why that dummy is zeros); the
    hook then drops ``param.grad``. The dummy keeps ``param.grad`` non-None when the hook runs, which
    the hook asserts under ``overlap_grad_reduce``.
    without it: no gradient (None).

One dummy per weight per backward pass: where one backward reaches a weight through several GEMMs (the
overlap pipeline's expert call per minibatch), the later ones return None, so autograd has no dummies to
sum before the weight's ``AccumulateGrad`` (which, with its hooks, still runs once).

Why for the experts, and what it costs: see ``ops.wgrad_accumulate``.
"""

from __future__ import annotations

import torch

from mok_megatron.compat import current_graph_task_id


def has_accumulating_gemm(weight: torch.nn.Parameter) -> bool:
    """Whether ``weight``'s device has a GEMM that accumulates into ``main_grad`` in its epilogue: QuACK's
    varlen-K GEMM on CUDA sm90+ for bf16/fp16 weights (``kernels.quack_wgrad``), or the CPU, where the
    portable path (GEMM, then add) is the contract's reference and costs what DDP's add costs.

    A CUDA device without QuACK keeps ordinary gradients: there the portable path adds every expert
    call's gradient into fp32 separately, and on an H200 (DeepSeek-V3 EP slice, 4 calls of 1,024 tokens,
    ``benchmarks/wgrad.py``) that took 9.28 ms against 5.63 ms for bf16 sums of the same GEMMs."""
    if weight.device.type == "cpu":
        return True
    from mok_megatron.compat import have_quack

    return (
        weight.device.type == "cuda"
        and weight.dtype in (torch.bfloat16, torch.float16)
        and torch.cuda.get_device_capability(weight.device)[0] >= 9
        and have_quack()
    )


def main_grad_owner(weight: torch.nn.Parameter, fusion: bool) -> torch.nn.Parameter | None:
    """``weight`` when its gradient accumulates into ``weight.main_grad`` (fusion on, a ``main_grad``
    present, decided per forward as Megatron's linears do, and an accumulating GEMM for its device:
    ``has_accumulating_gemm``), else None (ordinary gradients, which DDP's hook adds)."""
    if not (fusion and hasattr(weight, "main_grad")):
        return None
    if hasattr(weight, "__fsdp_param__"):
        # Megatron-FSDP makes a parameter's main_grad in backward (``get_main_grad()``), not before the
        # forward that would capture it here: such weights keep ordinary gradients, which FSDP reduces.
        return None
    return weight if has_accumulating_gemm(weight) else None


def fused_wgrad_result(owner: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient a layer returns for ``owner`` after adding the real one into ``owner.main_grad``:
    Megatron's dummy (and ``grad_added_to_main_grad = True``), or None where DDP does not track it."""
    if not hasattr(owner, "grad_added_to_main_grad"):
        return None
    task = current_graph_task_id()
    if task >= 0 and getattr(owner, "_mok_dummy_for_backward", None) == task:
        return None  # this backward already handed autograd a dummy for it
    owner._mok_dummy_for_backward = task
    make = torch.zeros if getattr(owner, "zero_out_wgrad", False) else torch.empty
    dummy = make(owner.shape, dtype=owner.dtype, device=owner.device)
    owner.grad_added_to_main_grad = True
    return dummy
