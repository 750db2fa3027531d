"""Row movers over peer memory: pull-based dispatch and push-based combine, each beside its torch reference.

A *segment table* ``seg_P3`` (int64, one row per peer p) says which rows move:
``(src_row0, dst_row0, n)``. Rows are raw words (the row's bytes viewed as int64/int32/int16/uint8), so
one kernel moves rows of any dtype and width.

    pull_rows(out_RW, peers, seg_P3)   out[dst_row0 + i] = peers.bufs[p][src_row0 + i]   (dispatch)
    push_rows(x_NW, peers, seg_P3)     peers.bufs[p][dst_row0 + i] = x[src_row0 + i]     (combine)

The Triton kernels reach the peers through ``peers.table_P``: the peers' base addresses (mapped into this
process by symmetric memory, or plain buffers of one GPU in loopback) as an int64 tensor, cast to pointers
in the kernel. ``programs`` bounds the CTAs (SMs) that communicate; each program walks the peers starting
at its own index, so concurrent programs read or write different peers.

Legend: P peers (EP ranks), W words per row, R rows received, N rows sent.
"""

from __future__ import annotations

import math
import torch

from mok_megatron.compat import have_triton
from mok_megatron.transport.nvlink.peers import PeerBuffers
from mok_megatron.transport.nvlink.signals import Signals, spin_until, wait, wait_args, wait_reference

if have_triton():
    import triton
    import triton.language as tl

    jit = triton.jit
else:  # the references still work
    triton = tl = None

    def jit(fn):
        return fn


DEFAULT_PROGRAMS = 64  # CTAs that communicate (of 132 SMs on an H200); benchmarks sweep it


def word_dtype(row_bytes: int) -> torch.dtype:
    """The widest integer word that divides a row (kernels move words)."""
    for dt in (torch.int64, torch.int32, torch.int16):
        if row_bytes % dt.itemsize == 0:
            return dt
    return torch.uint8


def as_words(x: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """``x`` (contiguous, any dtype) as ``[rows, W]`` words of the same bytes (a view)."""
    row = math.prod(x.shape[1:]) * x.element_size()
    return x.reshape(x.shape[0], math.prod(x.shape[1:])).view(torch.uint8).view(x.shape[0], row).view(word)


@jit
def _rows_kernel(
    local_ptr,  # this rank's tensor: pull destination (out) or push source (x)
    table_ptr,  # [P] int64 peer base addresses
    seg_ptr,  # [P, 3] int64 (src_row0, dst_row0, n)
    flags_ptr,  # [P] int64 my ready flags (WAIT: pull peer p's rows once flags[p] >= my epoch)
    epoch_ptr,  # [1] int64 my epoch
    W,  # words per row
    P,  # peers
    SPIN_LIMIT: tl.constexpr,
    TRAP: tl.constexpr,
    WAIT: tl.constexpr,
    PUSH: tl.constexpr,
    ALIGNED: tl.constexpr,  # peers' bases and rows 16-byte aligned: hint it for vector loads/stores
    ELEM: tl.constexpr,  # bytes per word
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ty = local_ptr.dtype.element_ty
    for i in range(0, P):
        p = (pid + i) % P
        base_i = tl.load(table_ptr + p)
        if ALIGNED:
            # Address the peer as an element offset from our own (16-byte aligned) pointer, so the
            # alignment hint reaches the vectorizer (it does not look through an int->pointer cast).
            delta = (base_i - local_ptr.to(tl.int64)) // ELEM
            delta = tl.multiple_of(delta, 16 // ELEM)
            peer = local_ptr + delta
        else:
            peer = base_i.to(tl.pointer_type(ty))
        src0 = tl.load(seg_ptr + 3 * p)
        dst0 = tl.load(seg_ptr + 3 * p + 1)
        n = tl.load(seg_ptr + 3 * p + 2)
        if WAIT:  # this peer's rows are staged (every program checks before it reads them)
            spin_until(flags_ptr + p, tl.load(epoch_ptr), SPIN_LIMIT, TRAP)
        for r0 in range(pid * BLOCK_R, n, nprog * BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            row_ok = r < n
            src_row = (src0 + r).to(tl.int64) * W
            dst_row = (dst0 + r).to(tl.int64) * W
            for w0 in range(0, W, BLOCK_W):
                w = w0 + tl.arange(0, BLOCK_W)
                mask = row_ok[:, None] & (w < W)[None, :]
                src = src_row[:, None] + w[None, :]
                dst = dst_row[:, None] + w[None, :]
                if PUSH:
                    v = tl.load(local_ptr + src, mask=mask)
                    tl.store(peer + dst, v, mask=mask)
                else:
                    v = tl.load(peer + src, mask=mask)
                    tl.store(local_ptr + dst, v, mask=mask)


_aligned_ok: dict = {}  # device type -> whether the ALIGNED variant compiled (else fall back once)


def _launch(
    local: torch.Tensor,
    peers: PeerBuffers,
    seg_P3: torch.Tensor,
    push: bool,
    programs: int,
    signals: Signals | None = None,
):
    rows, W = local.shape
    P = peers.table_P.numel()
    if rows == 0 or W == 0 or P == 0:
        if signals is not None:  # nothing to read, but this is still my wait for every peer
            wait(signals)
        return
    if programs < 1:
        raise ValueError(f"programs={programs}: must be >= 1 (the CTAs that communicate).")
    block_w = min(triton.next_power_of_2(W), 1024)
    block_r = max(1, min(16, 4096 // block_w))  # 32 KiB of int64 words in flight per CTA
    grid = (max(1, min(programs, triton.cdiv(rows, block_r))),)
    row_bytes = W * local.element_size()
    aligned = (
        row_bytes % 16 == 0 and local.data_ptr() % 16 == 0 and all(b.data_ptr() % 16 == 0 for b in peers.bufs)
    )
    key = local.device.type
    flags, epoch, limit, trap = wait_args(signals)
    args = (local, peers.table_P, seg_P3, flags, epoch, W, P)
    meta = dict(
        SPIN_LIMIT=limit,
        TRAP=trap,
        WAIT=signals is not None,
        PUSH=push,
        ELEM=local.element_size(),
        BLOCK_R=block_r,
        BLOCK_W=block_w,
        num_warps=8,
    )
    if aligned and _aligned_ok.get(key, True):
        try:
            _rows_kernel[grid](*args, ALIGNED=True, **meta)
            _aligned_ok[key] = True
            return
        except Exception:  # an older Triton without hints on inttoptr: the plain variant, from now on
            if _aligned_ok.get(key):
                raise
            _aligned_ok[key] = False
    _rows_kernel[grid](*args, ALIGNED=False, **meta)


def pull_rows(
    out_RW: torch.Tensor,
    peers: PeerBuffers,
    seg_P3: torch.Tensor,
    programs: int = DEFAULT_PROGRAMS,
    signals: Signals | None = None,
):
    """Dispatch: this rank reads, from every peer's buffer, the rows addressed to it (Triton). With
    ``signals``: each peer's rows once that peer's ready flag reaches my epoch (``transport.nvlink.signals``)."""
    _launch(out_RW, peers, seg_P3, False, programs, signals)
    return out_RW


def push_rows(x_NW: torch.Tensor, peers: PeerBuffers, seg_P3: torch.Tensor, programs: int = DEFAULT_PROGRAMS):
    """Combine: this rank writes its rows into every peer's buffer at the planned positions (Triton)."""
    _launch(x_NW, peers, seg_P3, True, programs)
    return x_NW


def pull_rows_reference(
    out_RW: torch.Tensor,
    peers: PeerBuffers,
    seg_P3: torch.Tensor,
    programs: int = DEFAULT_PROGRAMS,
    signals: Signals | None = None,
):
    """``pull_rows`` in torch (``programs`` is ignored; with ``signals`` it waits for every peer first)."""
    if signals is not None:
        wait_reference(signals)
    for p, (s0, d0, n) in enumerate(seg_P3.tolist()):
        if n:
            out_RW[d0 : d0 + n].copy_(peers.bufs[p][s0 : s0 + n])
    return out_RW


def push_rows_reference(
    x_NW: torch.Tensor, peers: PeerBuffers, seg_P3: torch.Tensor, programs: int = DEFAULT_PROGRAMS
):
    """``push_rows`` in torch (``programs`` is ignored)."""
    for p, (s0, d0, n) in enumerate(seg_P3.tolist()):
        if n:
            peers.bufs[p][d0 : d0 + n].copy_(x_NW[s0 : s0 + n])
    return x_NW
