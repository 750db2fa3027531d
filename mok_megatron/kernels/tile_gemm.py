"""A grouped GEMM whose tiles wait for their rows: the expert GEMMs that consume exchanged rows (fc1 forward,
fc2's input gradient) start while the exchange still runs, each tile once its rows have arrived.

Legend: M rows (expert-major, all local experts), K reduction width, N output width, G groups (local
experts), S counter slots (row tiles, see below), W work items (one cluster of ``cluster_m`` row tiles
times one column tile); ``_W4`` a table of W rows of four int32.

    out_MN[rows of g] = a_MK[rows of g] @ b_GKN[g]          (torch._grouped_mm(a_MK, b_GKN, offs=offs_G))

The kernel is QuACK's sm_90 persistent varlen-M grouped GEMM (CuTe DSL; the kernels SonicMoE is built on),
one launch, with two changes (``tile_gemm_sm90``):

- its scheduler reads the work items from a table ``tiles_W4`` (expert, cluster row, column tile, counter
  slot of the cluster's first row tile) in the order they are to be visited, instead of deriving them from
  the work index; the table is built here, in QuACK's own order (``quack_tile_order``) or in the order the
  rows arrive (``arrival_tile_order``). One row is 16 bytes, read with one vector load, and it names the
  counter slot itself: the producer's wait needs no second, dependent load to find it;
- before the TMA producer warp loads a row tile's A rows it spins on an acquire load (``ld.acquire.gpu``)
  of that tile's counter until the counter reaches the tile's target, then fences the async proxy so the
  TMA loads see the rows;
- given done counters (``done_S``), its epilogue releases each (row tile, column tile) once the tile's
  output is in global memory: the TMA stores complete, an async-proxy fence, then ``+1`` with release
  semantics on the row tile's done slot. A consumer of fc2's output (``kernels.tile_combine``) moves a row
  block as soon as its slot reaches ``done_targets``.

Counters. One int32 counter per (expert, row tile of ``tile_m`` rows): slot ``slot_base(offs_G)[g] + t`` for
row tile ``t`` of expert ``g``; the CTA of rank ``r`` in a cluster waits on slot ``tiles_W4[w, 3] + r``.
Each expert's slots are padded to a multiple of ``cluster_m`` (a cluster's second CTA can fall past an
expert's last row: its slot has target 0 and never waits). The target of a slot is
the number of its rows (``counter_targets``): whoever writes rows into the expert-major buffer adds, once
the rows are visible at GPU scope (a release, or the end of the kernel that wrote them), the number of rows
it wrote to each slot (``row_slots`` names each row's slot). Rows rather than a 0/1 flag because a row tile
gathers rows from several source ranks, each written by a different transfer. The wait is ``counter >=
target``, so counters need no reset between steps when the targets move up by the rows of one step
(``TilePlan.shifted``).
Counters are read at GPU scope: the pulls that fill them run on this GPU (the K communication SMs).

Done counters. One int32 per slot as well (the same slot numbering): every CTA of a work item adds 1 to
its row tile's slot after its column tile is stored, so a slot is complete at ``done_targets``: the
column-tile count ``ceil(N / tile_n)`` for every slot of an expert (a cluster's CTA past the expert's last
row runs its epilogue too, storing nothing), 0 past the last expert's slots. One add per column tile
rather than one per row tile because the column tiles of a row tile run on different clusters, in any
order. Counters kept across steps: wait for ``done_targets + steps * ceil(N / tile_n)`` on real slots.

Sync-free: the plan's functions and the launch run on the device of their inputs with shapes fixed by
host-known sizes (rows M, groups G, width N), so none reads a device value back (the references do). Capacities (``work_capacity``,
``slot_capacity``) bound the tile counts for any split of M rows into G groups; table rows past the last
work item hold expert ``G`` (the scheduler stops there).

The grid is limited to the clusters that fit on the GPU's SMs less ``sms_held_back`` (132 - K on an H200),
the rest being left to communication.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from mok_megatron.compat import require_quack_tile_gemm


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One compiled kernel variant: CTA tile, warp-group schedule and cluster along M (cluster N is 1).

    The benchmarks' choices (docs/results/2026-12-03-tile-gemm-gate, best at K = 8 held-back SMs):
    ``DEEPSEEK`` (H 7168) and ``QWEN3`` (H 2048, QuACK's default configuration); ``SM90_CONFIGS`` the five
    the gate sweeps."""

    tile_m: int = 128
    tile_n: int = 192
    pingpong: bool = True
    cluster_m: int = 2
    max_swizzle: int = 8  # QuACK's column band width (clusters) of its L2 swizzle

    def __post_init__(self):
        if min(self.tile_m, self.tile_n, self.cluster_m, self.max_swizzle) < 1:
            raise ValueError(f"TileConfig: {self}; every size must be positive")

    def kernel_error(self) -> str | None:
        """Why QuACK's sm_90 kernel cannot take this configuration, or None (the pure functions take any)."""
        if self.tile_m not in (64, 128, 192, 256) or self.tile_n % 16 or self.tile_n > 256:
            return (
                f"tile {self.tile_m}x{self.tile_n}; tile_m must be 64, 128, 192 or 256 and tile_n a "
                "multiple of 16 up to 256"
            )
        if self.pingpong and (
            self.tile_m not in (64, 128, 192) or self.tile_n > (256, 208, 128)[self.tile_m // 64 - 1]
        ):
            return (
                f"pingpong tile {self.tile_m}x{self.tile_n}; pingpong takes 64x256, 128x208, 192x128 at most"
            )
        if self.cluster_m not in (1, 2, 4):
            return f"cluster_m={self.cluster_m}; it must be 1, 2 or 4"
        return None

    @property
    def block_m(self) -> int:
        """Rows of one cluster (one work item)."""
        return self.tile_m * self.cluster_m


DEEPSEEK = TileConfig(tile_m=128, tile_n=256, pingpong=False, cluster_m=2)
QWEN3 = TileConfig(tile_m=128, tile_n=192, pingpong=True, cluster_m=2)
# the configurations benchmarks/tile_gemm_gate.py sweeps (QuACK's default first)
SM90_CONFIGS = (
    QWEN3,
    DEEPSEEK,
    TileConfig(tile_m=256, tile_n=128, pingpong=False, cluster_m=2),
    TileConfig(tile_m=256, tile_n=192, pingpong=False, cluster_m=2),
    TileConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1),
)


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """What the waiting GEMM reads besides its operands, all int32 on the operands' device.

    cu_G1         [0, *offs_G]: each expert's first row (QuACK's cu_seqlens_m)
    tiles_W4      (expert, cluster row within the expert, column tile, counter slot of the cluster's first
                  row tile) per work item, in visiting order, contiguous (16-byte rows); rows past the last
                  work item hold (G, 0, 0, 0)
    targets_S     the counter value each slot waits for (rows of the slot; 0 for padding slots)
    base_G        the slot of each expert's first row tile (``slot_base``); the epilogue's done slot of a
                  tile is ``base_G[expert] + row tile``
    done_targets_S  the done counter of each slot once every column tile of its row tile is stored
                  (``done_targets``: ceil(N / tile_n) for an expert's slots, 0 past them)
    """

    config: TileConfig
    rows: int
    n: int
    cu_G1: torch.Tensor
    tiles_W4: torch.Tensor
    targets_S: torch.Tensor
    base_G: torch.Tensor
    done_targets_S: torch.Tensor

    @property
    def groups(self) -> int:
        return self.cu_G1.numel() - 1

    def shifted(self, base: int | torch.Tensor, done_base: int | torch.Tensor = 0) -> TilePlan:
        """The same plan waiting for ``base`` more arrivals and ``done_base`` more done releases on every real
        slot (both kinds of counter kept across steps, never reset)."""
        real, done = self.targets_S > 0, self.done_targets_S > 0
        return dataclasses.replace(
            self,
            targets_S=torch.where(real, self.targets_S + base, self.targets_S),
            done_targets_S=torch.where(done, self.done_targets_S + done_base, self.done_targets_S),
        )


# ---- sizes (host ints) -------------------------------------------------------------------------------------


def cluster_rows_capacity(rows: int, groups: int, config: TileConfig) -> int:
    """Most clusters along M for ``rows`` rows split into ``groups`` experts (each expert rounds up)."""
    b = config.block_m
    return (rows + groups * (b - 1)) // b


def work_capacity(rows: int, groups: int, n: int, config: TileConfig) -> int:
    """Rows of ``tiles_W4``: QuACK's bound on the work items of a varlen-M problem (its grid bound too)."""
    return cluster_rows_capacity(rows, groups, config) * math.ceil(n / config.tile_n)


def slot_capacity(rows: int, groups: int, config: TileConfig) -> int:
    """Counter slots: row tiles of all experts, each expert padded to a multiple of ``cluster_m``."""
    return cluster_rows_capacity(rows, groups, config) * config.cluster_m


# ---- pure functions: the tile-to-expert map, counter targets, tile orders ----------------------------------


def _counts(offs_G: torch.Tensor) -> torch.Tensor:
    offs = offs_G.long()
    return torch.diff(offs, prepend=offs.new_zeros(1))


def slot_base(offs_G: torch.Tensor, config: TileConfig) -> torch.Tensor:
    """int32 [G]: the counter slot of each expert's first row tile (the padded row tiles before it)."""
    slots_G = (_counts(offs_G) + config.block_m - 1) // config.block_m * config.cluster_m
    return (torch.cumsum(slots_G, 0) - slots_G).to(torch.int32)


def _slot_owner(offs_G: torch.Tensor, rows: int, config: TileConfig):
    """For every slot < capacity: its expert (G past the last) and its row tile within the expert."""
    g = offs_G.numel()
    slots_G = (_counts(offs_G) + config.block_m - 1) // config.block_m * config.cluster_m
    end_G = torch.cumsum(slots_G, 0)
    s = torch.arange(slot_capacity(rows, g, config), device=offs_G.device)
    e = torch.searchsorted(end_G, s, right=True)
    ec = e.clamp(max=max(g - 1, 0))
    t = s - (end_G - slots_G)[ec]
    return e, ec, t


def counter_targets(offs_G: torch.Tensor, rows: int, config: TileConfig) -> torch.Tensor:
    """int32 [S]: rows of each (expert, row tile) slot, 0 for padding slots (a cluster's tile past the
    expert's last row, or past the last expert)."""
    e, ec, t = _slot_owner(offs_G, rows, config)
    c = _counts(offs_G)[ec] if offs_G.numel() else torch.zeros_like(t)
    rows_S = (c - t * config.tile_m).clamp(0, config.tile_m)
    return torch.where(e < offs_G.numel(), rows_S, 0).to(torch.int32)


def done_targets(offs_G: torch.Tensor, rows: int, n: int, config: TileConfig) -> torch.Tensor:
    """int32 [S]: the done counter of each slot once its row tile is stored: one per column tile for every
    slot of an expert (its cluster's padding slots included: their CTAs release too), 0 past the last
    expert's slots."""
    e, _, _ = _slot_owner(offs_G, rows, config)
    return torch.where(e < offs_G.numel(), math.ceil(n / config.tile_n), 0).to(torch.int32)


def row_slots(offs_G: torch.Tensor, rows: int, config: TileConfig) -> torch.Tensor:
    """int64 [M]: the counter slot of every row (what a writer of row r adds 1 to); -1 past the last group."""
    offs = offs_G.long()
    r = torch.arange(rows, device=offs_G.device)
    e = torch.searchsorted(offs, r, right=True)
    ec = e.clamp(max=offs_G.numel() - 1)
    slot = slot_base(offs_G, config).long()[ec] + (r - (offs - _counts(offs_G))[ec]) // config.tile_m
    return torch.where(e < offs_G.numel(), slot, -1)


def quack_tile_order(offs_G: torch.Tensor, rows: int, n: int, config: TileConfig) -> torch.Tensor:
    """int32 [W, 4]: the work items (expert, cluster row, column tile, first counter slot) in QuACK's own
    order (its varlen-M scheduler, static persistence): experts in turn; within one, bands of
    ``max_swizzle`` column tiles, rows down the band, every other band upwards (serpentine), so a band of B
    stays in L2 while the expert's rows stream through it."""
    g, dev = offs_G.numel(), offs_G.device
    ncl_n = math.ceil(n / config.tile_n)
    nm_G = (_counts(offs_G) + config.block_m - 1) // config.block_m
    work_G = nm_G * ncl_n
    end_G = torch.cumsum(work_G, 0)
    w = torch.arange(work_capacity(rows, g, n, config), device=dev)
    e = torch.searchsorted(end_G, w, right=True)
    valid = e < g
    ec = e.clamp(max=max(g - 1, 0))
    cid = w - (end_G - work_G)[ec]
    nm = nm_G[ec].clamp(min=1)
    gs = min(config.max_swizzle, ncl_n)
    tail = ncl_n % gs
    in_group = gs * nm
    group = cid // in_group
    idx = cid - group * in_group
    full = (group + 1) * in_group <= nm * ncl_n
    width = torch.where(full, gs, max(tail, 1))
    slow, fast = idx // width, idx % width
    slow = torch.where(group % 2 == 1, nm - 1 - slow, slow)
    cid_m, cid_n = slow, group * gs + fast
    first = slot_base(offs_G, config).long()[ec] + cid_m * config.cluster_m
    zero = torch.zeros_like(w)
    return torch.stack(
        [
            torch.where(valid, e, g),
            torch.where(valid, cid_m, zero),
            torch.where(valid, cid_n, zero),
            torch.where(valid, first, zero),
        ],
        1,
    ).to(torch.int32)


def slot_ready(offs_G: torch.Tensor, ready_M: torch.Tensor, config: TileConfig) -> torch.Tensor:
    """int64 [S]: when each slot's rows are all there (the latest ``ready_M`` of its rows); padding slots
    are ready at once (int64 min)."""
    rows = ready_M.numel()
    slots = slot_capacity(rows, offs_G.numel(), config)
    out = torch.full((slots + 1,), torch.iinfo(torch.int64).min, dtype=torch.int64, device=ready_M.device)
    slot_M = row_slots(offs_G, rows, config)
    slot_M = torch.where(slot_M >= 0, slot_M, slots)  # rows past the last group: a dropped extra slot
    return out.scatter_reduce(0, slot_M, ready_M.long(), "amax", include_self=True)[:slots]


def arrival_tile_order(
    tiles_W4: torch.Tensor, groups: int, ready_S: torch.Tensor, config: TileConfig
) -> torch.Tensor:
    """``tiles_W4`` reordered by when their rows are ready (a work item: its latest row tile), ties kept in
    the given order (so QuACK's band order survives inside one arrival step); invalid items (expert >=
    ``groups``) stay last."""
    valid = tiles_W4[:, 0] < groups
    slot = tiles_W4[:, 3:4].long() + torch.arange(config.cluster_m, device=tiles_W4.device)
    ready_W = ready_S[slot.clamp(0, max(ready_S.numel() - 1, 0))].amax(1)
    ready_W = torch.where(valid, ready_W, torch.iinfo(torch.int64).max)
    return tiles_W4[torch.argsort(ready_W, stable=True)]


def tile_plan(
    offs_G: torch.Tensor,
    rows: int,
    n: int,
    config: TileConfig,
    ready_M: torch.Tensor | None = None,
) -> TilePlan:
    """The plan of one waiting GEMM over ``rows`` expert-major rows split by ``offs_G`` (cumulative ends,
    as ``torch._grouped_mm``) and ``n`` output columns: QuACK's tile order, or, given ``ready_M`` (any
    integer per row, e.g. the exchange step that delivers it), the order the rows arrive in."""
    tiles_W4 = quack_tile_order(offs_G, rows, n, config)
    if ready_M is not None:
        if ready_M.shape != (rows,):
            raise ValueError(f"tile_plan: ready_M has shape {tuple(ready_M.shape)}; it must be ({rows},)")
        ready_S = slot_ready(offs_G, ready_M, config)
        tiles_W4 = arrival_tile_order(tiles_W4, offs_G.numel(), ready_S, config)
    cu_G1 = torch.nn.functional.pad(offs_G.to(torch.int32), (1, 0))
    return TilePlan(
        config,
        rows,
        n,
        cu_G1,
        tiles_W4.contiguous(),
        counter_targets(offs_G, rows, config),
        slot_base(offs_G, config),
        done_targets(offs_G, rows, n, config),
    )


# ---- completion: which work item finishes each slot, the order tokens become complete ----------------------


def slot_done_rank(plan: TilePlan) -> torch.Tensor:
    """int64 [S]: the table position of the last work item that stores a column tile of each slot (-1 for a
    slot no work item covers). The persistent grid takes the table in order, a wave of clusters at a time,
    so a slot of lower rank completes no later than one of higher rank up to one wave of skew."""
    cfg = plan.config
    tiles = plan.tiles_W4
    w = torch.arange(tiles.shape[0], device=tiles.device)
    valid = tiles[:, 0] < plan.groups
    slot = tiles[:, 3:4].long() + torch.arange(cfg.cluster_m, device=tiles.device)
    slots = plan.targets_S.numel()
    slot = torch.where(valid[:, None], slot, slots)  # the end markers: a dropped extra slot
    w = torch.where(valid, w, -1)[:, None].expand_as(slot)
    out = torch.full((slots + 1,), -1, dtype=torch.int64, device=tiles.device)
    return out.scatter_reduce(0, slot.reshape(-1), w.reshape(-1), "amax", include_self=True)[:slots]


def done_counts_reference(plan: TilePlan) -> torch.Tensor:
    """int32 [S]: the done counters after one launch from zero, by the table: each valid work item adds 1
    to each of its cluster's ``cluster_m`` slots (host loop; equals ``plan.done_targets_S``)."""
    done = [0] * plan.targets_S.numel()
    for e, _, _, first in plan.tiles_W4.tolist():
        if e < plan.groups:
            for b in range(plan.config.cluster_m):
                done[first + b] += 1
    return torch.tensor(done, dtype=torch.int32)


# ---- references --------------------------------------------------------------------------------------------


def grouped_mm_reference(a_MK: torch.Tensor, b_GKN: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a_MK, b_GKN, offs=offs_G)`` in fp32 matmuls per group, cast to a's dtype; rows
    past the last group are zero."""
    out = torch.zeros(a_MK.shape[0], b_GKN.shape[2], dtype=torch.float32, device=a_MK.device)
    start = 0
    for g, end in enumerate(offs_G.tolist()):
        out[start:end] = a_MK[start:end].float() @ b_GKN[g].float()
        start = end
    return out.to(a_MK.dtype)


def tile_gemm_reference(
    a_MK: torch.Tensor, b_GKN: torch.Tensor, offs_G: torch.Tensor, plan: TilePlan, counters_S: torch.Tensor
) -> torch.Tensor:
    """The waiting GEMM's math, tile by tile in the plan's order (host loop; CPU tests): each work item's
    row tiles must have reached their targets (a tile that would wait forever raises), and every output
    element must be written by exactly one tile. Rows past the last group stay zero."""
    cfg, g = plan.config, offs_G.numel()
    n = b_GKN.shape[2]
    if n != plan.n:
        raise ValueError(f"tile_gemm_reference: b has {n} columns, the plan {plan.n}")
    offs = offs_G.tolist()
    starts = [0] + offs[:-1]
    out = torch.zeros(a_MK.shape[0], n, dtype=torch.float32)
    hits = torch.zeros(a_MK.shape[0], n, dtype=torch.int32)
    tiles = plan.tiles_W4.tolist()
    counters, targets = counters_S.tolist(), plan.targets_S.tolist()
    done = False
    for w, (e, cm, cn, first) in enumerate(tiles):
        if e >= g:
            done = True
            continue
        if done:
            raise ValueError(f"tile_gemm_reference: work item {w} (expert {e}) follows the end of the table")
        for b in range(cfg.cluster_m):
            pid_m = cm * cfg.cluster_m + b
            slot = first + b
            if counters[slot] < targets[slot]:
                raise RuntimeError(
                    f"tile_gemm_reference: work item {w} (expert {e}, row tile {pid_m}) waits for counter "
                    f"slot {slot} to reach {targets[slot]}; it holds {counters[slot]}"
                )
            r0 = starts[e] + pid_m * cfg.tile_m
            r1 = min(r0 + cfg.tile_m, offs[e])
            c0, c1 = cn * cfg.tile_n, min((cn + 1) * cfg.tile_n, n)
            if r0 < r1:
                out[r0:r1, c0:c1] = a_MK[r0:r1].float() @ b_GKN[e][:, c0:c1].float()
                hits[r0:r1, c0:c1] += 1
    end = offs[-1] if offs else 0
    if not torch.all(hits[:end] == 1):
        bad = (hits[:end] != 1).nonzero()[0].tolist()
        raise ValueError(f"tile_gemm_reference: output element {bad} written {int(hits[tuple(bad)])} times")
    return out.to(a_MK.dtype)


# ---- the kernel (sm_90, QuACK) -----------------------------------------------------------------------------


@functools.cache
def _max_clusters(device_index: int, cluster_size: int) -> tuple[int, int]:
    from quack.cute_dsl_utils import get_max_active_clusters

    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return get_max_active_clusters(cluster_size, device_id=device_index), sms


def sms_held_back_error(sms_held_back: int, sms: int, config: TileConfig) -> str | None:
    """Why ``sms_held_back`` leaves no room for the kernel's grid on ``sms`` SMs, or None: at least one
    cluster must fit on the rest, so it must lie in [0, sms - cluster_m)."""
    if 0 <= sms_held_back < sms - config.cluster_m:
        return None
    return (
        f"sms_held_back={sms_held_back}; it must be in [0, {sms - config.cluster_m}) ({sms} SMs, clusters of "
        f"{config.cluster_m} along M)"
    )


def grid_clusters(device: torch.device, config: TileConfig, sms_held_back: int) -> int:
    """Persistent clusters on ``SMs - sms_held_back`` SMs (at most what fits on the whole GPU)."""
    fit, sms = _max_clusters(device.index or 0, config.cluster_m)
    why = sms_held_back_error(sms_held_back, sms, config)
    if why is not None:
        raise ValueError(f"grid_clusters: {why}")
    return min(fit, (sms - sms_held_back) // config.cluster_m)


def tile_grouped_mm(
    a_MK: torch.Tensor,
    b_GKN: torch.Tensor,
    plan: TilePlan,
    counters_S: torch.Tensor,
    *,
    sms_held_back: int = 0,
    out: torch.Tensor | None = None,
    done_S: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out_MN`` = ``torch._grouped_mm(a_MK, b_GKN, offs=offs_G)`` for the ``offs_G`` the plan was built
    from, one launch on the current stream, each row tile loaded once ``counters_S`` reaches
    ``plan.targets_S`` at its slot; given ``done_S`` (int32 [S], like the counters), each stored (row tile,
    column tile) adds 1 to ``done_S`` at its slot with release semantics (a slot is complete at
    ``plan.done_targets_S`` more than it held before the launch).

    Inputs: a_MK bf16/fp16 [M, K] (K contiguous); b_GKN same dtype [G, K, N] (K or N contiguous); plan from
    ``tile_plan`` (same M, G and N, on a's device); counters_S int32 [S] (S = ``slot_capacity``), written
    concurrently by the exchange. Output: out_MN [M, N] in a's dtype (rows past offs_G[-1] are not
    written). Every slot's counter must eventually reach its target, or the launch never ends."""
    require_quack_tile_gemm()
    m, k = a_MK.shape
    g, kb, n = b_GKN.shape
    cfg = plan.config
    why = cfg.kernel_error()
    if why is not None:
        raise ValueError(f"tile_grouped_mm: the plan's {why} (QuACK's sm_90 kernel)")
    if kb != k or (m, g, n) != (plan.rows, plan.groups, plan.n):
        raise ValueError(
            f"tile_grouped_mm: a {tuple(a_MK.shape)}, b {tuple(b_GKN.shape)}, a plan for {plan.rows} rows, "
            f"{plan.groups} groups and {plan.n} columns; they must agree (a [M, K], "
            "b [G, K, N], the plan built by tile_plan(offs_G, M, N, config))"
        )
    if counters_S.shape != plan.targets_S.shape:
        raise ValueError(
            f"tile_grouped_mm: counters {tuple(counters_S.shape)}, targets {tuple(plan.targets_S.shape)}; "
            "size the counters like the plan's targets (slot_capacity)"
        )
    if done_S is not None and done_S.shape != plan.targets_S.shape:
        raise ValueError(
            f"tile_grouped_mm: done {tuple(done_S.shape)}, targets {tuple(plan.targets_S.shape)}; "
            "size the done counters like the plan's targets (slot_capacity)"
        )
    named = [("counters", counters_S), ("cu", plan.cu_G1), ("tiles", plan.tiles_W4)]
    if done_S is not None:
        named += [("done", done_S), ("base", plan.base_G)]
    for name, t in named:
        if t.dtype != torch.int32 or t.device != a_MK.device:
            raise ValueError(
                f"tile_grouped_mm: {name} is {t.dtype} on {t.device}; it must be int32 on {a_MK.device}"
            )
    tiles = plan.tiles_W4
    if tiles.dim() != 2 or tiles.shape[1] != 4 or tiles.stride() != (4, 1) or tiles.data_ptr() % 16:
        raise ValueError(
            f"tile_grouped_mm: tiles {tuple(tiles.shape)}, strides {tiles.stride()}, address "
            f"{tiles.data_ptr():#x}; the kernel reads each row with one 16-byte load: it must be a contiguous "
            "[W, 4] int32 tensor on a 16-byte boundary (tile_plan's, or .contiguous() of a reordered one)"
        )
    if a_MK.stride(1) != 1:
        raise ValueError("tile_grouped_mm: a_MK must have contiguous rows (K contiguous)")
    if out is None:
        out = torch.empty(m, n, dtype=a_MK.dtype, device=a_MK.device)
    if m == 0 or n == 0:
        return out
    from mok_megatron.kernels import tile_gemm_sm90

    grid = grid_clusters(a_MK.device, cfg, sms_held_back)
    tile_gemm_sm90.launch(a_MK, b_GKN, out, plan, counters_S, grid, done_S=done_S)
    return out
