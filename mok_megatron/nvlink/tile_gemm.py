"""Tile-level consumption: a grouped GEMM whose tiles start as soon as their rows have landed.

The exchanges of ``nvlink.exchange`` hand the experts a whole minibatch at once: the grouped GEMM waits
for the last row. Here the receiving side is cut into chunks of ``chunk`` rows, each with a *landed*
flag (an int64 epoch), and the two kernels run at the same time on two streams:

    land_rows(dst_RK, src_RK, landed_C, epoch_1, chunk, programs, gbps)   the mover (``programs`` CTAs):
        copies rows chunk by chunk and, after each chunk, sets landed[c] = epoch (release). ``gbps`` > 0
        paces it to a link's bandwidth (``%globaltimer``): the one-GPU stand-in for rows arriving over
        NVLink at that rate (the loopback evidence; over a real link the peer's writes set the flags).
    grouped_mm_landed(x_RK, w_ENK, ends_E, landed_C, epoch_1, chunk, programs)   the GEMM: persistent
        over (expert, row block, column block) tiles in row order; a tile polls the flags of the chunks
        its rows lie in (acquire) before it loads them. Without flags: a plain grouped GEMM.

Both are launched with at most ``#SMs`` CTAs together (``programs`` each): a polling GEMM tile holds
its SM, so the mover must never wait for a free one. Flags only grow (epochs), so a CUDA graph can
replay the pair. ``grouped_mm_reference`` is ``torch._grouped_mm`` (the experts' GEMM, same layout:
``y = x @ w_e^T`` per expert's rows, ``ends_E`` the rows' cumulative ends); ``land_rows_reference`` a copy.

Scope: this is the mechanism and its one-GPU measurement (``benchmarks/tile_gemm_probe.py``); the MoK
layer does not use it yet (its experts run cuBLAS grouped GEMMs, see docs/status.md).

Legend: R rows, K the GEMM's inner size, N its output columns, E experts, C chunks of ``chunk`` rows.
"""

from __future__ import annotations

import torch

from mok_megatron.kernels import INTERPRETED, jit, tl, triton
from mok_megatron.nvlink.signals import SPIN_LIMIT, TRAP, spin_until

# (BM, BN, BK, warps, stages): tiles of the H200 bf16 GEMM (benchmarks/tile_gemm_probe.py sweeps them)
DEFAULT_TILE = (128, 256, 64, 8, 3)


def tile_table(ends_E: torch.Tensor, rows: int, bm: int):
    """(expert_T, row0_T): every row block of ``bm`` rows of each expert, in row order, on the device (no
    host read): T = ceil(rows / bm) + E entries, the unused ones with expert -1."""
    ends = ends_E.to(torch.int64)
    E = ends.numel()
    counts = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (counts + bm - 1) // bm
    cum = tiles.cumsum(0)
    t = torch.arange((rows + bm - 1) // bm + E, device=ends.device)
    e = torch.searchsorted(cum, t, right=True).clamp(max=E - 1)
    row0 = ends[e] - counts[e] + (t - (cum[e] - tiles[e])) * bm
    valid = t < cum[-1]
    return torch.where(valid, e, -1).to(torch.int32), torch.where(valid, row0, 0).to(torch.int32)


@jit
def _grouped_mm_kernel(
    x_ptr,  # [R, K] (TMA: a descriptor of blocks [BM, BK])
    w_ptr,  # [E, N, K] (TMA: a descriptor of [E * N, K] in blocks [BN, BK])
    y_ptr,  # [R, N]
    tile_e_ptr,  # [T] int32 expert (-1: none)
    tile_m0_ptr,  # [T] int32 first row
    ends_ptr,  # [E] int32 cumulative row ends
    landed_ptr,  # [C] int64 landed epochs (WAIT)
    epoch_ptr,  # [1] int64
    T,
    N,
    K,
    CHUNK,
    WAIT: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,
    TRAP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    TMA: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_n = tl.cdiv(N, BN)
    for tile in range(pid, T * num_n, nprog):
        t = tile // num_n
        nb = tile % num_n
        e = tl.load(tile_e_ptr + t)
        if e >= 0:
            m0 = tl.load(tile_m0_ptr + t)
            m_end = tl.minimum(tl.load(ends_ptr + e), m0 + BM)
            if WAIT:
                ep = tl.load(epoch_ptr)
                for c in range(m0 // CHUNK, (m_end - 1) // CHUNK + 1):
                    spin_until(landed_ptr + c, ep, SPIN_LIMIT, TRAP)
            rm = m0 + tl.arange(0, BM)
            rn = nb * BN + tl.arange(0, BN)
            row_ok = rm < m_end
            col_ok = rn < N
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            if TMA:  # whole blocks (rows past the expert's end are computed and not stored)
                for k in range(0, K, BK):
                    a = x_ptr.load([m0, k])
                    b = w_ptr.load([e * N + nb * BN, k])
                    acc = tl.dot(a, b.T, acc)
            else:
                rk = tl.arange(0, BK)
                a_ptrs = x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :]
                b_ptrs = w_ptr + e.to(tl.int64) * N * K + rn[:, None].to(tl.int64) * K + rk[None, :]
                for _k in range(0, K, BK):
                    a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                    b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
                    acc = tl.dot(a, tl.trans(b), acc)
                    a_ptrs += BK
                    b_ptrs += BK
            y_ptrs = y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@jit
def _land_kernel(
    dst_ptr,  # [R, W] words
    src_ptr,  # [R, W] words
    landed_ptr,  # [C] int64
    epoch_ptr,  # [1] int64
    R,
    W,
    CHUNK,
    NS_PER_CHUNK,  # pacing: a chunk may land NS_PER_CHUNK ns after the previous one (0: not paced)
    PACED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ep = tl.load(epoch_ptr)
    t0 = 0
    if PACED:
        t0 = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    for c in range(pid, tl.cdiv(R, CHUNK), nprog):
        r_end = tl.minimum(R, (c + 1) * CHUNK)
        for r0 in range(c * CHUNK, r_end, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            row_ok = r < r_end
            for w0 in range(0, W, BLOCK_W):
                w = w0 + tl.arange(0, BLOCK_W)
                off = r[:, None].to(tl.int64) * W + w[None, :]
                mask = row_ok[:, None] & (w < W)[None, :]
                tl.store(dst_ptr + off, tl.load(src_ptr + off, mask=mask), mask=mask)
        if PACED:
            due = t0 + (c + 1) * NS_PER_CHUNK
            now = tl.inline_asm_elementwise(
                "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
            )
            while now < due:
                now = tl.inline_asm_elementwise(
                    "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
                )
        tl.debug_barrier()  # every thread's rows of the chunk are written before the flag
        tl.atomic_xchg(landed_ptr + c, ep, sem="release", scope="gpu")


def use_tma(x_RK: torch.Tensor, w_ENK: torch.Tensor, bn: int) -> bool:
    """TMA descriptors: a compiled GPU of sm_90+, contiguous operands, N a multiple of BN (a weight block
    must not reach into the next expert's rows)."""
    if INTERPRETED or not x_RK.is_cuda or torch.cuda.get_device_capability(x_RK.device)[0] < 9:
        return False
    return x_RK.is_contiguous() and w_ENK.is_contiguous() and w_ENK.shape[1] % bn == 0


def _check(x_RK, w_ENK, ends_E, bk):
    if x_RK.dim() != 2 or w_ENK.dim() != 3 or x_RK.shape[1] != w_ENK.shape[2]:
        raise ValueError(
            f"grouped_mm_landed: x {tuple(x_RK.shape)} and w {tuple(w_ENK.shape)}: need [R, K], [E, N, K]"
        )
    if ends_E.numel() != w_ENK.shape[0]:
        raise ValueError(f"grouped_mm_landed: {ends_E.numel()} row ends for {w_ENK.shape[0]} experts")
    if x_RK.shape[1] % bk:
        raise ValueError(f"grouped_mm_landed: K={x_RK.shape[1]} must be a multiple of the tile's BK={bk}")


def grouped_mm_landed(
    x_RK: torch.Tensor,
    w_ENK: torch.Tensor,
    ends_E: torch.Tensor,
    landed_C: torch.Tensor | None = None,
    epoch_1: torch.Tensor | None = None,
    chunk: int = 128,
    programs: int | None = None,
    tile=DEFAULT_TILE,
    tma: bool | None = None,
) -> torch.Tensor:
    """``y_RN``: each expert's rows times its weight's transpose; with ``landed_C`` each tile first waits
    until the chunks holding its rows have landed (``landed_C[c] >= epoch_1``). ``tma``: load the operands
    with Hopper's tensor memory accelerator (default: on sm_90+ when the shapes allow, ``use_tma``)."""
    bm, bn, bk, warps, stages = tile
    _check(x_RK, w_ENK, ends_E, bk)
    R, K = x_RK.shape
    E, N, _ = w_ENK.shape
    y = x_RK.new_empty((R, N))
    if R == 0:
        return y
    tile_e, tile_m0 = tile_table(ends_E, R, bm)
    T = tile_e.numel()
    if programs is None:
        programs = torch.cuda.get_device_properties(x_RK.device).multi_processor_count if x_RK.is_cuda else 4
    grid = (max(1, min(programs, T * triton.cdiv(N, bn))),)
    wait = landed_C is not None
    ends = ends_E.to(torch.int32)
    tma = use_tma(x_RK, w_ENK, bn) if tma is None else tma
    x_arg, w_arg = x_RK, w_ENK
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_arg = TensorDescriptor.from_tensor(x_RK, [bm, bk])
        w_arg = TensorDescriptor.from_tensor(w_ENK.view(E * N, K), [bn, bk])
    _grouped_mm_kernel[grid](
        x_arg,
        w_arg,
        y,
        tile_e,
        tile_m0,
        ends,
        landed_C if wait else ends,
        epoch_1 if wait else ends,
        T,
        N,
        K,
        chunk,
        WAIT=wait,
        SPIN_LIMIT=SPIN_LIMIT,
        TRAP=TRAP,
        BM=bm,
        BN=bn,
        BK=bk,
        TMA=tma,
        num_warps=warps,
        num_stages=stages,
    )
    return y


def land_rows(
    dst_RK: torch.Tensor,
    src_RK: torch.Tensor,
    landed_C: torch.Tensor,
    epoch_1: torch.Tensor,
    chunk: int = 128,
    programs: int = 16,
    gbps: float = 0.0,
) -> torch.Tensor:
    """Copy ``src`` into ``dst`` chunk by chunk, setting ``landed_C[c] = epoch`` after each chunk (paced to
    ``gbps`` GB/s when > 0: the emulated link)."""
    from mok_megatron.nvlink.kernels import as_words, word_dtype

    R = src_RK.shape[0]
    if R == 0:
        return dst_RK
    if gbps > 0 and INTERPRETED:
        raise ValueError("land_rows: pacing (gbps > 0) reads %globaltimer: GPU only")
    word = word_dtype(src_RK[0].numel() * src_RK.element_size())
    d, s = as_words(dst_RK, word), as_words(src_RK, word)
    W = d.shape[1]
    block_w = min(triton.next_power_of_2(W), 1024)
    block_r = max(1, min(16, 4096 // block_w))
    ns = int(chunk * W * word.itemsize / gbps) if gbps > 0 else 0  # bytes / (GB/s) = ns
    grid = (max(1, min(programs, triton.cdiv(R, chunk))),)
    _land_kernel[grid](
        d,
        s,
        landed_C,
        epoch_1,
        R,
        W,
        chunk,
        ns,
        PACED=gbps > 0,
        BLOCK_R=block_r,
        BLOCK_W=block_w,
        num_warps=8,
    )
    return dst_RK


def grouped_mm_reference(
    x_RK: torch.Tensor, w_ENK: torch.Tensor, ends_E: torch.Tensor, *args, **kw
) -> torch.Tensor:
    """``grouped_mm_landed`` without flags, per expert in torch (the layer's ``torch._grouped_mm`` layout)."""
    y = x_RK.new_empty((x_RK.shape[0], w_ENK.shape[1]))
    start = 0
    for e, end in enumerate(ends_E.tolist()):
        y[start:end] = (x_RK[start:end].float() @ w_ENK[e].float().t()).to(y.dtype)
        start = end
    return y
