"""The tile-waiting grouped GEMM's kernel: QuACK's sm_90 GEMM (quack-kernels 0.4.x, CuTe DSL) with a tile
scheduler that reads its work items from a table and makes the TMA producer warp wait for each row tile's
counter. Imported by ``kernels.tile_gemm`` on first use (it loads QuACK and the CUTLASS DSL); the layout of
the table, the counters and their targets is documented there.

What changes against QuACK's ``GemmDefaultSm90`` with its ``VarlenMTileScheduler`` (static persistence):

- ``_delinearize_work_idx``: work index ``w`` -> ``tiles[w] = (expert, cluster row, column tile, first
  slot)``, one 16-byte vector load; an expert >= G (or ``w`` past the table) ends the cluster's loop.
  QuACK's own scheduler walks the experts' tile counts from ``cu_seqlens`` forward and cannot take an order.
- the scheduler's shared-memory hand-off (block zero's scheduler warp to every CTA of the cluster, four
  int32 per work item): its fourth word carries ``first slot + 1`` for a valid tile and 0 for the end, in
  place of QuACK's 0/1 valid flag (``write_work_tile_to_smem`` / ``get_current_work``), so every CTA knows
  its counter slot without a global load of its own: ``first slot + rank in the cluster``.
- ``initial_work_tile_info`` / ``get_current_work``: in the producer warp only (``ab_load_warp_id``), for a
  valid tile, spin on ``ld.acquire.gpu`` of ``counters[slot]`` until it reaches ``targets[slot]`` (the two
  loads independent of each other), then ``fence.proxy.async.global`` (the rows were written through the
  generic proxy, TMA reads them through the async one). The MMA and epilogue warps take the tile from the
  scheduler's pipeline as before; they need no wait of their own.
- ``epilogue`` (compiled in only when done counters are given): after QuACK's epilogue has issued a tile's
  TMA stores, the warp that issued them waits for the stores to complete (``cp.async.bulk.wait_group 0``,
  the writes done, not only the shared-memory reads that QuACK's ``.read`` wait covers), fences the async
  proxy against the generic one (``fence.proxy.async.global``: the TMA writes went through the async proxy,
  the release is a generic-proxy operation), and one lane adds 1 to ``done[base[expert] + pid_m]`` with
  release semantics at GPU scope. A row tile's output is complete once its slot holds its column-tile count.
  The wait is on the epilogue's TMA warp only: in pingpong the other warp group's MMA runs meanwhile; in
  the cooperative schedule the next tile's MMA starts one store latency later.

Everything else (TMA multicast of B across the cluster, pingpong or cooperative warp groups, the epilogue,
PDL) is QuACK's. The grid is ``min(max_active_clusters, work items)`` clusters, as in QuACK.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, const_expr
from cutlass._mlir import ir
from cutlass._mlir.dialects import vector
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values
from quack.cache_utils import jit_cache
from quack.compile_utils import make_fake_tensor
from quack.cute_dsl_utils import mlir_namedtuple, torch2cute_dtype_map
from quack.gemm_default_epi import GemmDefaultEpiMixin, GemmDefaultSm90
from quack.gemm_sm90 import GemmSm90
from quack.gemm_tvm_ffi_utils import compile_gemm_kernel, make_fake_gemm_tensors, make_fake_varlen_args
from quack.pipeline import PipelineStateWAdvance
from quack.rounding import RoundingMode
from quack.tile_scheduler import PersistenceMode, TileScheduler, VarlenMTileScheduler
from quack.utils import elem_pointer
from quack.varlen_utils import VarlenArguments

# QuACK's disk cache of compiled kernels keys on QuACK's sources; this file's digest joins the key
_SOURCE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


@mlir_namedtuple
class TileWaitOptions(NamedTuple):
    """The scheduler arguments of the waiting GEMM (in place of QuACK's ``TileSchedulerOptions``)."""

    max_active_clusters: Int32
    tiles: cute.Tensor  # int32 (W, 4), 16-byte rows: expert, cluster row, column tile, first counter slot
    counters: cute.Tensor  # int32 (S,)
    targets: cute.Tensor  # int32 (S,)
    done: Optional[cute.Tensor] = None  # int32 (S,): +1 per finished (row tile, column tile); or None
    base: Optional[cute.Tensor] = None  # int32 (G,): each expert's first counter slot (with ``done``)


@dataclass
class ArrivalTileSchedulerArguments:
    problem_shape_ntile_mnl: cute.Shape
    total_m: Int32
    tiles: cute.Tensor
    counters: cute.Tensor
    targets: cute.Tensor
    tile_shape_mn: cutlass.Constexpr[cute.Shape]
    cluster_shape_mnk: cutlass.Constexpr[cute.Shape]
    producer_warp: cutlass.Constexpr[int]
    done: Optional[cute.Tensor] = None
    base: Optional[cute.Tensor] = None


class SlotWorkTileInfo(cutlass.utils.WorkTileInfo):
    """QuACK's work tile (``(pid_m, pid_n, None, expert)``, valid) and the counter slot of its cluster's
    first row tile; this CTA's row tile waits on ``first_slot + pid_m % cluster_m``."""

    def __init__(self, tile_idx, is_valid_tile, first_slot):
        super().__init__(tile_idx, is_valid_tile)
        self.first_slot = Int32(first_slot)

    def __extract_mlir_values__(self) -> list:
        return super().__extract_mlir_values__() + extract_mlir_values(self.first_slot)

    def __new_from_mlir_values__(self, values: list) -> "SlotWorkTileInfo":
        tile = super().__new_from_mlir_values__(values[:-1])
        return SlotWorkTileInfo(
            tile.tile_idx, tile.is_valid_tile, new_from_mlir_values(self.first_slot, values[-1:])
        )


class _HandOff(NamedTuple):
    """What QuACK's ``write_work_tile_to_smem`` reads of a work tile: its fourth word is ours."""

    tile_idx: tuple
    is_valid_tile: Int32  # first slot + 1, or 0: no tile


class ArrivalTileScheduler(VarlenMTileScheduler):
    """QuACK's varlen-M scheduler (static persistence) visiting the work items of a table, its producer
    warp waiting for each row tile's arrival counter."""

    @dataclass
    class Params:
        # the names QuACK's inherited methods read (grid shape, CTA coordinates, the smem hand-off)
        problem_shape_ncluster_mnl: cute.Shape
        total_m: Int32
        tiles: cute.Tensor
        counters: cute.Tensor
        targets: cute.Tensor
        tile_shape_mn: cutlass.Constexpr[cute.Shape]
        cluster_shape_mnk: cutlass.Constexpr[cute.Shape]
        producer_warp: cutlass.Constexpr[int]
        persistence_mode: cutlass.Constexpr[PersistenceMode]
        done: Optional[cute.Tensor]  # read by the epilogue (TileWaitGemmSm90.epilogue), not the scheduler
        base: Optional[cute.Tensor]

        @staticmethod
        @cute.jit
        def create(
            args: ArrivalTileSchedulerArguments, *, loc=None, ip=None
        ) -> "ArrivalTileScheduler.Params":
            assert args.cluster_shape_mnk[1] == 1, "the waiting GEMM clusters along M only"
            problem_shape_ncluster_mnl = (
                None,
                args.problem_shape_ntile_mnl[1],
                args.problem_shape_ntile_mnl[2],
            )
            return ArrivalTileScheduler.Params(
                problem_shape_ncluster_mnl,
                args.total_m,
                args.tiles,
                args.counters,
                args.targets,
                args.tile_shape_mn,
                args.cluster_shape_mnk,
                args.producer_warp,
                PersistenceMode.STATIC,
                args.done,
                args.base,
            )

    @staticmethod
    def to_underlying_arguments(args: ArrivalTileSchedulerArguments, *, loc=None, ip=None) -> Params:
        return ArrivalTileScheduler.Params.create(args, loc=loc, ip=ip)

    @staticmethod
    @cute.jit
    def create(
        params: Params,
        sched_smem: Optional[cute.Tensor] = None,
        scheduler_pipeline: Optional[cutlass.pipeline.PipelineAsync] = None,
        is_scheduler_warp: bool = False,
        *,
        loc=None,
        ip=None,
    ) -> "ArrivalTileScheduler":
        assert sched_smem is not None and scheduler_pipeline is not None
        stages = const_expr(cute.size(sched_smem, mode=[1]))
        return ArrivalTileScheduler(
            Int32(cute.arch.cluster_idx()[2]),  # static persistence: cluster c starts at work item c
            Int32(0),  # num_tiles_executed
            Int32(0),  # current_batch_idx (unused)
            Int32(0),  # num_work_idx_before_cur_batch (unused)
            sched_smem,
            scheduler_pipeline,
            PipelineStateWAdvance(stages, Int32(0), Int32(0), Int32(0)),
            params,
            loc=loc,
            ip=ip,
        )

    @cute.jit
    def _delinearize_work_idx(
        self,
        work_idx: Int32,
        bidz: Optional[Int32] = None,  # not used
        is_valid_: Optional[cutlass.Boolean] = None,  # not used
        *,
        block_zero_only: bool = False,
        loc=None,
        ip=None,
    ) -> SlotWorkTileInfo:
        params = self.params
        num_batch = params.problem_shape_ncluster_mnl[2]
        batch_idx, cid_m, cid_n, first_slot = Int32(num_batch), Int32(0), Int32(0), Int32(0)
        if work_idx < cute.size(params.tiles, mode=[0]):
            # the whole row in one ld.global.v4 (the table is 16-byte aligned, rows of 16 bytes)
            row = cute.arch.load(
                elem_pointer(params.tiles, (work_idx, 0)), ir.VectorType.get([4], Int32.mlir_type)
            )
            batch_idx, cid_m, cid_n, first_slot = [
                Int32(vector.extract(row, dynamic_position=[], static_position=[i])) for i in range(4)
            ]
        is_valid = batch_idx < num_batch
        pid_m, pid_n = self._cluster_id_to_cta_id(
            cid_m, cid_n, block_zero_only=block_zero_only, loc=loc, ip=ip
        )
        return SlotWorkTileInfo((pid_m, pid_n, None, batch_idx), is_valid, first_slot)

    @cute.jit
    def write_work_tile_to_smem(self, work_tile_info: SlotWorkTileInfo, *, loc=None, ip=None):
        word = Int32(0)
        if work_tile_info.is_valid_tile:
            word = work_tile_info.first_slot + 1
        TileScheduler.write_work_tile_to_smem(self, _HandOff(work_tile_info.tile_idx, word), loc=loc, ip=ip)

    @cute.jit
    def _wait_for_rows(self, work_tile: SlotWorkTileInfo, *, loc=None, ip=None):
        """Producer warp: spin until this CTA's row tile has all its rows (acquire), then order the TMA
        loads that follow after the rows' generic-proxy writes."""
        params = self.params
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == params.producer_warp:
            if work_tile.is_valid_tile:
                slot = work_tile.first_slot + work_tile.tile_idx[0] % params.cluster_shape_mnk[0]
                target = params.targets[slot]
                counter = elem_pointer(params.counters, slot)
                arrived = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
                while arrived < target:
                    arrived = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
                cute.arch.fence_proxy("async.global")

    @cute.jit
    def initial_work_tile_info(self, *, loc=None, ip=None) -> SlotWorkTileInfo:
        work_tile = self._delinearize_work_idx(self._current_work_idx, loc=loc, ip=ip)
        self._wait_for_rows(work_tile)
        return work_tile

    @cute.jit
    def get_current_work(self, *, loc=None, ip=None) -> SlotWorkTileInfo:
        # QuACK's TileScheduler.get_current_work (static persistence), its fourth word decoded as ours
        params = self.params
        self._scheduler_pipeline.consumer_wait(self._pipeline_state)
        pid_m, pid_n, batch_idx, word = [self._sched_smem[i, self._pipeline_state.index] for i in range(4)]
        # the scheduler warp's remote stores to peer CTAs go through the async proxy
        if const_expr(cute.size(params.cluster_shape_mnk) > 1):
            cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()
        with cute.arch.elect_one():
            self._scheduler_pipeline.consumer_release(self._pipeline_state)
        self._pipeline_state.advance()
        work_tile = SlotWorkTileInfo((pid_m, pid_n, None, batch_idx), word > 0, word - 1)
        self._wait_for_rows(work_tile)
        return work_tile


class TileWaitGemmSm90(GemmDefaultSm90):
    """QuACK's sm_90 GEMM (default epilogue) scheduled by ``ArrivalTileScheduler``; varlen-M only."""

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mD: Optional[cute.Tensor],
        mC: Optional[cute.Tensor],
        epilogue_args: tuple,
        scheduler_args: TileWaitOptions,
        varlen_args: Optional[VarlenArguments],
        stream: cuda.CUstream,
        trace_ptr: Optional[cutlass.Int64] = None,
    ):
        # QuACK's host code, taking this class's scheduler arguments (the DSL checks the annotation of the
        # compiled entry point only)
        GemmSm90.__call__(self, mA, mB, mD, mC, epilogue_args, scheduler_args, varlen_args, stream, trace_ptr)

    @cute.jit
    def epilogue(
        self,
        params,
        epi_smem_tensors,
        epi_pipeline,
        epi_store_pipeline,
        epi_read_state,
        epi_producer_state,
        epi_tile,
        load_acc_subtile,
        tRS_rD,
        tRS_rC,
        tiled_copy_t2r,
        tiled_copy_r2s,
        tRS_sD,
        tiled_copy_s2r,
        tSR_rC,
        tSR_sC,
        copy_D,
        copy_C,
        tile_coord_mnkl,
        varlen_manager,
        epilogue_barrier,
        tile_scheduler,
        tidx,
        is_tma_warp,
    ):
        states = GemmDefaultSm90.epilogue(
            self,
            params,
            epi_smem_tensors,
            epi_pipeline,
            epi_store_pipeline,
            epi_read_state,
            epi_producer_state,
            epi_tile,
            load_acc_subtile,
            tRS_rD,
            tRS_rC,
            tiled_copy_t2r,
            tiled_copy_r2s,
            tRS_sD,
            tiled_copy_s2r,
            tSR_rC,
            tSR_sC,
            copy_D,
            copy_C,
            tile_coord_mnkl,
            varlen_manager,
            epilogue_barrier,
            tile_scheduler,
            tidx,
            is_tma_warp,
        )
        sched = tile_scheduler.params
        if const_expr(sched.done is not None):
            if is_tma_warp:
                # every lane waits for the bulk stores it issued (the TMA lane's wait is the one that
                # blocks); the writes are then complete and, after the proxy fence, ordered before the
                # generic-proxy release below
                cute.arch.cp_async_bulk_wait_group(0, read=False)
                cute.arch.fence_proxy("async.global")
                cute.arch.sync_warp()
                with cute.arch.elect_one():
                    slot = sched.base[tile_coord_mnkl[3]] + tile_coord_mnkl[0]
                    cute.arch.atomic_add(elem_pointer(sched.done, slot), Int32(1), sem="release", scope="gpu")
        return states

    def get_scheduler_class(self, varlen_m: bool = False):
        assert varlen_m, "the waiting GEMM is varlen-M (cu_seqlens_m)"
        return ArrivalTileScheduler

    def get_scheduler_arguments(self, mA, mB, mD, scheduler_args, varlen_args, epilogue_args):
        assert self.is_persistent and not self.gather_A and mD is not None
        return ArrivalTileSchedulerArguments(
            problem_shape_ntile_mnl=(
                None,
                cute.ceil_div(cute.size(mB, mode=[0]), self.cta_tile_shape_mnk[1]),
                varlen_args.mCuSeqlensM.shape[0] - 1,
            ),
            total_m=mD.shape[0],
            tiles=scheduler_args.tiles,
            counters=scheduler_args.counters,
            targets=scheduler_args.targets,
            tile_shape_mn=self.cta_tile_shape_mnk[:2],
            cluster_shape_mnk=self.cluster_shape_mnk,
            producer_warp=self.ab_load_warp_id,
            done=scheduler_args.done,
            base=scheduler_args.base,
        )


@jit_cache
def compile_tile_gemm(
    a_dtype, b_dtype, d_dtype, b_major, tile_shape_mn, cluster_m, pingpong, release_done, source_digest
):
    """One compiled variant (symbolic M, N, K, G, W, S): bf16/fp16 A K-major, B ``b_major`` ("k" or "n"),
    D N-major; ``release_done``: the epilogue releases done counters (a separate kernel: without it the
    epilogue is QuACK's). ``source_digest`` keys QuACK's disk cache on this file's contents."""
    mA, mB, mD, _, _, _, _, _ = make_fake_gemm_tensors(
        a_dtype, b_dtype, d_dtype, None, "k", b_major, "n", None, varlen_m=True
    )
    epi_args = GemmDefaultSm90.EpilogueArguments(rounding_mode=RoundingMode.RN)
    num_slots = cute.sym_int()
    done = base = None
    if release_done:
        done = make_fake_tensor(Int32, (num_slots,), leading_dim=0)
        base = make_fake_tensor(Int32, (cute.sym_int(),), leading_dim=0)
    sched_args = TileWaitOptions(
        max_active_clusters=Int32(1),
        # rows of 16 bytes on a 16-byte boundary: one vector load per row (tile_grouped_mm checks it)
        tiles=cute.runtime.make_fake_tensor(Int32, (cute.sym_int(), 4), stride=(4, 1), assumed_align=16),
        counters=make_fake_tensor(Int32, (num_slots,), leading_dim=0),
        targets=make_fake_tensor(Int32, (num_slots,), leading_dim=0),
        done=done,
        base=base,
    )
    return compile_gemm_kernel(
        TileWaitGemmSm90,
        a_dtype,
        tile_shape_mn,
        (cluster_m, 1, 1),
        pingpong,
        True,  # persistent
        False,  # gather_A
        False,  # dynamic persistence
        (9, 0),
        mA,
        mB,
        mD,
        None,
        epi_args,
        sched_args,
        make_fake_varlen_args(True, False, False, None),
    )


def b_major_of(b_GKN: torch.Tensor) -> str:
    """B's major mode: ``"k"`` when K is contiguous (fc1's ``w1.mT``), ``"n"`` when N is (``w2`` in fc2's
    input gradient)."""
    if b_GKN.stride(1) == 1:
        return "k"
    if b_GKN.stride(2) == 1:
        return "n"
    raise ValueError(f"tile_grouped_mm: b has strides {b_GKN.stride()}; K or N must be contiguous")


def compile_for(a_dtype: torch.dtype, b_major: str, config, release_done: bool = False) -> object:
    """The compiled kernel for operands of ``a_dtype``, B ``b_major`` and a ``TileConfig``; with
    ``release_done``, the variant whose epilogue releases done counters."""
    dt = torch2cute_dtype_map[a_dtype]
    return compile_tile_gemm(
        dt,
        dt,
        dt,
        b_major,
        (config.tile_m, config.tile_n),
        config.cluster_m,
        config.pingpong,
        release_done,
        _SOURCE_DIGEST,
    )


def launch(a_MK, b_GKN, out_MN, plan, counters_S, max_clusters: int, done_S=None) -> None:
    """One launch on the current stream (inputs checked by ``tile_gemm.tile_grouped_mm``); ``done_S``
    int32 [S] or None: the counters the epilogue releases."""
    compiled = compile_for(a_MK.dtype, b_major_of(b_GKN), plan.config, release_done=done_S is not None)
    b_NKG = b_GKN.mT.permute(1, 2, 0)  # QuACK's (N, K, L)
    epi_args = GemmDefaultEpiMixin.EpilogueArguments(
        alpha=None,
        beta=None,
        mRowVecBroadcast=None,
        mColVecBroadcast=None,
        add_to_output=None,
        rounding_mode=None,
        sr_seed=None,
    )
    sched_args = TileWaitOptions(
        max_active_clusters=Int32(max_clusters),
        tiles=plan.tiles_W4,
        counters=counters_S,
        targets=plan.targets_S,
        done=done_S,
        base=None if done_S is None else plan.base_G,
    )
    varlen_args = VarlenArguments(mCuSeqlensM=plan.cu_G1, mCuSeqlensK=None, mAIdx=None)
    compiled(a_MK, b_NKG, out_MN, None, epi_args, sched_args, varlen_args, None)
