"""A combine driven by completion: fc2's waiting GEMM (``kernels.tile_gemm``, given done counters) releases
each row tile's done slot as its column tiles are stored, and this combine, running beside it on the SMs
the GEMM leaves free, sums a token's rows as soon as every row block holding them is complete.

Legend: T tokens, K routes per token, H hidden, R rows of the expert-major buffer (fc2's output), S counter
slots (the waiting GEMM's row tiles, ``tile_gemm.slot_capacity``), P programs (the SMs held back).

    out_TH[t] = sum_k p[t, k] * y_RH[row_TK[t, k]]       (the sum of ``kernels.combine``, bit for bit)

Each of P programs visits token blocks ``pid, pid + P, ...`` of a visiting order ``order_T`` (identity, or
``token_order``: the order their rows are expected to complete), spins with an acquire atomic until
``done_S[slot_TK[t, k]] >= done_target_S[slot]`` for every live route of the block, then sums each token's
K rows in k order in fp32 and rounds once: the same arithmetic as ``kernels.combine`` (its
``_gather_sum_kernel``), so the output is bitwise that combine's whatever the visiting order or the
completion order (deterministic mode stays repeatable). ``slot_TK`` is computed on device from the routing
metadata (``token_slots``), so nothing is read back to the host.

Several GPUs. The inputs address a route by (row, slot) in one rank's buffers. With P ranks the same kernel
would take, per route, the rank holding its row (``rank_TK``), and two int64 tables of the ranks' base
addresses (symmetric memory: expert outputs and done counters), forming each pointer as
``base[rank] + offset`` as the NVLink transport's kernels do (``transport/nvlink/kernels.py``); the GEMM's
release and this acquire would then be at system scope. On one GPU (loopback) every row is local and the
scope is the GPU.

Launch contract: the combine must run concurrently with the GEMM that releases its counters (another
stream, launched after the GEMM so a first-call compile or kernel load cannot leave it spinning alone,
``programs`` <= the GEMM's ``sms_held_back``), or after it; on the GEMM's own stream before it, it waits
forever.
"""

from __future__ import annotations

import torch

from mok_megatron.kernels import Impl, jit, next_pow2, tl, triton, use_triton
from mok_megatron.kernels.combine import combine_reference
from mok_megatron.kernels.permute import check_devices
from mok_megatron.kernels.routing import RoutingMeta
from mok_megatron.kernels.tile_gemm import TilePlan, row_slots

BLOCK_T = 4  # tokens per block: one acquire round per block
BLOCK_H_MAX = 512


# ---- pure functions: which slots a token needs, the order tokens complete ---------------------------------


def token_slots(meta: RoutingMeta, plan: TilePlan) -> torch.Tensor:
    """int32 [T, K]: the done slot of each route's row in fc2's output (the plan's row tile), -1 for a
    dropped route. Sync-free (a gather of ``tile_gemm.row_slots``)."""
    if plan.rows != meta.num_rows:
        raise ValueError(
            f"token_slots: the plan has {plan.rows} rows, the routing {meta.num_rows}; build the plan over "
            "the routing's expert-major buffer (tile_plan(offs, meta.num_rows, H, config))"
        )
    slot_M = row_slots(plan.cu_G1[1:], plan.rows, plan.config)
    rows = meta.row_TK.long()
    slot = slot_M[rows.clamp(min=0)] if slot_M.numel() else torch.full_like(rows, -1)
    return torch.where(rows >= 0, slot, -1).to(torch.int32)


def token_order(slot_TK: torch.Tensor, done_rank_S: torch.Tensor) -> torch.Tensor:
    """int32 [T]: the tokens in the order their rows are expected to be complete: by the latest
    ``done_rank_S`` (``tile_gemm.slot_done_rank``) of their routes' slots, ties in token order; tokens with no
    live route first."""
    live = slot_TK >= 0
    if done_rank_S.numel() == 0:
        rank = torch.full(slot_TK.shape, -1, dtype=torch.int64, device=slot_TK.device)
    else:
        rank = done_rank_S[slot_TK.long().clamp(min=0)]
    rank = (
        torch.where(live, rank, -1).amax(1) if slot_TK.shape[1] else slot_TK.new_full((slot_TK.shape[0],), -1)
    )
    return torch.argsort(rank, stable=True).to(torch.int32)


# ---- reference ---------------------------------------------------------------------------------------------


def tile_combine_reference(
    y_RH: torch.Tensor,
    meta: RoutingMeta,
    slot_TK: torch.Tensor,
    done_S: torch.Tensor,
    done_target_S: torch.Tensor,
    probs_TK: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``kernels.combine.combine_reference``, once every live route's slot is complete (a route that would
    wait forever raises, naming it)."""
    live = slot_TK >= 0
    slot = slot_TK.long().clamp(min=0)
    short = live & (done_S[slot] < done_target_S[slot]) if done_S.numel() else live & False
    if bool(short.any()):
        t, k = short.nonzero()[0].tolist()
        s = int(slot_TK[t, k])
        raise RuntimeError(
            f"tile_combine_reference: token {t}, route {k} waits for done slot {s} to reach "
            f"{int(done_target_S[s])}; it holds {int(done_S[s])}"
        )
    return combine_reference(y_RH, meta, probs_TK, out_dtype)


# ---- the kernel --------------------------------------------------------------------------------------------


def _jit(fn):
    # one compiled kernel for every token count (Triton would specialise an int argument's value):
    # ``preload``'s launch with no token loads the kernel the combine then runs
    return triton.jit(do_not_specialize=["num_tokens"])(fn) if triton is not None else jit(fn)


@_jit
def _tile_combine_kernel(
    y_ptr,  # [R, H] expert-major rows (fc2's output)
    row_ptr,  # [T, K] int32 rows, -1 = dropped
    slot_ptr,  # [T, K] int32 done slot of each route's row, -1 = dropped
    weight_ptr,  # [T, K] per-route weight (HAS_WEIGHT)
    done_ptr,  # [S] int32 done counters, released by the GEMM's epilogue
    target_ptr,  # [S] int32 the counter value of a complete slot
    order_ptr,  # [T] int32 visiting order (HAS_ORDER)
    out_ptr,  # [T, H]
    num_tokens,
    hidden,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_ORDER: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ks = tl.arange(0, K_P2)
    for blk in range(pid, tl.cdiv(num_tokens, BLOCK_T), nprog):
        i = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = i < num_tokens
        if HAS_ORDER:
            t = tl.load(order_ptr + i, mask=t_ok, other=0).to(tl.int64)
        else:
            t = i.to(tl.int64)
        route = t[:, None] * K + ks[None, :]
        route_ok = t_ok[:, None] & (ks < K)[None, :]
        slot = tl.load(slot_ptr + route, mask=route_ok, other=-1)
        live = slot >= 0
        target = tl.load(target_ptr + slot, mask=live, other=0)
        # acquire: the rows the GEMM stored before its release are visible to the loads below
        seen = tl.atomic_add(done_ptr + slot, 0, mask=live, sem="acquire", scope="gpu")
        short = tl.sum(tl.sum((live & (seen < target)).to(tl.int32), axis=1), axis=0)
        while short > 0:
            seen = tl.atomic_add(done_ptr + slot, 0, mask=live, sem="acquire", scope="gpu")
            short = tl.sum(tl.sum((live & (seen < target)).to(tl.int32), axis=1), axis=0)
        tl.debug_barrier()  # every thread's loads after every thread's acquire
        for h0 in range(0, hidden, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            in_row = cols < hidden
            acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
            for k in tl.static_range(K):  # k order, fp32, as kernels.combine: the same bits
                row = tl.load(row_ptr + t * K + k, mask=t_ok, other=-1).to(tl.int64)
                ok = row >= 0
                y = tl.load(
                    y_ptr + row[:, None] * hidden + cols[None, :],
                    mask=ok[:, None] & in_row[None, :],
                    other=0,
                ).to(tl.float32)
                if HAS_WEIGHT:
                    y = y * tl.load(weight_ptr + t * K + k, mask=t_ok & ok, other=0).to(tl.float32)[:, None]
                acc += y
            tl.store(
                out_ptr + t[:, None] * hidden + cols[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=t_ok[:, None] & in_row[None, :],
            )


def _check(y_RH, meta, slot_TK, done_S, done_target_S, probs_TK, order_T, programs) -> None:
    op = "tile_combine"
    if y_RH.dim() != 2 or y_RH.shape[0] != meta.num_rows:
        raise ValueError(
            f"{op}: y has shape {tuple(y_RH.shape)}, expected [R, H] with R = meta.num_rows = {meta.num_rows}"
        )
    if slot_TK.shape != meta.row_TK.shape or slot_TK.dtype != torch.int32:
        raise ValueError(
            f"{op}: slot_TK is {slot_TK.dtype} {tuple(slot_TK.shape)}, expected int32 "
            f"{tuple(meta.row_TK.shape)} (token_slots(meta, plan))"
        )
    if done_S.dim() != 1 or done_S.shape != done_target_S.shape:
        raise ValueError(
            f"{op}: done {tuple(done_S.shape)}, targets {tuple(done_target_S.shape)}; both [S] "
            "(the plan's done_targets_S and the counters given to tile_grouped_mm)"
        )
    for name, t in (("done", done_S), ("done_target", done_target_S)):
        if t.dtype != torch.int32:
            raise ValueError(f"{op}: {name} is {t.dtype}; it must be int32")
    if probs_TK is not None and probs_TK.shape != meta.row_TK.shape:
        raise ValueError(
            f"{op}: probs has shape {tuple(probs_TK.shape)}, expected {tuple(meta.row_TK.shape)}"
        )
    num_tokens = meta.row_TK.shape[0]
    if order_T is not None and (order_T.shape != (num_tokens,) or order_T.dtype != torch.int32):
        raise ValueError(
            f"{op}: order is {order_T.dtype} {tuple(order_T.shape)}, expected int32 ({num_tokens},): a "
            "permutation of the tokens (token_order)"
        )
    if programs < 1:
        raise ValueError(f"{op}: programs={programs}; it must be >= 1 (the SMs the GEMM holds back)")
    check_devices(
        op, meta, y=y_RH, slot=slot_TK, done=done_S, done_target=done_target_S, probs=probs_TK, order=order_T
    )


def tile_combine(
    y_RH: torch.Tensor,
    meta: RoutingMeta,
    slot_TK: torch.Tensor,
    done_S: torch.Tensor,
    done_target_S: torch.Tensor,
    probs_TK: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    order_T: torch.Tensor | None = None,
    programs: int = 8,
    impl: Impl = Impl.AUTO,
    preload: bool = False,
) -> torch.Tensor:
    """``kernels.combine.combine(y_RH, meta, probs_TK, out_dtype)`` on ``programs`` programs, each token
    block summed once its routes' done slots are complete. One launch on the current stream.

    Inputs: y_RH [R, H] fc2's output in the layout of ``meta``, written concurrently by the waiting GEMM;
    slot_TK int32 [T, K] (``token_slots``); done_S int32 [S] the GEMM's done counters; done_target_S int32
    [S] their complete values (``plan.done_targets_S``, plus what the counters held before the GEMM);
    probs_TK [T, K] or None; order_T int32 [T] the visiting order or None (token order). Output: out_TH
    [T, H] in out_dtype (default y's), bitwise ``combine``'s. Forward only. The torch path checks that every
    slot is complete and raises otherwise (it cannot wait).

    ``preload=True``: the same launch summing no token (the output is left unwritten), so the kernel is
    loaded before the GEMM whose done counters it waits on: CUDA loads a kernel lazily at its first launch,
    and that load may wait for the device to go idle, which serialises the combine behind the GEMM (or, with
    the combine queued first and another kernel spinning, never comes)."""
    _check(y_RH, meta, slot_TK, done_S, done_target_S, probs_TK, order_T, programs)
    out_dtype = out_dtype or y_RH.dtype
    if not use_triton(impl, y_RH, "tile_combine"):
        if preload:  # nothing to load; the reference would refuse counters that are not yet complete
            return torch.empty(meta.row_TK.shape[0], y_RH.shape[1], dtype=out_dtype, device=y_RH.device)
        return tile_combine_reference(y_RH, meta, slot_TK, done_S, done_target_S, probs_TK, out_dtype)
    num_tokens, topk = meta.row_TK.shape
    hidden = y_RH.shape[1]
    out_TH = torch.empty(num_tokens, hidden, dtype=out_dtype, device=y_RH.device)
    if num_tokens == 0 or hidden == 0:
        return out_TH
    blocks = -(-num_tokens // BLOCK_T)
    y_RH = y_RH.contiguous()
    _tile_combine_kernel[(min(programs, blocks),)](
        y_RH,
        meta.row_TK,
        slot_TK.contiguous(),
        out_TH if probs_TK is None else probs_TK.contiguous(),
        done_S,
        done_target_S,
        slot_TK if order_T is None else order_T,
        out_TH,
        0 if preload else num_tokens,
        hidden,
        K=topk,
        K_P2=next_pow2(topk),
        BLOCK_T=BLOCK_T,
        BLOCK_H=min(next_pow2(hidden), BLOCK_H_MAX),
        HAS_WEIGHT=probs_TK is not None,
        HAS_ORDER=order_T is not None,
    )
    return out_TH
