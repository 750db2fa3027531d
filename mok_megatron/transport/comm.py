"""Collectives with autograd for the dispatch/combine path (any torch.distributed backend).

Split sizes are Python ints taken from the frozen plan: the collectives themselves never read the
device. Every op is the identity on a group of one.

Legend: R rows received, S rows sent, H hidden.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _a2a(x_SH: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group) -> torch.Tensor:
    x_SH = x_SH.contiguous()
    out = x_SH.new_empty((sum(out_splits),) + tuple(x_SH.shape[1:]))
    dist.all_to_all_single(out, x_SH, list(out_splits), list(in_splits), group=group)
    return out


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SH, out_splits, in_splits, group):
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        return _a2a(x_SH, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, d_RH):
        out_splits, in_splits = ctx.splits
        return _a2a(d_RH, in_splits, out_splits, ctx.group), None, None, None


def all_to_all_v(
    x_SH: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group
) -> torch.Tensor:
    """Rows ``in_splits[j]`` go to rank j; ``out_splits[j]`` rows come from rank j (rank order)."""
    if group_size(group) == 1:
        return x_SH
    return _AllToAllV.apply(x_SH, tuple(out_splits), tuple(in_splits), group)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))], 0)


def _all_gather_v(x: torch.Tensor, splits: Sequence[int], group) -> torch.Tensor:
    # Uneven sizes are padded to the largest: gloo's allgather only takes equal sizes.
    x = x.contiguous()
    width = max(splits)
    out = x.new_empty((width * len(splits),) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, _pad_rows(x, width), group=group)
    if len(set(splits)) == 1:
        return out
    return torch.cat([out[r * width : r * width + n] for r, n in enumerate(splits)], 0)


def _reduce_scatter_v(x: torch.Tensor, splits: Sequence[int], group) -> torch.Tensor:
    x = x.contiguous()
    rank = dist.get_rank(group)
    width = max(splits)
    if len(set(splits)) != 1:
        x = torch.cat([_pad_rows(c, width) for c in torch.split(x, list(splits), 0)], 0)
    out = x.new_empty((width,) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=group)
    return out[: splits[rank]]


class _AllGatherV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, splits, group):
        ctx.splits, ctx.group = splits, group
        return _all_gather_v(x, splits, group)

    @staticmethod
    def backward(ctx, d):
        return _reduce_scatter_v(d, ctx.splits, ctx.group), None, None


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, splits, group):
        ctx.splits, ctx.group = splits, group
        return _reduce_scatter_v(x, splits, group)

    @staticmethod
    def backward(ctx, d):
        return _all_gather_v(d, ctx.splits, ctx.group), None, None


def all_gather_v(x: torch.Tensor, splits: Sequence[int], group) -> torch.Tensor:
    """Concatenate every rank's rows (rank j contributes ``splits[j]``); backward reduce-scatters."""
    if group_size(group) == 1:
        return x
    return _AllGatherV.apply(x, tuple(splits), group)


def reduce_scatter_v(x: torch.Tensor, splits: Sequence[int], group) -> torch.Tensor:
    """Sum over ranks, then keep this rank's ``splits[rank]`` rows; backward all-gathers."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterV.apply(x, tuple(splits), group)
