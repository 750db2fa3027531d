"""Grouped expert GEMM (forward, dgrad, wgrad) on ``torch.nn.functional.grouped_mm``.

Legend (shape suffixes):
    M  rows (tokens routed to this rank's local experts, grouped by expert)
    K  input features of the GEMM
    N  output features of the GEMM
    G  groups (local experts)

Row block ``g`` of ``x_MK`` (rows ``offs_G[g-1]:offs_G[g]``) is multiplied by ``w_GNK[g].T``.
Weights are stored like ``torch.nn.Linear`` weights, ``[out, in]`` per expert, so a MoK weight slice
``w_GNK[g]`` is byte-for-byte Megatron's ``linear_fc*.weight`` of expert ``g``.

``grouped_linear`` is the autograd op used by the experts. It takes the device offsets (no host
sync). ``grouped_linear_reference`` is the plain per-expert loop it must agree with; it is also the
fallback where torch's kernel cannot run (fp64, strides not 16-byte aligned, pre-Hopper CUDA).
"""

from __future__ import annotations

import torch

from mok_megatron.compat import grouped_mm_fn

_GMM = grouped_mm_fn()
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_supports(x_MK: torch.Tensor, w_GNK: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM kernel accepts these operands on this device."""
    if x_MK.dtype not in _KERNEL_DTYPES or w_GNK.dtype != x_MK.dtype:
        return False
    if x_MK.device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(x_MK.device)
        if major < 8:
            return False
    elif x_MK.device.type != "cpu":
        return False
    # Every row stride must be a multiple of 16 bytes (K and N in elements * itemsize).
    item = x_MK.element_size()
    _, n, k = w_GNK.shape
    return (k * item) % 16 == 0 and (n * item) % 16 == 0


def offsets_from_counts(tokens_per_expert_G: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Inclusive cumulative row offsets ``[G]`` (int32, on ``device``) as the kernel wants them."""
    return torch.cumsum(tokens_per_expert_G.to(device=device), 0, dtype=torch.int32)  # one launch


def _fwd(x_MK, w_GNK, offs_G):
    return _GMM(x_MK, w_GNK.transpose(-2, -1), offs=offs_G)


def _dgrad(dy_MN, w_GNK, offs_G):
    return _GMM(dy_MN, w_GNK, offs=offs_G)


def _wgrad(dy_MN, x_MK, offs_G):
    # [N, M] x [M, K] -> [G, N, K]; dy_MN.t() is a view with unit row stride, which the kernel takes.
    return _GMM(dy_MN.t(), x_MK, offs=offs_G)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_GNK, offs_G):
        ctx.save_for_backward(x_MK, w_GNK, offs_G)
        if x_MK.shape[0] == 0:
            return x_MK.new_zeros((0, w_GNK.shape[1]))
        return _fwd(x_MK, w_GNK, offs_G)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_GNK, offs_G = ctx.saved_tensors
        if x_MK.shape[0] == 0:
            return x_MK.new_zeros(x_MK.shape), torch.zeros_like(w_GNK), None
        dy_MN = dy_MN.contiguous()
        dx_MK = _dgrad(dy_MN, w_GNK, offs_G) if ctx.needs_input_grad[0] else None
        # Experts without rows get exact zeros from the kernel (checked on CPU and sm_90 by the tests),
        # so no masking pass over dW (which cost ~0.7 ms per GEMM on the Qwen3-30B-A3B shape).
        dw_GNK = _wgrad(dy_MN, x_MK, offs_G) if ctx.needs_input_grad[1] else None
        return dx_MK, dw_GNK, None


def grouped_linear(x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """``y_MN[rows of g] = x_MK[rows of g] @ w_GNK[g].T`` with autograd; no host synchronisation.

    Inputs:  x_MK  [M, K] (fp32/bf16/fp16), w_GNK [G, N, K] same dtype, offs_G [G] int32 inclusive
             row offsets on x's device with offs_G[-1] == M.
    Outputs: y_MN  [M, N], x's dtype.
    Falls back to ``grouped_linear_reference`` (one host read of the offsets) where the kernel cannot
    run.
    """
    if x_MK.dim() != 2 or w_GNK.dim() != 3 or x_MK.shape[1] != w_GNK.shape[2]:
        raise ValueError(
            f"grouped_linear: x {tuple(x_MK.shape)} and w {tuple(w_GNK.shape)} do not fit; "
            "expected x [M, K] and w [G, N, K]."
        )
    if offs_G.shape != (w_GNK.shape[0],):
        raise ValueError(
            f"grouped_linear: offs has shape {tuple(offs_G.shape)}, expected ({w_GNK.shape[0]},) "
            "(one inclusive offset per expert)."
        )
    if not kernel_supports(x_MK, w_GNK):
        counts = torch.diff(offs_G.long(), prepend=offs_G.new_zeros(1, dtype=torch.long))
        return grouped_linear_reference(x_MK, w_GNK, counts.tolist())
    return _GroupedLinear.apply(x_MK.contiguous(), w_GNK, offs_G.to(torch.int32))


def grouped_linear_reference(x_MK: torch.Tensor, w_GNK: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Pure-torch reference: one ``x_g @ w_g.T`` per group, concatenated (autograd through torch)."""
    if sum(counts) != x_MK.shape[0]:
        raise ValueError(f"grouped_linear_reference: counts sum to {sum(counts)}, x has {x_MK.shape[0]} rows")
    outs = []
    for g, x_g in enumerate(torch.split(x_MK, counts)):
        outs.append(x_g @ w_GNK[g].t())
    if not outs:
        return x_MK.new_zeros((0, w_GNK.shape[1]))
    return torch.cat(outs, 0)


def concat_groups(
    parts: list[tuple[list[torch.Tensor], torch.Tensor]],
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Several grouped operand sets as one, grouped across the parts: no host synchronisation.

    ``parts``: ``[(tensors, offs_G), ...]``, each part's tensors ``[M_p, *]`` sharing its rows, grouped by
    ``offs_G`` (inclusive int offsets, the same G in every part; rows past ``offs_G[-1]``, as in a sync-free
    receive buffer, belong to no group). Returns one tensor per position, ``[sum M_p, *]``, whose group
    ``g`` holds every part's rows of ``g`` (part order, then row order) and whose rows past the last group
    are the parts' group-less rows, and the int32 inclusive offsets of those groups. One grouped GEMM over
    the result equals the sum of the parts' grouped GEMMs up to the order of the additions."""
    if not parts:
        raise ValueError("concat_groups: no parts")
    num_groups = parts[0][1].shape[0]
    if any(offs.shape != (num_groups,) for _, offs in parts):
        raise ValueError(
            f"concat_groups: offsets of shapes {[tuple(o.shape) for _, o in parts]}; every part needs "
            f"({num_groups},) (one inclusive offset per group)."
        )
    device = parts[0][0][0].device
    ends_PG = torch.stack([offs.to(device=device, dtype=torch.int64) for _, offs in parts])
    counts_PG = torch.diff(ends_PG, dim=1, prepend=ends_PG.new_zeros(len(parts), 1))
    totals_G = counts_PG.sum(0)
    new_ends_G = torch.cumsum(totals_G, 0)
    earlier_PG = torch.cumsum(counts_PG, 0) - counts_PG  # rows of each group in the parts before
    # destination row of part p's group-g rows: new start of g + rows of g in earlier parts - g's start in p
    shift_PG = (new_ends_G - totals_G) + earlier_PG - (ends_PG - counts_PG)
    # group-less rows (past a part's last offset) go after every group, part after part
    sizes_P = torch.stack([ends_PG.new_full((), ts[0].shape[0]) for ts, _ in parts])  # no host-to-device copy
    spare_P = sizes_P - ends_PG[:, -1]
    tail_P = new_ends_G[-1] + torch.cumsum(spare_P, 0) - spare_P
    shift_PG = torch.cat([shift_PG, (tail_P - ends_PG[:, -1])[:, None]], 1)  # column G: group-less rows
    # Where each row of cat(parts) goes, inverted into the cat row each output row reads: one row gather
    # per operand (on an H200 8-10 % faster than scattering each part's rows with index_copy_).
    dests = []
    for p, (tensors, _) in enumerate(parts):
        r = torch.arange(tensors[0].shape[0], device=device)
        g = torch.searchsorted(ends_PG[p], r, right=True)
        dests.append(r + shift_PG[p][g])
    dest_R = torch.cat(dests)
    src_R = torch.empty_like(dest_R).index_copy_(0, dest_R, torch.arange(dest_R.shape[0], device=device))
    outs = []
    for i in range(len(parts[0][0])):
        ts = [tensors[i] for tensors, _ in parts]
        outs.append((torch.cat(ts) if len(ts) > 1 else ts[0]).index_select(0, src_R))
    return outs, new_ends_G.to(torch.int32)
