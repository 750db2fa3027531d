"""Grouped expert GEMM over rows gathered from token order: ``grouped_linear(x_TH[idx_M], w_GNK, offs_G)``
without requiring the permuted copy ``x_TH[idx_M]`` (the experts' fc1 reading the layer input directly).

Legend (shape suffixes):
    T  tokens (rows of the layer input)       M  rows of the expert-major layout (grouped by expert)
    K  input features (H for fc1)              N  output features (2F for a gated fc1)
    G  groups (local experts)                  k  slots per token (rows one token feeds)

``idx_M[r]`` is the token row ``r`` reads; ``offs_G`` the inclusive row offsets (``offs_G[-1] == M``).
Every non-negative entry must be below T (not checked: that would read the index back). A negative
``idx_M[r]`` marks a padding row (an aligned layout's filler): its output row is zero and it adds nothing to
either gradient (kernels read row 0 for it; the output and the incoming gradient rows are masked, one pass
each, only where the slot map leaves rows unlisted, i.e. where padding can occur).

Backward:
    dx_TH  ``dx_MK = dy_MN @ w_g`` per group (torch's grouped GEMM), then each token's rows summed through the
           slot map (``ops.permute.combine_tokens``: a gather in fixed slot order accumulated in fp32, no
           atomics), so the result is bitwise the same run to run on every device. An ``index_add_`` would
           be atomic on CUDA and order-dependent; it is the reference's way only.
    dW     ``dW_g = dy_g^T @ x_TH[idx_g]``: on QuACK one varlen-K GEMM reading the gathered rows through the
           index (``kernels.quack_gather.wgrad``); on the portable path the rows are gathered again, then
           torch's grouped GEMM.
``slots`` is the map from tokens to their rows (``ops.routing.SlotMap``, e.g. the dispatch plan's). Rows no
slot lists must be padding rows. Without it the op builds one from ``idx_M`` (one host read of the most rows
any token feeds): pass the plan's to stay free of host syncs.

Paths, chosen once per call from the tensors (``use_quack``: None picks, False forces portable, True requires):
    QuACK     ``kernels.quack_gather`` forward and wgrad (CUDA sm90+, bf16/fp16, 16-byte aligned rows,
              ``pip install 'mok-megatron[quack]'``): no ``[M, K]`` gathered copy in forward or backward
    portable  ``x_TH.index_select(0, idx)`` then ``ops.grouped_gemm``'s kernels (the reference for QuACK),
              or per-group matmuls where torch's kernel cannot run (fp64, unaligned rows; one host read)
``gathered_grouped_linear_reference`` is the plain-torch definition the tests hold both paths against.
"""

from __future__ import annotations

import torch

from mok_megatron.kernels import quack_gather
from mok_megatron.ops import grouped_gemm as gg
from mok_megatron.ops.permute import combine_tokens
from mok_megatron.ops.routing import SlotMap, slot_map


def _counts(offs_G: torch.Tensor) -> list[int]:
    return torch.diff(offs_G.long(), prepend=offs_G.new_zeros(1, dtype=torch.long)).tolist()


def _portable_fwd(x_MK, w_GNK, offs_G):
    if gg.kernel_supports(x_MK, w_GNK):
        return gg._fwd(x_MK, w_GNK, offs_G)
    outs = [x_g @ w_GNK[g].t() for g, x_g in enumerate(torch.split(x_MK, _counts(offs_G)))]
    return torch.cat(outs) if outs else x_MK.new_zeros((0, w_GNK.shape[1]))


def _portable_dgrad(dy_MN, w_GNK, offs_G):
    if gg.kernel_supports(dy_MN.new_empty((0, w_GNK.shape[2])), w_GNK):
        return gg._dgrad(dy_MN, w_GNK, offs_G)
    outs = [dy_g @ w_GNK[g] for g, dy_g in enumerate(torch.split(dy_MN, _counts(offs_G)))]
    return torch.cat(outs) if outs else dy_MN.new_zeros((0, w_GNK.shape[2]))


def _portable_wgrad(dy_MN, x_MK, w_GNK, offs_G):
    if gg.kernel_supports(x_MK, w_GNK):
        return gg._wgrad(dy_MN, x_MK, offs_G)
    dw = torch.zeros_like(w_GNK)
    parts = zip(torch.split(dy_MN, _counts(offs_G)), torch.split(x_MK, _counts(offs_G)), strict=True)
    for g, (dy_g, x_g) in enumerate(parts):
        dw[g] = dy_g.t() @ x_g
    return dw


class _GatheredLinear(torch.autograd.Function):
    # The SlotMap rides on ctx (not saved tensors) so that its cached int32 row map is built once per map.
    @staticmethod
    def forward(ctx, x_TH, w_GNK, read_M, pad_M, offs_G, slots, quack):
        ctx.slots, ctx.quack = slots, quack
        ctx.save_for_backward(x_TH, w_GNK, read_M, pad_M, offs_G)
        if read_M.shape[0] == 0 or x_TH.shape[0] == 0:  # no rows, or only padding rows
            return x_TH.new_zeros((read_M.shape[0], w_GNK.shape[1]))
        if quack:
            y_MN = quack_gather.forward(x_TH, read_M, w_GNK, quack_gather.cu_seqlens(offs_G))
        else:
            y_MN = _portable_fwd(x_TH.index_select(0, read_M), w_GNK, offs_G)
        return y_MN if pad_M is None else y_MN.masked_fill_(pad_M[:, None], 0)

    @staticmethod
    def backward(ctx, dy_MN):
        x_TH, w_GNK, read_M, pad_M, offs_G = ctx.saved_tensors
        if read_M.shape[0] == 0 or x_TH.shape[0] == 0:
            return torch.zeros_like(x_TH), torch.zeros_like(w_GNK), None, None, None, None, None
        dy_MN = dy_MN.contiguous() if pad_M is None else dy_MN.masked_fill(pad_M[:, None], 0)
        dx_TH = dw_GNK = None
        if ctx.needs_input_grad[0]:
            dx_TH = combine_tokens(_portable_dgrad(dy_MN, w_GNK, offs_G), ctx.slots)
        if ctx.needs_input_grad[1]:
            if ctx.quack:
                dw_GNK = quack_gather.wgrad(dy_MN, x_TH, read_M, quack_gather.cu_seqlens(offs_G))
            else:
                dw_GNK = _portable_wgrad(dy_MN, x_TH.index_select(0, read_M), w_GNK, offs_G)
        return dx_TH, dw_GNK, None, None, None, None, None


def slots_from_index(idx_M: torch.Tensor, num_tokens: int) -> SlotMap:
    """Each token's rows (ascending row order) from ``idx_M`` (negative: padding rows, listed nowhere).
    One host read: the most rows any token feeds."""
    live_M = idx_M >= 0
    tok_M = idx_M.clamp(min=0).long()
    counts_T = torch.bincount(tok_M[live_M], minlength=num_tokens)
    k = int(counts_T.max()) if num_tokens else 0
    if k and bool(live_M.all()) and bool((counts_T == k).all()):
        return slot_map(tok_M, None, num_tokens, k)  # every token feeds k rows: the dense map
    return slot_map(tok_M, live_M, num_tokens, k)


def _may_pad(slots: SlotMap, num_rows: int) -> bool:
    """False only where every row is some slot's (a dense map over exactly the M rows): no padding row."""
    return slots.valid_TK is not None or slots.row_TK.numel() != num_rows


def _check(x_TH, idx_M, w_GNK, offs_G, slots) -> None:
    if x_TH.dim() != 2 or w_GNK.dim() != 3 or x_TH.shape[1] != w_GNK.shape[2]:
        raise ValueError(
            f"gathered_grouped_linear: x {tuple(x_TH.shape)} and w {tuple(w_GNK.shape)} do not fit; "
            "expected x [T, K] and w [G, N, K]."
        )
    if idx_M.dim() != 1 or idx_M.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"gathered_grouped_linear: idx is {idx_M.dtype} {tuple(idx_M.shape)}; expected [M] int32/int64 "
            "(the token of each row, negative for a padding row)."
        )
    if offs_G.shape != (w_GNK.shape[0],):
        raise ValueError(
            f"gathered_grouped_linear: offs has shape {tuple(offs_G.shape)}, expected ({w_GNK.shape[0]},) "
            "(one inclusive row offset per group)."
        )
    if x_TH.dtype != w_GNK.dtype:
        raise ValueError(
            f"gathered_grouped_linear: x is {x_TH.dtype} and w is {w_GNK.dtype}; cast one first."
        )
    if slots is not None and slots.row_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(
            f"gathered_grouped_linear: slots cover {slots.row_TK.shape[0]} tokens, x has {x_TH.shape[0]}; "
            "pass the slot map of these tokens' rows."
        )


def gathered_grouped_linear(
    x_TH: torch.Tensor,
    idx_M: torch.Tensor,
    w_GNK: torch.Tensor,
    offs_G: torch.Tensor,
    slots: SlotMap | None = None,
    *,
    use_quack: bool | None = None,
) -> torch.Tensor:
    """``y_MN[r] = x_TH[idx_M[r]] @ w_GNK[g].T`` for the rows ``r`` of group ``g``; zero for padding rows.

    Inputs: x_TH [T, K] and w_GNK [G, N, K] in one dtype; idx_M [M] int32/int64 (negative: padding);
    offs_G [G] int inclusive row offsets on x's device (offs_G[-1] == M); slots: the tokens' rows (see the
    module docstring). Output: y_MN [M, N] in x's dtype. Differentiable in x and w."""
    _check(x_TH, idx_M, w_GNK, offs_G, slots)
    num_rows = idx_M.shape[0]
    if slots is None:
        slots = slots_from_index(idx_M, x_TH.shape[0])
    pad_M = (idx_M < 0) if _may_pad(slots, num_rows) else None
    read_M = idx_M.clamp(min=0)  # a padding row reads row 0 (and is masked); no kernel reads out of bounds
    x_TH = x_TH.contiguous()
    quack = quack_gather.supports(x_TH, w_GNK) if use_quack is not False else False
    if use_quack and not quack:
        raise ValueError(
            f"gathered_grouped_linear: use_quack=True, but QuACK cannot run here (device {x_TH.device}, "
            f"{x_TH.dtype}, K={x_TH.shape[1]}, N={w_GNK.shape[1]}); it needs CUDA sm90+, bf16/fp16, "
            "16-byte aligned rows and pip install 'mok-megatron[quack]'."
        )
    read_M = quack_gather.index32(read_M) if quack else read_M
    return _GatheredLinear.apply(x_TH, w_GNK, read_M, pad_M, offs_G.to(torch.int32), slots, quack)


def gathered_grouped_linear_reference(
    x_TH: torch.Tensor, idx_M: torch.Tensor, w_GNK: torch.Tensor, counts: list[int]
) -> torch.Tensor:
    """Plain torch: padding rows read zeros, then ``grouped_linear_reference`` (autograd through torch)."""
    keep_M1 = (idx_M >= 0).unsqueeze(1).to(x_TH.dtype)
    x_MK = x_TH.index_select(0, idx_M.clamp(min=0)) * keep_M1
    return gg.grouped_linear_reference(x_MK, w_GNK, counts)
