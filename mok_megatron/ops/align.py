"""Per-expert row padding for a recipe's grouped-GEMM alignment, on the device, without a host sync.

Legend: E experts, R rows of the unpadded expert-major buffer (real rows), P rows of the padded buffer
(a static bound: ``kernels.routing.num_rows_bound``), H hidden, A alignment.

Two entry points, one layout:
- From top-k ids: ``kernels.routing.routing_metadata(topk_idx_TK, E, alignment=A)`` already gives the
  padded layout (``row_TK`` is the padded row of each route, ``aligned_offsets_E`` the GEMM's ``offs``);
  ``plan_from_topk`` wraps it -- no second implementation.
- From per-expert counts of rows that are already expert-major (what the overlap engine's exchange
  delivers: ``SendPlan.tokens_per_expert_L``): ``pad_plan(counts_E, A, num_rows)`` says where each real
  row goes; ``pad_rows`` scatters them into a zeroed ``[P, H]`` buffer (padding rows stay zero, so they
  add nothing to a wgrad and produce rows nobody reads), ``unpad_rows`` gathers them back.

How it plugs in: the FP8 expert backends (``experts.common``, ``experts.fp8_mlp``; alignment from ``experts.backend``) build
``pad_plan`` from the experts' device counts and scatter the expert-major rows once into the padded
buffer (one device pass, no host read). Not done yet: fusing that scatter into the dispatcher's permute
(``row_TK`` as the permute's slot map), which would remove the pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mok_megatron.kernels.routing import RoutingMeta, num_rows_bound, routing_metadata


def _check_alignment(alignment: int) -> None:
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(
            f"alignment={alignment!r}: expected an int >= 1 (1 = no padding; FP8 recipes use 16/32/128)"
        )


def padded_offsets(counts_E: torch.Tensor, alignment: int) -> torch.Tensor:
    """Inclusive cumulative per-expert counts, each rounded up to ``alignment`` (int32, same device).

    Identical to ``RoutingMeta.aligned_offsets_E`` for the same counts; an empty expert gets 0 rows."""
    _check_alignment(alignment)
    if counts_E.dim() != 1 or counts_E.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"padded_offsets: counts has shape {tuple(counts_E.shape)} dtype {counts_E.dtype}; expected [E] int32/int64"
        )
    counts_E = counts_E.long()
    return ((counts_E + alignment - 1) // alignment * alignment).cumsum(0).to(torch.int32)


@dataclass(frozen=True)
class PadPlan:
    """Where the R real expert-major rows go in the padded buffer.

    dest_R             padded row of each real row (int64)
    offsets_E          inclusive cumulative real counts (int32)
    aligned_offsets_E  inclusive cumulative padded counts (int32): the grouped GEMM's ``offs``
    num_rows           P, rows to allocate (static bound; rows past ``aligned_offsets_E[-1]`` are spare)
    """

    dest_R: torch.Tensor
    offsets_E: torch.Tensor
    aligned_offsets_E: torch.Tensor
    num_rows: int
    alignment: int

    def __post_init__(self):
        if self.dest_R.dim() != 1:
            raise ValueError(f"PadPlan: dest has shape {tuple(self.dest_R.shape)}, expected [R]")
        if self.num_rows < self.dest_R.shape[0]:
            raise ValueError(f"PadPlan: num_rows={self.num_rows} < {self.dest_R.shape[0]} real rows")


def pad_plan(counts_E: torch.Tensor, alignment: int, real_rows: int, num_rows: int | None = None) -> PadPlan:
    """Plan for ``real_rows`` (R, a host int the caller knows: ``SendPlan.rows_M``; must equal
    ``counts_E.sum()``, which is not read back) expert-major rows. ``num_rows`` (P) defaults to the static
    bound ``num_rows_bound(R, E, A)``. No host synchronisation."""
    aligned_offsets_E = padded_offsets(counts_E, alignment)
    counts_E = counts_E.long()
    offsets_E = counts_E.cumsum(0)
    num_experts = counts_E.shape[0]
    if real_rows < 0:
        raise ValueError(f"pad_plan: real_rows={real_rows}, expected >= 0")
    if num_rows is None:
        num_rows = num_rows_bound(real_rows, num_experts, alignment)
    row_R = torch.arange(real_rows, device=counts_E.device)
    expert_R = torch.searchsorted(offsets_E, row_R, right=True)
    # padded start - real start of each expert = (aligned_offsets - aligned) - (offsets - counts)
    aligned_E = torch.diff(aligned_offsets_E.long(), prepend=aligned_offsets_E.new_zeros(1).long())
    shift_E = (aligned_offsets_E.long() - aligned_E) - (offsets_E - counts_E)
    dest_R = row_R + shift_E[expert_R] if num_experts else row_R
    return PadPlan(dest_R, offsets_E.to(torch.int32), aligned_offsets_E, num_rows, alignment)


def plan_from_topk(topk_idx_TK: torch.Tensor, num_experts: int, alignment: int) -> RoutingMeta:
    """Padded permute plan straight from the router's top-k ids (``kernels.routing``; dropped ids get -1)."""
    _check_alignment(alignment)
    return routing_metadata(topk_idx_TK, num_experts, alignment=alignment)


def pad_rows(x_RH: torch.Tensor, plan: PadPlan) -> torch.Tensor:
    """``[R, H]`` expert-major rows -> ``[P, H]`` padded buffer, padding rows zero."""
    if x_RH.dim() != 2 or x_RH.shape[0] != plan.dest_R.shape[0]:
        raise ValueError(f"pad_rows: x has shape {tuple(x_RH.shape)}, expected [{plan.dest_R.shape[0]}, H]")
    out_PH = x_RH.new_zeros(plan.num_rows, x_RH.shape[1])
    return out_PH.index_copy_(0, plan.dest_R, x_RH)


def unpad_rows(y_PH: torch.Tensor, plan: PadPlan) -> torch.Tensor:
    """Inverse of ``pad_rows``: the real rows, in expert-major order."""
    if y_PH.dim() != 2 or y_PH.shape[0] != plan.num_rows:
        raise ValueError(f"unpad_rows: y has shape {tuple(y_PH.shape)}, expected [{plan.num_rows}, H]")
    return y_PH.index_select(0, plan.dest_R)
