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

Why for the experts: see ``ops.wgrad_accumulate`` (one full-size bf16 sum per extra minibatch saved,
plus the separate add into ``main_grad``).
"""

from __future__ import annotations

import torch

from mok_megatron.compat import current_graph_task_id


def main_grad_owner(weight: torch.nn.Parameter, fusion: bool) -> torch.nn.Parameter | None:
    """``weight`` when its gradient accumulates into ``weight.main_grad`` (fusion on and a ``main_grad``
    present, decided per forward as Megatron's linears do), else None."""
    return weight if fusion and hasattr(weight, "main_grad") else None


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
