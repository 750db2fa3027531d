"""What every expert backend shares: probabilities applied on the input, and per-expert row padding.

Legend: R real rows (expert-major, as the dispatcher delivers them), P rows of the padded buffer, H
hidden, F1 fc1 rows (2F with a GLU), F FFN width, L local experts, A alignment.

``scale_input``: Megatron's ``moe_apply_probs_on_input`` (top-1 routing): each row is scaled by its
probability before fc1, in the rows' dtype, and the MLP then runs with probabilities 1.

``padded_expert_mlp``: FP8 grouped GEMMs need every expert's row count to be a multiple of A
(``experts.backend.expert_alignment``). The rows are scattered once into a zeroed ``[P, H]`` buffer by
the device-side plan of ``ops.align``, the probabilities the same way (padding rows get probability 0, so
their activation output is 0 and they add nothing to any gradient), fc1 -> activation * probs -> fc2 run on
the padded buffer, and the real rows are gathered back. The scatter / gather are autograd ops
(index_copy / index_select), so backward is exact. A backend may fuse the padding into its GEMMs
(``fc1_pads`` / ``fc2_unpads``: the native FP8 backend, ``experts.fp8_mlp``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mok_megatron.ops.activation import ActivationSpec, apply_activation
from mok_megatron.ops.align import PadPlan, pad_plan, pad_rows, unpad_rows

# fc(x_PK, plan) -> y_PN
GemmFn = Callable[[torch.Tensor, PadPlan], torch.Tensor]


def scale_input(x_RH: torch.Tensor, probs_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities on the input (Megatron's ``moe_apply_probs_on_input``): ``(probs * x, ones)``, the
    product rounded to x's dtype as Megatron's experts see it."""
    return (probs_R.unsqueeze(-1) * x_RH).to(x_RH.dtype), torch.ones_like(probs_R)


def pad_probs(probs_R: torch.Tensor, plan: PadPlan) -> torch.Tensor:
    """``[R]`` probabilities -> ``[P]``, 0 on padding rows (differentiable)."""
    return probs_R.new_zeros(plan.num_rows).index_copy(0, plan.dest_R, probs_R)


def padded_expert_mlp(
    x_RH: torch.Tensor,
    probs_R: torch.Tensor,
    counts_L: torch.Tensor,
    fc1: GemmFn,
    fc2: GemmFn,
    act: ActivationSpec,
    alignment: int,
    *,
    apply_probs_on_input: bool = False,
    num_rows: int | None = None,
    fc1_pads: bool = False,
    fc2_unpads: bool = False,
) -> torch.Tensor:
    """``fc2(act(fc1(x)) * probs)`` per expert with every expert's rows padded to ``alignment``.

    ``counts_L``: rows per local expert (device or host tensor; summing to R, not read back).
    ``num_rows``: P (default: the static bound; TE passes the exact padded total it needs).
    ``fc1_pads``: fc1 takes the R real rows and writes the padded layout itself (``fc1(x_RH, plan) ->
    h_PF1``; the native path quantizes straight into it), so no bf16 padded copy of x is built.
    ``fc2_unpads``: fc2 returns the R real rows itself (``fc2(a_PF, plan) -> y_RH``; the native path's
    backward quantizes their gradient straight into the padded layout)."""
    if x_RH.shape[0] != probs_R.shape[0]:
        raise ValueError(f"padded_expert_mlp: {x_RH.shape[0]} rows but {probs_R.shape[0]} probabilities")
    counts_L = counts_L.to(device=x_RH.device)
    if apply_probs_on_input:
        x_RH, probs_R = scale_input(x_RH, probs_R)
    plan = pad_plan(counts_L, alignment, x_RH.shape[0], num_rows)
    probs_P = pad_probs(probs_R, plan)
    h_PF1 = fc1(x_RH.contiguous(), plan) if fc1_pads else fc1(pad_rows(x_RH.contiguous(), plan), plan)
    a_PF = apply_activation(h_PF1, act, probs_P)
    return fc2(a_PF, plan) if fc2_unpads else unpad_rows(fc2(a_PF, plan), plan)
