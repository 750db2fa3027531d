"""Router top-k selection: the K largest scores of each token's row, in one pass over [T, E].

``topk_indices(scores_TE, k)`` returns ``idx_TK`` (int64): each row's K largest entries, largest first.
Only the selection: the probabilities are computed by Megatron's own ``topk_routing_with_score_function``
at these indices (``precomputed_indices``), so the values and gradients are Megatron's.

Tie rule: equal scores are taken in ascending expert index, as a stable descending sort orders them
(all-equal scores pick experts 0..K-1). NaN ranks above every number, +inf included, as in ``torch.topk``
and ``torch.sort``: a NaN score is selected first, so it reaches the probabilities, the layer output and
the loss exactly as in Megatron's router (whose NaN check then stops the run) instead of being routed
around. NaNs count as equal to each other (ascending index among them). ``torch.topk`` leaves the order
of equal values unspecified, and it differs between devices (all-equal rows, K = 2: experts [42, 43] of
64 on CPU with torch 2.14, [5, 6] on an H200; NaNs at experts 0, 2, 5 of 8 with K = 1: expert 2 on CPU).
So:

* distinct scores: the selection (set and order) is exactly ``torch.topk``'s;
* a tie at the K-th place (the K-th and (K+1)-th largest scores equal, or both NaN): the set may differ
  from ``torch.topk``'s on any device; MoK's holds the lower indices. Ties inside the top K change no
  set: a row with at most K NaNs selects all of them, as ``torch.topk`` does.

Such ties come from rounding. Router inputs x [512, 1024] ~ N(0, 1) and weights [64, 1024] ~ N(0, 0.02^2),
both bf16, top-8, five seeds: fp32 logits (``moe_router_dtype='fp32'``) had no tie at the 8th place
(smallest gap between the 8th and 9th logit 2.9e-5; fp32 summation-order error <= 5e-7), bf16 logits
(no ``moe_router_dtype``) had 9 to 23 tokens of 512 tied there.

Why a kernel: ``torch.topk`` over [16384, 128] fp32 with K = 8 is ~0.1 ms on an H200
(``sbtopk::gatherTopK``), and Megatron's router calls it twice per step (routing and the aux-loss map).
This kernel loads each row once and takes K arg-max passes in registers.

    topk_indices_reference   stable descending sort, first K columns (pure torch)
    topk_indices             the Triton kernel (``Impl.AUTO``: CUDA with Triton, else the reference)
"""

from __future__ import annotations

import torch

from mok_megatron.kernels import Impl, jit, next_pow2, tl, triton, use_triton


# Launch defaults: few elements per program, few warps (one H200,
# docs/results/2026-12-01-kernels/topk-gemm-layout: at [16384, 128] 2 rows x 2 warps took 36 us per call incl.
# launch vs 47 us for 64 rows x 4 warps; at [65536, 256] 1 row x 1 warp 97 us, torch.topk 844 us).
_BLOCK_T, _BLOCK_ELEMS = 64, 256


def _num_warps(block_e: int) -> int:
    return 1 if block_e >= 256 else 2


def topk_indices_reference(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    # The kernel's int32 keys (below), sorted stably: the same order on every device. (A float sort is not:
    # CUDA's radix sort ranks a NaN with its sign bit set below -inf and -0.0 below +0.0.)
    s_TE = scores_TE.float()
    s_TE = torch.where(s_TE == 0.0, 0.0, s_TE)
    bits_TE = s_TE.view(torch.int32)
    key_TE = torch.where(s_TE.isnan(), 0x7FFFFFFF, bits_TE ^ ((bits_TE >> 31) & 0x7FFFFFFF))
    return torch.sort(key_TE, dim=1, descending=True, stable=True).indices[:, :k].contiguous()


@jit
def _topk_kernel(
    s_ptr, idx_ptr, T, E, stride_t, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    mask = row_ok[:, None] & col_ok[None, :]
    s = tl.load(s_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    # torch.topk's order as int32 keys: the float's bits with the magnitude bits of negatives flipped order
    # like the floats (-0.0 made +0.0, equal as floats), and every NaN (either sign) the largest key, above
    # +inf. Columns past E (and already taken ones) hold the smallest key, below -inf's: they never win.
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(s != s, 0x7FFFFFFF, bits ^ ((bits >> 31) & 0x7FFFFFFF))
    live = mask
    for j in tl.static_range(K):
        cand = tl.where(live, key, -0x80000000)
        best = tl.max(cand, axis=1)
        hit = live & (cand == best[:, None])
        pick = tl.min(tl.where(hit, cols[None, :], BLOCK_E), axis=1)
        tl.store(idx_ptr + rows.to(tl.int64) * K + j, pick.to(tl.int64), mask=row_ok)
        live = live & (cols[None, :] != pick[:, None])


def topk_indices(
    scores_TE: torch.Tensor,
    k: int,
    impl: Impl = Impl.AUTO,
    *,
    block_t: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """``[T, K]`` int64 indices of each row's K largest scores (largest first; equal scores in ascending
    index, so all-equal rows give 0..K-1; NaN highest, as in ``torch.topk``).
    ``block_t`` (rows per program) and ``num_warps`` are tuning knobs (the defaults above, as measured)."""
    if scores_TE.dim() != 2:
        raise ValueError(f"topk_indices: scores must be [T, E], got shape {tuple(scores_TE.shape)}")
    t, e = scores_TE.shape
    if not 1 <= k <= e:
        raise ValueError(f"topk_indices: k={k} must be in [1, E={e}]")
    if not use_triton(impl, scores_TE, "topk_indices"):
        return topk_indices_reference(scores_TE, k)
    s = scores_TE if scores_TE.stride(1) == 1 else scores_TE.contiguous()
    idx = torch.empty(t, k, dtype=torch.int64, device=s.device)
    if t == 0:
        return idx
    block_e = next_pow2(e)
    block_t = block_t or max(1, min(_BLOCK_T, _BLOCK_ELEMS // block_e))
    _topk_kernel[(triton.cdiv(t, block_t),)](
        s,
        idx,
        t,
        e,
        s.stride(0),
        K=k,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        num_warps=num_warps or _num_warps(block_e),
    )
    return idx
