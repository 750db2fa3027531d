"""The tile engine's dispatch: K persistent programs pull the rows this rank receives, expert by expert, into
the expert-major buffer that the waiting grouped GEMM (``tile_gemm``) reads, and release each row tile's
counter as its rows land.

Legend: P source ranks, G local experts, H row width (elements), M rows of the receive buffer (expert-major,
all local experts), S counter slots (``tile_gemm``'s row tiles), C chunks (tasks) of the pull; ``_C8`` a
table of C rows of eight int32.

Layouts. Source ``p`` holds the rows it sends to this rank in its own buffer from row ``src_row0_P[p]`` on,
grouped by local expert (expert 0's ``c_PG[p, 0]`` rows, then expert 1's, ...). The receive buffer is
expert-major, and within one expert ordered by source rank:

    recv[dst(p, g) + i] = source_p[src(p, g) + i]      for i < c_PG[p, g]
    src(p, g) = src_row0_P[p] + sum(c_PG[p, :g])       dst(p, g) = sum(c_PG[:, :g]) + sum(c_PG[:p, g])

so expert g's rows end at ``offs_G[g] = sum(c_PG[:, :g + 1])`` (what ``tile_gemm.tile_plan`` takes).

Order. The tasks run expert-major: all sources of expert 0, then expert 1, ... (within an expert by source
rank). That is the order QuACK's scheduler visits the GEMM's tiles in (``tile_gemm.quack_tile_order``);
measured on one H200 (docs/results/2026-12-03-tile-gemm-gate), the waiting GEMM in QuACK's order with K SMs
held back is within 3 % of ``torch._grouped_mm`` (DeepSeek-V3 EP=32 slice K <= 4, Qwen3 EP=8 slice K <= 8),
while in ring arrival order (source by source) it takes 1.09-1.14x on DeepSeek: each expert's weights are
read again for every source step.

Chunks. Each (source, expert) segment is cut into chunks of at most ``chunk_rows`` rows; program ``k`` of K
takes chunks ``k, k + K, k + 2K, ...``, so the K chunks in flight at a time are consecutive in the expert-major
order. A chunk may cross row tiles: after its stores it adds, for every counter slot it overlaps, the number of
its rows in that slot (``tl.atomic_add(..., sem="release", scope="gpu")`` after a CTA barrier), so each slot
reaches its target (its rows, ``tile_gemm.counter_targets``) once all its rows are in, whichever programs
wrote them. The table row carries the chunk's first slot and its first row's place in that slot's tile; the
kernel walks the slots from there.

Sources. The kernel reaches the sources through ``table_P``: an int64 tensor of their buffers' base
addresses on the receive buffer's device, cast to pointers in the kernel (``source_table`` builds it from
tensors of this GPU: the loopback; across GPUs it holds symmetric memory's peer addresses, as
``transport.nvlink``'s row movers take them). A table rather than one stacked ``[P, rows, H]`` tensor: peers'
buffers are separate mappings with no common base, and the loopback would otherwise copy its sources into
one tensor; the same kernel serves both. Every source buffer must have the receive buffer's dtype and row
width with contiguous rows, and must hold its rows before the launch (stream order, or a flag the caller
waits on).

Sync-free: ``pull_plan`` runs on the device of ``c_PG`` with shapes fixed by host ints (``rows``, P, G,
``chunk_rows``): the table has ``chunk_capacity`` rows, those past the last chunk move 0 rows. The total of
``c_PG`` must not exceed ``rows`` (as ``tile_gemm``'s plans assume); the kernel never stores past row M.

Blocks in flight. A program copies a chunk in blocks of at most ``block_bytes`` (``BLOCK_R`` rows of
``BLOCK_W`` words), each a load of the whole block into registers, then its store. With ``stages`` S > 1 the
blocks of a chunk are software-pipelined: the loads of the next S - 1 blocks are issued before the current
block is stored, so S blocks are in flight while the stores go out, rather than one block and a drained
pipeline per step. The pipeline stays within a chunk: its last store precedes the chunk's barrier and release
as with S = 1, and the pacing and delays before a chunk are unchanged. ``check_tuning`` bounds
S * ``block_bytes`` by the registers a thread has.

Copy. ``copy="registers"`` (the default) moves each block through registers as above. One SM copies ~38-40
GB/s on one H200 whatever the block, warps or stages, and beside the waiting GEMM two programs on each of the
K SMs the GEMM leaves moved no more than one, while the same programs spread over twice as many SMs (no GEMM
beside them) moved about twice the bytes (``benchmarks.tile_pull --per-sm``): the SM's own path to memory is
the bound, so the pull's rate is set by K. Two programs of 64 KiB blocks are as many as an SM holds at once
(127 registers per thread at 8 warps, 64 at 16: ptxas for sm_90a); four do not fit (their blocks alone fill
its 256 KiB of registers), so half of them start only as the others end, and the benchmark skips such
combinations. ``copy="tma"`` moves the same blocks with Triton's on-device tensor descriptors: per
chunk one descriptor over its ``n`` source rows (clipped at the receive buffer's end) and one over its
receive rows, both ``[rows, W]`` words at a row stride of W, so a block past the chunk's last row or word is
clipped by the copy itself; on sm_90 they are TMA bulk copies (``cp.async.bulk.tensor``, global -> shared ->
global), the path DeepEP's intranode kernels copy with. Measured on one H200 with Triton 3.6 they move
less than the register path: 175-188 GB/s at K = 8 and 344-346 at K = 16 against 308-324 and 586-591
(64 KiB blocks; two stages lower still), so the register path is the default. STAGES 1 loads a block into shared memory and
stores it from there; S > 1 is Triton's pipelined loop (S - 1 blocks loaded ahead, one store buffer).
Before a chunk's release, every thread waits for its bulk stores to complete (``cp.async.bulk.wait_group
0``) and fences the async proxy against the generic one (``fence.proxy.async.global``), then the CTA
barrier and the release atomic follow as on the register path: a released row tile's rows are in global
memory and visible. TMA needs 16-byte aligned rows: a row width whose bytes are not a multiple of 16 is
refused (ValueError naming the width; the register path takes any width). The descriptors live in a global
scratch buffer that Triton allocates at each launch through ``triton.set_allocator``'s allocator; the op sets
its own (torch's caching allocator, on the launch's stream) in a copy of the caller's context, so no
allocator is left set after the call. Under the interpreter the descriptors' loads and stores are plain
masked copies and the fence is compiled out.

``copy="none"`` moves no row: the same K programs walk the same chunks in the same order with the same
pacing and delays, then the same CTA barrier and release atomics, but read no source and write nothing to
the receive buffer, whose rows must already be in place (the caller placed them; the sources are not read,
so the table may hold any addresses). It is the link time alone: counters released at the emulated link's
pace, nothing copied, the ceiling the schedule allows a transport whose bytes land without costing the SMs
anything (one SM's register copy beside the GEMM moves only ~38 GB/s on one H200, so the copying paths
measure the copy's cost and the schedule's bound together; this path separates them). Unpaced it releases
every counter as fast as the programs walk the table, which models no link. Its tuning is irrelevant:
``block_bytes`` and ``stages`` are checked for their form only, ``num_warps`` is the programs' warps.

Pacing (GPU only: the interpreter has no inline assembly). With ``rate`` bytes/s, each program paces its own
share at ``rate / K``: before a chunk it spins on ``%globaltimer`` until ``t0 + (its bytes so far, this chunk
included) * K / rate`` (``t0``: the program's start), so no chunk is released before an emulated link of that
rate would have delivered it. ``rate`` 0 compiles the pacing out. ``delays_C`` (ns per chunk, GPU only) adds a
spin before each chunk: the tests' random arrival times.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
from collections.abc import Sequence

import torch

from mok_megatron.kernels import INTERPRETED, next_pow2, tl, triton
from mok_megatron.kernels.tile_gemm import TileConfig, slot_base, slot_capacity

# one program's load-then-store step: 64 KiB over 16 warps (32 registers of data per thread), one block in
# flight (STAGES 1); measured on one H200 (benchmarks.tile_pull, unpaced) ~39 GB/s per program, linear in K:
# an SM's copy rate is about its bytes in flight over the load latency. ``stages`` keeps more blocks in flight
# (benchmarks.tile_pull sweeps --block-bytes, --warps and --stages)
BLOCK_BYTES = 65536
NUM_WARPS = 16
STAGES = 1
MAX_STAGES = 4
# the register budget of the blocks in flight: one program is one CTA on its SM, so a thread's share of the
# SM's register file is REGISTERS_PER_SM / (32 * num_warps); the data in flight may take half of it, and at
# most MAX_DATA_REGISTERS: at most 128 KiB in flight from 8 warps up. The addresses, masks and indices take
# about as much again: compiled for sm_90 (ptxas) at DeepSeek-V3's rows (7168 bf16), 64 KiB over 16 warps
# takes 64 registers per thread, 128 KiB 128, two stages of 64 KiB 122, none spilling (nor any combination
# within the budget with blocks of 16 KiB or more); 256 KiB over 16 warps, or 128 KiB over 32 warps at two
# stages, spills. At Qwen3's rows (2048) three within the budget spill 4-72 bytes (128 KiB over 8 or 16
# warps, four stages of 16 KiB over 16).
REGISTERS_PER_SM = 65536
MAX_DATA_REGISTERS = 128
# copy="tma": the blocks live in shared memory (sm_90: at most 227 KiB per CTA). Compiled by Triton 3.8 for
# sm_90, STAGES 1 loads a block into one buffer and stores it from there; STAGES S > 1 takes S - 1 load
# buffers and one store buffer, a block copied between them through registers (one block's registers)
SHARED_PER_CTA = 232448
# copy="none": no row moves (the link's time alone, the rows already in place: the ceiling of the schedule)
COPIES = ("registers", "tma", "none")

# the table's columns
SOURCE, EXPERT, SRC_ROW, DST_ROW, ROWS, SLOT, SLOT_ROW = range(7)
COLUMNS = 8  # the eighth is 0 (32-byte rows)


@dataclasses.dataclass(frozen=True)
class PullPlan:
    """What the pull reads besides the buffers, all on ``c_PG``'s device.

    tasks_C8   int32 [C, 8] per chunk, in pull order: source, expert, first source row, first receive row,
               rows, counter slot of its first row, that row's place in the slot's tile (0 .. tile_m - 1),
               0; rows past the last chunk are (0, G, 0, 0, 0, 0, 0, 0)
    offs_G     int32 [G]: each expert's end row in the receive buffer (``tile_gemm.tile_plan``'s ``offs_G``)
    """

    config: TileConfig
    rows: int
    chunk_rows: int
    sources: int
    tasks_C8: torch.Tensor
    offs_G: torch.Tensor

    @property
    def groups(self) -> int:
        return self.offs_G.numel()

    @property
    def slots(self) -> int:
        """Counter slots the pull releases into (``tile_gemm.slot_capacity``)."""
        return slot_capacity(self.rows, self.groups, self.config)


# ---- sizes (host ints) -------------------------------------------------------------------------------------


def chunk_capacity(rows: int, sources: int, groups: int, chunk_rows: int) -> int:
    """Most chunks for at most ``rows`` rows in ``sources * groups`` segments: each segment's last chunk is
    the only one that may be short, so ``rows // chunk_rows`` full chunks plus one per segment."""
    return rows // chunk_rows + sources * groups


# ---- pure functions: layouts and the plan ------------------------------------------------------------------


def _check_counts(c_PG: torch.Tensor, rows: int, chunk_rows: int, src_row0_P: torch.Tensor | None) -> None:
    if c_PG.dim() != 2 or c_PG.dtype.is_floating_point or c_PG.dtype == torch.bool:
        raise ValueError(
            f"pull_plan: c_PG is {c_PG.dtype} {tuple(c_PG.shape)}; it must be an integer [P, G] tensor of the "
            "rows each source sends for each local expert"
        )
    if chunk_rows < 1:
        raise ValueError(f"pull_plan: chunk_rows={chunk_rows}; it must be >= 1 (rows per pulled chunk)")
    if rows < 0:
        raise ValueError(f"pull_plan: rows={rows}; it must be >= 0 (rows of the receive buffer)")
    if src_row0_P is not None and src_row0_P.shape != (c_PG.shape[0],):
        raise ValueError(
            f"pull_plan: src_row0_P has shape {tuple(src_row0_P.shape)}; it must be ({c_PG.shape[0]},), one "
            "first row per source"
        )


def receive_rows(c_PG: torch.Tensor) -> torch.Tensor:
    """int64 [P, G]: the receive buffer's first row of each (source, expert) segment (expert-major, by source
    within an expert)."""
    c_GP = c_PG.long().t()
    flat = c_GP.flatten()
    return (torch.cumsum(flat, 0) - flat).view(c_GP.shape).t()


def source_rows(c_PG: torch.Tensor, src_row0_P: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [P, G]: each segment's first row in its source's buffer (the source's rows for this rank from
    ``src_row0_P[p]`` on, grouped by local expert; ``src_row0_P`` defaults to 0)."""
    c = c_PG.long()
    first = torch.cumsum(c, 1) - c
    if src_row0_P is not None:
        first = first + src_row0_P.to(device=c.device, dtype=torch.long)[:, None]
    return first


def pull_plan(
    c_PG: torch.Tensor,
    rows: int,
    config: TileConfig,
    chunk_rows: int,
    src_row0_P: torch.Tensor | None = None,
) -> PullPlan:
    """The pull of ``c_PG[p, g]`` rows of expert ``g`` from every source ``p`` into a receive buffer of
    ``rows`` rows, released into the counter slots of a ``tile_gemm`` plan of the same rows and ``config``,
    in chunks of at most ``chunk_rows`` rows, expert-major. No host sync: every shape comes from host ints."""
    _check_counts(c_PG, rows, chunk_rows, src_row0_P)
    n_p, n_g = c_PG.shape
    c = c_PG.long()
    count_I = c.t().flatten()  # segments in pull order: I = g * P + p
    dst_I = receive_rows(c).t().flatten()
    src_I = source_rows(c, src_row0_P).t().flatten()
    chunks_I = (count_I + chunk_rows - 1) // chunk_rows
    end_I = torch.cumsum(chunks_I, 0)
    t = torch.arange(chunk_capacity(rows, n_p, n_g, chunk_rows), device=c.device)
    seg = torch.searchsorted(end_I, t, right=True)
    valid = seg < count_I.numel()
    segc = seg.clamp(max=max(count_I.numel() - 1, 0))
    if count_I.numel() == 0:  # no source or no expert: every row is past the last chunk
        zero = torch.zeros_like(t)
        tasks = torch.stack([zero, zero + n_g] + [zero] * (COLUMNS - 2), 1)
        return PullPlan(config, rows, chunk_rows, n_p, tasks.to(torch.int32).contiguous(), _offs(c))
    r0 = (t - (end_I - chunks_I)[segc]) * chunk_rows
    n = torch.where(valid, (count_I[segc] - r0).clamp(0, chunk_rows), 0)
    p, g = segc % n_p, segc // n_p
    dst = dst_I[segc] + r0
    within = dst - receive_rows(c)[0][g]  # the row within its expert
    slot = slot_base(_offs(c), config).long()[g] + within // config.tile_m
    zero = torch.zeros_like(t)

    def keep(x):
        return torch.where(valid, x, zero)

    tasks = torch.stack(
        [
            keep(p),
            torch.where(valid, g, n_g),
            keep(src_I[segc] + r0),
            keep(dst),
            n,
            keep(slot),
            keep(within % config.tile_m),
            zero,
        ],
        1,
    )
    return PullPlan(config, rows, chunk_rows, n_p, tasks.to(torch.int32).contiguous(), _offs(c))


def _offs(c_PG: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(c_PG.long().sum(0), 0).to(torch.int32)


def slot_releases(plan: PullPlan) -> torch.Tensor:
    """int32 [S]: what the whole pull adds to each counter slot (chunk by chunk, slot by slot, as the kernel
    does); equal to ``tile_gemm.counter_targets`` of the same rows when the plan covers them all."""
    out = torch.zeros(plan.slots + 1, dtype=torch.int64, device=plan.tasks_C8.device)
    tasks = plan.tasks_C8.long()
    tm = plan.config.tile_m
    n, first, at = tasks[:, ROWS], tasks[:, SLOT], tasks[:, SLOT_ROW]
    # a chunk touches at most ceil((tile_m - 1 + chunk_rows) / tile_m) slots
    for j in range((tm - 1 + plan.chunk_rows + tm - 1) // tm):
        lo = torch.clamp(j * tm - at, min=0)
        hi = torch.clamp((j + 1) * tm - at, max=n)
        add = (hi - lo).clamp(min=0)
        slot = torch.where(add > 0, first + j, plan.slots).clamp(max=plan.slots)
        out.index_add_(0, slot, add)
    return out[: plan.slots].to(torch.int32)


# ---- reference ---------------------------------------------------------------------------------------------


def pull_reference(
    recv_MH: torch.Tensor,
    sources: Sequence[torch.Tensor],
    plan: PullPlan,
    counters_S: torch.Tensor,
) -> torch.Tensor:
    """The pull in torch, chunk by chunk in the plan's order (host loop): copies each chunk's rows and adds
    its rows to every counter slot it overlaps. Returns ``recv_MH`` (written in place, as ``counters_S``)."""
    _check_buffers("pull_reference", recv_MH, plan, counters_S, len(sources))
    tm = plan.config.tile_m
    for p, _, s0, d0, n, slot, at, _ in plan.tasks_C8.tolist():
        if n == 0:
            continue
        recv_MH[d0 : d0 + n].copy_(sources[p][s0 : s0 + n])
        left = n
        while left:
            k = min(tm - at, left)
            counters_S[slot] += k
            left, at, slot = left - k, 0, slot + 1
    return recv_MH


# ---- the kernel --------------------------------------------------------------------------------------------


def _globaltimer():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


def _async_store_fence():
    """Waits for this thread's bulk (TMA) stores to complete (their global writes done, not only their shared
    memory read: ``wait_group``, not ``wait_group.read``), then fences the async proxy against the generic
    one for global memory, so the CTA barrier and the release atomic that follow (generic proxy) publish the
    TMA's writes. Triton 3.8 already ends a descriptor-store loop with a full ``wait_group 0``; the fence it
    does not emit, and the wait here keeps the rule independent of that lowering (no group is left: free)."""
    return tl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;",
        "=r",
        [],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def _block_mask(n, M, W, dst0, b, nw, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """Block ``b`` of a chunk cut into ``nw`` blocks per row block: its rows, words, and mask."""
    rb = b // nw
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    w = (b - rb * nw) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = ((r < n) & (dst0 + r < M))[:, None] & (w < W)[None, :]
    return r, w, mask


def _block_load(src_ptr, src0, dst0, n, M, W, b, nw, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """Block ``b`` of a chunk, loaded (past the chunk's last block its rows are past ``n``: nothing read)."""
    r, w, mask = _block_mask(n, M, W, dst0, b, nw, BLOCK_R, BLOCK_W)
    src = src_ptr + ((src0 + r) * W)[:, None] + w[None, :]
    return tl.load(src, mask=mask, eviction_policy="evict_first")


def _block_store(recv_ptr, v, dst0, n, M, W, b, nw, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    r, w, mask = _block_mask(n, M, W, dst0, b, nw, BLOCK_R, BLOCK_W)
    tl.store(recv_ptr + ((dst0 + r) * W)[:, None] + w[None, :], v, mask=mask)


if triton is not None:
    _globaltimer = triton.jit(_globaltimer)
    _async_store_fence = triton.jit(_async_store_fence)
    _block_mask = triton.jit(_block_mask)
    _block_load = triton.jit(_block_load)
    _block_store = triton.jit(_block_store)

    def _jit(fn):
        # one compiled kernel for every rate and chunk count (Triton would specialise a float or int
        # argument's value): ``preload``'s launch with no chunks loads the kernel the pull then runs
        return triton.jit(do_not_specialize=["ns_per_byte", "C"])(fn)
else:

    def _jit(fn):
        return fn


@_jit
def _pull_kernel(
    recv_ptr,  # [M, W] words: the receive buffer
    table_ptr,  # [P] int64: the sources' base addresses
    tasks_ptr,  # [C, 8] int32
    counters_ptr,  # [S] int32
    delays_ptr,  # [C] int64 ns (DELAY only)
    M,  # rows of the receive buffer
    W,  # words per row
    C,  # chunks (table rows)
    ns_per_byte,  # fp32: one program's share of the link, ns per byte (PACE only)
    TILE_M: tl.constexpr,
    ELEM: tl.constexpr,  # bytes per word
    ALIGNED: tl.constexpr,  # sources, receive buffer and rows 16-byte aligned: hint the vector width
    PACE: tl.constexpr,
    DELAY: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    STAGES: tl.constexpr,  # blocks in flight (1: load a block, store it, then the next)
    MOVE: tl.constexpr,  # copy the rows (False: copy="none", the chunks paced and released, no row touched)
    TMA: tl.constexpr,  # copy through tensor descriptors (TMA bulk copies on sm_90)
    FENCE: tl.constexpr,  # TMA compiled (not interpreted): wait for the bulk stores and fence before release
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if ALIGNED:
        W = tl.multiple_of(W, 16 // ELEM)
    row_bytes = W.to(tl.int64) * ELEM
    moved = row_bytes * 0  # this program's bytes so far (PACE)
    if PACE:
        t0 = _globaltimer()
    for t in range(pid, C, nprog):
        task = tasks_ptr + t * 8
        n = tl.load(task + 4)
        if n > 0:
            p = tl.load(task + 0)
            src0 = tl.load(task + 2).to(tl.int64)
            dst0 = tl.load(task + 3).to(tl.int64)
            if DELAY:
                wait = tl.load(delays_ptr + t)
                start = _globaltimer()
                now = start
                while now - start < wait:
                    now = _globaltimer()
            if PACE:
                moved += n.to(tl.int64) * row_bytes
                due = t0 + (moved.to(tl.float32) * ns_per_byte).to(tl.int64)
                now = _globaltimer()
                while now < due:
                    now = _globaltimer()
            # copy="none" (MOVE off): no source read, no row written (they are in place); paced and
            # released alike
            if MOVE:
                base = tl.load(table_ptr + p)
                if ALIGNED:
                    # the source as an element offset from the (16-byte aligned) receive pointer, so the
                    # alignment hint reaches the vectorizer (it does not look through an int-to-pointer cast)
                    delta = tl.multiple_of((base - recv_ptr.to(tl.int64)) // ELEM, 16 // ELEM)
                    src_ptr = recv_ptr + delta
                else:
                    src_ptr = base.to(tl.pointer_type(recv_ptr.dtype.element_ty))
                if TMA:
                    # one descriptor per side per chunk: the chunk's rows (n, clipped at the receive
                    # buffer's end) of W words at a row stride of W; the blocks past either edge are clipped
                    # by the copy
                    rows = tl.maximum(tl.minimum(n.to(tl.int64), M - dst0), 0).to(tl.int32)
                    src_desc = tl.make_tensor_descriptor(
                        src_ptr + src0 * W, shape=[rows, W], strides=[W, 1], block_shape=[BLOCK_R, BLOCK_W]
                    )
                    dst_desc = tl.make_tensor_descriptor(
                        recv_ptr + dst0 * W, shape=[rows, W], strides=[W, 1], block_shape=[BLOCK_R, BLOCK_W]
                    )
                    nw = tl.cdiv(W, BLOCK_W)
                    nb = tl.cdiv(rows, BLOCK_R) * nw
                    for b in tl.range(0, nb, num_stages=STAGES):
                        rb = b // nw
                        r0 = rb * BLOCK_R
                        w0 = (b - rb * nw) * BLOCK_W
                        v = src_desc.load([r0, w0])
                        dst_desc.store([r0, w0], v)
                    if FENCE:
                        _async_store_fence()
                elif STAGES == 1:
                    for r0 in range(0, n, BLOCK_R):
                        r = r0 + tl.arange(0, BLOCK_R)
                        ok = (r < n) & (dst0 + r < M)
                        src_row = (src0 + r) * W
                        dst_row = (dst0 + r) * W
                        for w0 in range(0, W, BLOCK_W):
                            w = w0 + tl.arange(0, BLOCK_W)
                            mask = ok[:, None] & (w < W)[None, :]
                            v = tl.load(
                                src_ptr + src_row[:, None] + w[None, :],
                                mask=mask,
                                eviction_policy="evict_first",
                            )
                            tl.store(recv_ptr + dst_row[:, None] + w[None, :], v, mask=mask)
                else:
                    # the chunk's blocks in one sequence (row block by row block, words within): block
                    # b + S - 1 is loaded before block b is stored; loads past the last block are masked off
                    # (rows >= n)
                    nw = tl.cdiv(W, BLOCK_W)
                    nb = tl.cdiv(n, BLOCK_R) * nw
                    v0 = _block_load(src_ptr, src0, dst0, n, M, W, 0, nw, BLOCK_R, BLOCK_W)
                    if STAGES >= 3:
                        v1 = _block_load(src_ptr, src0, dst0, n, M, W, 1, nw, BLOCK_R, BLOCK_W)
                    if STAGES >= 4:
                        v2 = _block_load(src_ptr, src0, dst0, n, M, W, 2, nw, BLOCK_R, BLOCK_W)
                    for b in range(0, nb):
                        vn = _block_load(src_ptr, src0, dst0, n, M, W, b + STAGES - 1, nw, BLOCK_R, BLOCK_W)
                        _block_store(recv_ptr, v0, dst0, n, M, W, b, nw, BLOCK_R, BLOCK_W)
                        if STAGES == 2:
                            v0 = vn
                        elif STAGES == 3:
                            v0 = v1
                            v1 = vn
                        else:
                            v0 = v1
                            v1 = v2
                            v2 = vn
            # every thread's stores are done before one thread releases them (the release is cumulative)
            tl.debug_barrier()
            slot = tl.load(task + 5)
            at = tl.load(task + 6)
            left = n
            while left > 0:
                k = tl.minimum(TILE_M - at, left)
                tl.atomic_add(counters_ptr + slot, k, sem="release", scope="gpu")
                left -= k
                at = at * 0
                slot += 1


# ---- the op ------------------------------------------------------------------------------------------------


def source_table(sources: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """int64 [P]: the base addresses of ``sources`` (tensors of one GPU, or CPU tensors for the interpreter)
    on ``device`` (the first source's by default). The tensors must outlive every pull that reads the
    table."""
    if not sources:
        raise ValueError("source_table: no sources; pass one buffer per source rank")
    dev = device if device is not None else sources[0].device
    odd = [p for p, s in enumerate(sources) if s.data_ptr() % 16]
    if odd:
        raise ValueError(
            f"source_table: sources {odd} start at addresses not a multiple of 16 bytes; the kernel reads rows "
            "with 16-byte vectors: pass whole allocations (or .clone() the views)"
        )
    return torch.tensor([s.data_ptr() for s in sources], dtype=torch.int64, device=dev)


def scratch_launcher(kernel, device: torch.device):
    """``kernel`` (a launch: ``jit_fn[grid]``) called with Triton's global scratch allocator set to torch's
    caching allocator on ``device``, for the launch alone. sm_90 writes each on-device tensor descriptor to
    a global scratch buffer (128 bytes per descriptor and program) that Triton asks ``triton.set_allocator``'s
    allocator for at every launch; that allocator is a context variable, set here in a copy of the caller's
    context, so the caller's own allocator (or none) is untouched. The buffer is allocated on the current
    stream, the launch's stream, and freed after the launch call: torch reuses it only after the kernel in
    stream order."""

    def alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int8, device=device)  # blocks aligned to 512 bytes

    def launch(*args, **kwargs):
        def run():
            triton.set_allocator(alloc)
            return kernel(*args, **kwargs)

        return contextvars.copy_context().run(run)

    return launch


def data_registers(block_bytes: int, num_warps: int, stages: int) -> int:
    """32-bit registers of data per thread that ``stages`` blocks of ``block_bytes`` in flight take."""
    return stages * block_bytes // (4 * 32 * num_warps)


def register_limit(num_warps: int) -> int:
    """The most registers of data per thread a program of ``num_warps`` warps may keep in flight: half its
    thread's share of the SM's register file, at most ``MAX_DATA_REGISTERS``."""
    return min(MAX_DATA_REGISTERS, REGISTERS_PER_SM // (2 * 32 * num_warps))


def check_tuning(
    block_bytes: int,
    num_warps: int,
    stages: int,
    op: str = "tile_pull",
    budget: bool = True,
    copy: str = "registers",
) -> None:
    """Raises ValueError (one line naming the value and the fix) unless ``copy`` is one of ``COPIES``,
    ``block_bytes`` is a power of two (copy="tma": at least 16, a TMA box's smallest row), ``num_warps`` one
    of 1 .. 32, ``stages`` one of 1 .. ``MAX_STAGES`` and (``budget``) the blocks in flight fit: copy=
    "registers", ``register_limit``; copy="tma", ``stages`` blocks within ``SHARED_PER_CTA`` and, at S > 1,
    the one block copied through registers within ``register_limit``. A block is never larger than a
    power-of-two ``block_bytes``, so the bounds hold for every row width. copy="none" moves no block:
    ``block_bytes`` and ``stages`` are checked for their form only (the same values are valid for every
    path), never against a budget; ``num_warps`` is the programs' warps there too."""

    def pow2(x):
        return isinstance(x, int) and x >= 1 and x & (x - 1) == 0

    if copy not in COPIES:
        raise ValueError(f"{op}: copy={copy!r}; it must be one of {', '.join(map(repr, COPIES))}")
    if not pow2(block_bytes):
        raise ValueError(f"{op}: block_bytes={block_bytes}; it must be a power of two (bytes per block)")
    if copy == "tma" and block_bytes < 16:
        raise ValueError(
            f"{op}: block_bytes={block_bytes} with copy='tma'; it must be >= 16 (a TMA box row is 16 bytes "
            "at least)"
        )
    if not pow2(num_warps) or num_warps > 32:
        raise ValueError(f"{op}: num_warps={num_warps}; it must be 1, 2, 4, 8, 16 or 32 (warps per program)")
    if not isinstance(stages, int) or not 1 <= stages <= MAX_STAGES:
        raise ValueError(
            f"{op}: stages={stages}; it must be an integer in 1 .. {MAX_STAGES} (blocks in flight per program)"
        )
    if copy == "none":  # no block in flight: no budget
        return
    if copy == "tma":
        if budget and stages * block_bytes > SHARED_PER_CTA:
            raise ValueError(
                f"{op}: stages={stages} x block_bytes={block_bytes} with copy='tma' takes "
                f"{stages * block_bytes} bytes of shared memory, more than {SHARED_PER_CTA} per CTA; keep "
                f"stages * block_bytes <= {SHARED_PER_CTA} (lower stages or block_bytes)"
            )
        regs, limit = data_registers(block_bytes, num_warps, 1), register_limit(num_warps)
        if budget and stages > 1 and regs > limit:
            raise ValueError(
                f"{op}: block_bytes={block_bytes} over num_warps={num_warps} at stages={stages} with "
                f"copy='tma' passes {regs} registers of data per thread between its buffers, more than "
                f"{limit}; lower block_bytes, raise num_warps, or use stages=1"
            )
        return
    regs, limit = data_registers(block_bytes, num_warps, stages), register_limit(num_warps)
    if budget and regs > limit:
        most = limit * 4 * 32 * num_warps
        raise ValueError(
            f"{op}: stages={stages} x block_bytes={block_bytes} over num_warps={num_warps} keeps {regs} registers "
            f"of data per thread in flight, more than {limit}; keep stages * block_bytes <= {most} at "
            f"num_warps={num_warps} (lower stages or block_bytes)"
        )


def _check_buffers(op: str, recv_MH, plan: PullPlan, counters_S, sources: int) -> None:
    if recv_MH.dim() != 2 or recv_MH.shape[0] != plan.rows:
        raise ValueError(
            f"{op}: recv has shape {tuple(recv_MH.shape)}, the plan {plan.rows} rows; the receive buffer must "
            f"be [{plan.rows}, H] (pull_plan's rows)"
        )
    if recv_MH.shape[1] and (recv_MH.stride(1) != 1 or recv_MH.stride(0) != recv_MH.shape[1]):
        raise ValueError(
            f"{op}: recv has strides {recv_MH.stride()}; its rows must be contiguous and packed (strides "
            f"({recv_MH.shape[1]}, 1)): pass recv.contiguous() and copy it back, or allocate it contiguous"
        )
    if counters_S.shape != (plan.slots,) or counters_S.dtype != torch.int32:
        raise ValueError(
            f"{op}: counters are {counters_S.dtype} {tuple(counters_S.shape)}; they must be int32 "
            f"({plan.slots},): tile_gemm.slot_capacity(rows, G, config), as the GEMM's plan's targets"
        )
    if sources != plan.sources:
        raise ValueError(f"{op}: {sources} sources for a plan of {plan.sources}; pass one per source rank")


def tile_pull(
    recv_MH: torch.Tensor,
    table_P: torch.Tensor,
    plan: PullPlan,
    counters_S: torch.Tensor,
    *,
    programs: int,
    rate: float = 0.0,
    delays_C: torch.Tensor | None = None,
    block_bytes: int = BLOCK_BYTES,
    num_warps: int = NUM_WARPS,
    stages: int = STAGES,
    copy: str = "registers",
    preload: bool = False,
) -> torch.Tensor:
    """Pull every chunk of ``plan`` into ``recv_MH`` with ``programs`` (K) persistent programs, one launch on
    the current stream, releasing each chunk's rows into ``counters_S`` as it lands.

    Inputs: recv_MH [M, H] any dtype, contiguous rows (written); table_P int64 [P] on recv's device: the
    sources' base addresses (``source_table``), each a buffer of recv's dtype and row width whose rows the
    plan reads; plan from ``pull_plan`` (M rows); counters_S int32 [S] (``PullPlan.slots``), added to, never
    reset (a GEMM plan ``shifted`` by their value before the pull waits for this pull's rows); rate bytes/s
    of an emulated link (0: as fast as the copy goes; GPU only); delays_C int64 [C] ns spun before each
    chunk (GPU only); block_bytes the bytes of one block (a power of two), num_warps the program's warps,
    stages the blocks a program keeps in flight (1: load a block, store it, then the next; S: the next S - 1
    blocks' loads issued before a block's store; one SM's copy rate is about its bytes in flight / memory
    latency), within ``check_tuning``'s budget; copy "registers" (loads and stores through registers),
    "tma" (tensor descriptors: TMA bulk copies global -> shared -> global on sm_90, rows a multiple of 16
    bytes) or "none" (no row moved: recv_MH must hold every row already; the chunks are paced and released
    alone, the link time only; see "Copy" in the module's notes). Output: recv_MH.

    Concurrency: with a waiting GEMM on ``SMs - K`` SMs launched before it on another stream, the pull's K
    programs (one CTA each) run on the SMs the GEMM leaves free, so the GEMM's waits always end, provided
    the pull's kernel is loaded before the GEMM starts waiting: CUDA loads a kernel lazily at its first launch
    and that load may wait for the device to go idle, which a GEMM waiting for this very kernel never does.
    ``preload=True`` is that launch: the same arguments, no chunk moved (recv and counters untouched); call
    it before launching the waiting GEMM."""
    op = "tile_pull"
    if programs < 1:
        raise ValueError(f"{op}: programs={programs}; it must be >= 1 (K, the SMs that pull)")
    if rate < 0:
        raise ValueError(f"{op}: rate={rate}; it must be >= 0 bytes/s (0: unpaced)")
    check_tuning(block_bytes, num_warps, stages, op, copy=copy)
    if table_P.dim() != 1 or table_P.dtype != torch.int64 or table_P.device != recv_MH.device:
        raise ValueError(
            f"{op}: table is {table_P.dtype} {tuple(table_P.shape)} on {table_P.device}; it must be int64 [P] "
            f"on {recv_MH.device} (source_table(buffers))"
        )
    _check_buffers(op, recv_MH, plan, counters_S, table_P.numel())
    for name, t in (("plan", plan.tasks_C8), ("counters", counters_S)):
        if t.device != recv_MH.device:
            raise ValueError(f"{op}: {name} on {t.device}; it must be on {recv_MH.device}, with recv")
    chunks = plan.tasks_C8.shape[0]
    if delays_C is not None and (delays_C.shape != (chunks,) or delays_C.dtype != torch.int64):
        raise ValueError(
            f"{op}: delays are {delays_C.dtype} {tuple(delays_C.shape)}; they must be int64 ({chunks},), "
            "ns per chunk of the plan"
        )
    paced = rate > 0 or delays_C is not None
    if paced and (recv_MH.device.type != "cuda" or INTERPRETED):
        raise ValueError(
            f"{op}: rate={rate:g}, delays {'given' if delays_C is not None else 'none'} on {recv_MH.device} "
            f"(interpreted={INTERPRETED}); pacing and delays spin on the GPU's clock: pass rate=0 and no "
            "delays on CPU"
        )
    if triton is None:
        raise RuntimeError(f"{op}: Triton is not installed; pip install triton (or use pull_reference)")
    m, h = recv_MH.shape
    if chunks == 0 or m == 0 or h == 0:
        return recv_MH
    if preload:
        chunks = 0
    row_bytes = h * recv_MH.element_size()
    word = next(
        dt for dt in (torch.int64, torch.int32, torch.int16, torch.uint8) if row_bytes % dt.itemsize == 0
    )
    words = recv_MH.view(torch.uint8).view(m, row_bytes).view(word)
    w = words.shape[1]
    block_w = min(next_pow2(w), max(1, block_bytes // word.itemsize))
    block_r = max(1, block_bytes // (block_w * word.itemsize))
    block_r = min(next_pow2(block_r), next_pow2(plan.chunk_rows))
    aligned = row_bytes % 16 == 0 and recv_MH.data_ptr() % 16 == 0
    tma = copy == "tma"
    if tma and row_bytes % 16:
        pad = 16 // math.gcd(16, recv_MH.element_size())
        raise ValueError(
            f"{op}: copy='tma' with rows of H={h} x {recv_MH.element_size()} bytes = {row_bytes} bytes; TMA "
            f"copies rows of a multiple of 16 bytes: pad H to a multiple of {pad}, or use copy='registers'"
        )
    if tma and recv_MH.data_ptr() % 16:
        raise ValueError(
            f"{op}: copy='tma' with the receive buffer at address {recv_MH.data_ptr()} (not a multiple of 16 "
            "bytes); TMA needs 16-byte aligned buffers: pass a whole allocation, or use copy='registers'"
        )
    dummy = counters_S  # an unread pointer argument when DELAY is off
    grid = (programs,)
    launch = _pull_kernel[grid]
    if tma and not INTERPRETED:
        launch = scratch_launcher(launch, recv_MH.device)
    launch(
        words,
        table_P,
        plan.tasks_C8,
        counters_S,
        delays_C if delays_C is not None else dummy,
        m,
        w,
        chunks,
        float(programs * 1e9 / rate) if rate > 0 else 0.0,
        TILE_M=plan.config.tile_m,
        ELEM=word.itemsize,
        ALIGNED=aligned,
        PACE=rate > 0,
        DELAY=delays_C is not None,
        BLOCK_R=block_r,
        BLOCK_W=block_w,
        STAGES=stages,
        MOVE=copy != "none",
        TMA=tma,
        FENCE=tma and not INTERPRETED,
        num_warps=num_warps,
    )
    return recv_MH
