"""One layer call's expert weights cut into groups of local experts: the weights of a pipeline split by
experts (``engine.pipeline_plan``, ``--mok-minibatch-split experts``).

Legend: L local experts, C groups, ``bounds`` ``(0, e1, ..., L)``: group c holds experts ``[e_c, e_c+1)``.

Each minibatch's expert call uses only its group's slice of each weight. Slicing each weight once per
call (``w[lo:hi]``) would give C autograd nodes, each of whose backward writes a zero-filled full-size
gradient, and autograd would then sum C full-size tensors per weight: the weight-gradient sums the
split exists to avoid. Here one node (``_GroupViews``) makes every group's view of every weight, and its
backward concatenates the groups' gradients into the weight's one gradient (a group whose call got no
gradient contributes zeros).

With gradient accumulation fusion each group's weight-gradient GEMM adds into its slice of the
Parameter's ``main_grad`` (``experts.torch_mlp.expert_mlp(..., main_grad_range=...)``) and returns no
gradient; the node then hands autograd Megatron's dummy once per weight (``experts.main_grad``).
"""

from __future__ import annotations

import torch

from mok_megatron.experts.main_grad import fused_wgrad_result


class ExpertGroups:
    """``weights(c)``: group c's view of each weight (made by one autograd node per layer call);
    ``experts(c)``: its local experts ``(lo, hi)``. ``owners``: per weight, the Parameter whose
    ``main_grad`` the groups' GEMMs accumulate into (gradient accumulation fusion), or None."""

    def __init__(
        self,
        params: tuple[torch.Tensor, ...],
        bounds: tuple[int, ...],
        owners: tuple[torch.nn.Parameter | None, ...],
    ):
        if bounds[0] != 0 or bounds[-1] != params[0].shape[0] or list(bounds) != sorted(bounds):
            raise ValueError(
                f"ExpertGroups: bounds {bounds} must rise from 0 to the {params[0].shape[0]} local experts"
            )
        self.bounds = bounds
        self.owners = owners
        views = _GroupViews.apply(bounds, owners, *params)
        C = len(bounds) - 1
        self._views = [views[i * C : (i + 1) * C] for i in range(len(params))]

    def experts(self, c: int) -> tuple[int, int]:
        return self.bounds[c], self.bounds[c + 1]

    def weights(self, c: int) -> tuple[torch.Tensor, ...]:
        return tuple(v[c] for v in self._views)


class _GroupViews(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bounds, owners, *params):
        ctx.set_materialize_grads(False)
        ctx.bounds, ctx.owners = bounds, owners
        ctx.shapes = [(p.shape, p.dtype, p.device) for p in params]
        return tuple(
            p.narrow(0, lo, hi - lo) for p in params for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
        )

    @staticmethod
    def backward(ctx, *grads):
        C = len(ctx.bounds) - 1
        out = []
        for i, (shape, dtype, device) in enumerate(ctx.shapes):
            parts = grads[i * C : (i + 1) * C]
            owner = ctx.owners[i]
            if all(g is None for g in parts):
                # Fusion: every group added its gradient into main_grad; else no group got a gradient.
                out.append(fused_wgrad_result(owner) if owner is not None else None)
                continue
            if owner is not None:
                raise RuntimeError(
                    f"ExpertGroups: weight of shape {tuple(shape)} has gradients both accumulated into "
                    "main_grad and returned by its groups; attach main_grad before the forward."
                )
            full = [
                g if g is not None else torch.zeros((hi - lo, *shape[1:]), dtype=dtype, device=device)
                for g, lo, hi in zip(parts, ctx.bounds[:-1], ctx.bounds[1:], strict=True)
            ]
            out.append(torch.cat(full, 0))
        return (None, None, *out)
