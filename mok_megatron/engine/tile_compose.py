"""One layer's expert forward and backward on the tile-level overlap kernels, composed: the waiting grouped GEMM
(``kernels.tile_gemm``), the pull of exchanged rows into the expert-sorted receive buffer
(``kernels.tile_pull``) and the completion-driven combine (``kernels.tile_combine``). ``engine.tiles`` runs
a layer call on it (the combine after the GEMM); ``benchmarks/tile_layer.py`` times it against the plain layer
(the combine after, or beside).

Legend: P source ranks, G local experts, H hidden, F expert FFN width, M received rows (expert-major), T
tokens, K routes per token (top-k), S counter slots.

    forward   fc1 on the waiting GEMM (``SMs - k``) beside the pull of the remote sources' rows (k programs)
              -> SwiGLU x probability (``kernels.swiglu``, the torch backend's) -> fc2 on all SMs, then
              ``kernels.combine`` (``combine="after"``), or fc2 on the waiting GEMM releasing done counters
              beside the tile combine (``"beside"``: each token's sum over its routes once its row tiles are
              stored)
    backward  fc2's input gradient ``dy @ w2`` on the waiting GEMM beside the pull of the output gradient's
              remote rows -> SwiGLU's backward (the probability gradient too) -> fc1's input gradient
              ``dh @ w1`` on all SMs, then the combine (the dispatch's adjoint: each token's sum over its
              routes), or releasing done counters beside the tile combine; the weight gradients ``dy^T a``
              and ``dh^T x`` beside them on a third stream or after them

The combine beside the GEMM is slower than the GEMM on all SMs followed by the full-device combine at every
K measured (one H200, forward, counters preset, no pull; ``docs/results/2026-12-03-tile-layer-forward/``):
a token's routes span all experts, so most tokens are complete only once fc2's last tiles are, and the
combine's bytes then move on K SMs. The tiles engine holds SMs back only beside a pull.

The rank's own rows (source ``local``) cross no link: they are placed in the receive buffer before the call
and the arrival counters start from their rows (``LayerPlan.local_counts_S``); the pull moves the other
sources' rows. ``pull=False``: every row is in place and the counters start at their targets, so nothing
waits. ``copy="none"`` (``tile_pull``'s link-only path): every row is in place as without a pull, but the
counters start from the local rows and the pull's programs release the rest at the link's pace without
moving a byte, so the waiting GEMM sees the schedule of a link whose bytes cost this rank nothing.

Every step runs on the kernels (``KERNELS``: sm_90 with QuACK; the GEMM launched first on the current stream
and the pull or the combine after it on a side stream, on the K SMs the GEMM leaves free: fc1 waits on the
pull, the combine on fc2, and a GEMM that waits on nothing goes first so it holds its SMs) or on their pure-torch
references (``REFERENCES``: in turn, the releasing step first; CPU and any device), which is how the CPU
tests check the composition.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch

from mok_megatron.kernels import tile_combine as tc
from mok_megatron.kernels import tile_gemm as tg
from mok_megatron.kernels import tile_pull as tp
from mok_megatron.kernels.combine import combine, combine_reference
from mok_megatron.kernels.routing import RoutingMeta
from mok_megatron.kernels.swiglu import swiglu, swiglu_backward, swiglu_backward_reference, swiglu_reference

CHUNK_ROWS = 64  # rows per pulled chunk
LOCAL = 0  # the source that is this rank
COMBINES = ("beside", "after")
WGRADS = ("beside", "after")


# ---- the plan --------------------------------------------------------------------------------------------


def only_sources(plan: tp.PullPlan, keep_P: torch.Tensor) -> tp.PullPlan:
    """``plan`` with the chunks of the sources ``keep_P`` (bool [P]) only, in their order, the others turned
    into end rows (0, G, 0, ...) after them. Sync-free."""
    t = plan.tasks_C8
    live = t[:, tp.ROWS] > 0
    keep = live & keep_P.to(t.device)[t[:, tp.SOURCE].long()]
    end = torch.zeros_like(t[0])
    end[tp.EXPERT] = plan.groups
    t = torch.where(keep[:, None], t, end)
    order = torch.argsort((~keep).to(torch.int8), stable=True)
    return dataclasses.replace(plan, tasks_C8=t[order].contiguous())


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What one forward reads besides its buffers, all on the counts' device.

    pull            the remote sources' chunks (``only_sources``): what the K programs move
    local           the local source's chunks: placed before the layer
    local_counts_S  int32 [S]: the arrival counters once the local rows are placed (the pull adds the rest)
    fc1, fc2        the waiting GEMMs' plans (QuACK's order, one configuration: one counter layout); fc2's
                    (N = H) is also fc1's input gradient's, whose done counters the backward's tile combine
                    reads (the same row tiles, the same column tiles)
    dgrad2          fc2's input gradient's waiting GEMM (``dy_MH @ w2``, N = F): the backward's first GEMM,
                    on the same counters as fc1 (the output gradient's rows arrive as the forward's did)
    meta            the tokens' routes into the expert-major rows
    slot_TK         int32 [T, K]: each route's done slot in fc2's output (``tile_combine.token_slots``)
    order_T         int32 [T]: the combine's visiting order, as fc2's tiles complete (``token_order``)
    remote_bytes    bytes the pull moves (host int): the link's bytes
    """

    pull: tp.PullPlan
    local: tp.PullPlan
    local_counts_S: torch.Tensor
    fc1: tg.TilePlan
    fc2: tg.TilePlan
    dgrad2: tg.TilePlan
    meta: RoutingMeta
    slot_TK: torch.Tensor
    order_T: torch.Tensor
    remote_bytes: int


def layer_plan(
    c_PG: torch.Tensor,
    hidden: int,
    ffn: int,
    meta: RoutingMeta,
    config: tg.TileConfig,
    chunk_rows: int = CHUNK_ROWS,
    elem_bytes: int = 2,
    local: int = LOCAL,
) -> LayerPlan:
    """The plan of one forward over the rows ``c_PG[p, g]`` that each source sends each local expert, source
    ``local`` being this rank; rows of ``hidden`` elements of ``elem_bytes``; fc1 ``2 * ffn`` wide; ``meta``
    the tokens' routes into the expert-major rows (the combine's). Reads the row count on the host."""
    if c_PG.dim() != 2 or not 0 <= local < c_PG.shape[0]:
        raise ValueError(
            f"layer_plan: c_PG {tuple(c_PG.shape)}, local={local}; c_PG must be [P, G] and local a source in "
            f"[0, P)"
        )
    rows = int(c_PG.sum())
    full = tp.pull_plan(c_PG, rows, config, chunk_rows)
    mine = torch.zeros(c_PG.shape[0], dtype=torch.bool, device=c_PG.device)
    mine[local] = True
    own = only_sources(full, mine)
    fc2 = tg.tile_plan(full.offs_G, rows, hidden, config)
    slot_TK = tc.token_slots(meta, fc2)
    return LayerPlan(
        pull=only_sources(full, ~mine),
        local=own,
        local_counts_S=tp.slot_releases(own),
        fc1=tg.tile_plan(full.offs_G, rows, 2 * ffn, config),
        fc2=fc2,
        dgrad2=tg.tile_plan(full.offs_G, rows, ffn, config),
        meta=meta,
        slot_TK=slot_TK,
        order_T=tc.token_order(slot_TK, tg.slot_done_rank(fc2)),
        remote_bytes=(rows - int(c_PG[local].sum())) * hidden * elem_bytes,
    )


def local_rows(c_PG: torch.Tensor, rows: int, local: int = LOCAL) -> torch.Tensor:
    """int64 [rows]: the receive buffer's row of each of source ``local``'s ``rows`` rows (``c_PG[local]``'s
    total), in its buffer's order (grouped by local expert): where the rank's own rows are placed. Sync-free."""
    c = c_PG[local].long()
    g_N = torch.repeat_interleave(torch.arange(c.numel(), device=c.device), c, output_size=rows)
    shift_G = tp.receive_rows(c_PG)[local] - tp.source_rows(c_PG)[local]
    return shift_G[g_N] + torch.arange(rows, device=c.device)


@dataclasses.dataclass(frozen=True)
class LayerInputs:
    """sources   P send buffers: source p's rows for this rank grouped by local expert, [rows of p, H]
    table_P   int64 [P] their base addresses (``tile_pull.source_table``; the GPU pull reads through it)
    w1_G2FH   fc1 weights [G, 2F, H] (gate rows, then up rows: Megatron's layout)
    w2_GHF    fc2 weights [G, H, F]
    probs_M   fp32 [M] each received row's router probability (applied in SwiGLU, as the torch backend)"""

    sources: tuple[torch.Tensor, ...]
    table_P: torch.Tensor
    w1_G2FH: torch.Tensor
    w2_GHF: torch.Tensor
    probs_M: torch.Tensor


@dataclasses.dataclass(frozen=True)
class LayerBuffers:
    """What a tiles forward writes: the receive buffer (local rows placed), fc1's output, fc2's output, the
    arrival counters and fc2's done counters."""

    recv_MH: torch.Tensor
    h_M2F: torch.Tensor
    y_MH: torch.Tensor
    counters_S: torch.Tensor
    done_S: torch.Tensor


def _received(
    sources: tuple[torch.Tensor, ...], plan: LayerPlan, hidden: int, proto: torch.Tensor
) -> torch.Tensor:
    """[M, H]: an exchange's receive buffer with this rank's own rows placed, the remote rows NaN (a tile
    loaded before its rows arrive carries NaN into the output)."""
    recv = proto.new_full((plan.pull.rows, hidden), float("nan"))
    tp.pull_reference(recv, sources, plan.local, torch.zeros_like(plan.local_counts_S))
    return recv


def layer_buffers(x: LayerInputs, plan: LayerPlan) -> LayerBuffers:
    """Fresh buffers, the local rows placed (the remote rows NaN)."""
    rows, hidden = plan.pull.rows, x.w1_G2FH.shape[2]
    proto = x.sources[0]
    recv = _received(x.sources, plan, hidden, proto)
    return LayerBuffers(
        recv_MH=recv,
        h_M2F=proto.new_empty(rows, x.w1_G2FH.shape[1]),
        y_MH=proto.new_empty(rows, hidden),
        counters_S=plan.local_counts_S.clone(),
        done_S=torch.zeros_like(plan.local_counts_S),
    )


@dataclasses.dataclass(frozen=True)
class BackwardInputs:
    """What one backward reads besides the weights and probabilities of ``LayerInputs``.

    dy_TH     the output gradient [T, H] (the tokens of ``LayerPlan.meta``)
    sources   P send buffers of the output-gradient exchange: each route's copy of its token's dy row
              (probabilities apply inside SwiGLU, so the row is dy itself), source p's rows for this rank
              grouped by local expert (the forward's layout: the same pull plan moves them)
    table_P   int64 [P] their base addresses
    x_MH      the forward's received rows (saved: fc1's weight gradient)
    h_M2F     fc1's output (saved: SwiGLU's backward)
    a_MF      SwiGLU's output (saved: fc2's weight gradient)"""

    dy_TH: torch.Tensor
    sources: tuple[torch.Tensor, ...]
    table_P: torch.Tensor
    x_MH: torch.Tensor
    h_M2F: torch.Tensor
    a_MF: torch.Tensor


@dataclasses.dataclass(frozen=True)
class BackwardBuffers:
    """What a tiles backward writes: the output gradient's receive buffer (local rows placed), fc2's input
    gradient, fc1's input gradient (expert-major rows), the arrival counters and fc1 dgrad's done counters."""

    dy_MH: torch.Tensor
    da_MF: torch.Tensor
    dx_MH: torch.Tensor
    counters_S: torch.Tensor
    done_S: torch.Tensor


def backward_buffers(bx: BackwardInputs, x: LayerInputs, plan: LayerPlan) -> BackwardBuffers:
    """Fresh buffers, the local rows of the output gradient placed (the remote rows NaN)."""
    rows, hidden = plan.pull.rows, x.w1_G2FH.shape[2]
    proto = bx.dy_TH
    dy = _received(bx.sources, plan, hidden, proto)
    return BackwardBuffers(
        dy_MH=dy,
        da_MF=proto.new_empty(rows, x.w2_GHF.shape[2]),
        dx_MH=proto.new_empty(rows, hidden),
        counters_S=plan.local_counts_S.clone(),
        done_S=torch.zeros_like(plan.local_counts_S),
    )


@dataclasses.dataclass(frozen=True)
class Gradients:
    """One backward's results: dx_TH [T, H] (each token's sum over its routes: the dispatch's adjoint),
    dprobs_M fp32 [M] (each received row's probability), dw1_G2FH and dw2_GHF (the weights' gradients)."""

    dx_TH: torch.Tensor
    dprobs_M: torch.Tensor
    dw1_G2FH: torch.Tensor
    dw2_GHF: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# ---- the kernels, or their references ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ops:
    """The kernels one forward runs. ``concurrent``: a GEMM and the pull or combine beside it run at once
    (the GEMM launched first, the other on the side stream); otherwise each runs to its end in turn, the
    releasing one first (the references cannot wait)."""

    concurrent: bool
    grouped_mm: Callable  # (a_MK, b_GKN, offs_G) -> [M, N]
    swiglu: Callable  # (h_M2F, probs_M) -> [M, F]
    combine: Callable  # (y_MH, meta) -> [T, H]
    tile_mm: Callable  # (a_MK, b_GKN, plan, counters_S, k, out, done_S) -> out
    pull: Callable  # (recv_MH, inputs, pull plan, counters_S, k, rate, copy, preload=False) -> None
    tile_combine: Callable  # (y_MH, meta, slot_TK, done_S, target_S, order_T, k, preload=False) -> [T, H]
    swiglu_backward: Callable  # (h_M2F, probs_M, da_MF) -> (dh_M2F, dprobs_M)
    wgrad: Callable  # (dy_MN, x_MK, offs_G) -> [G, N, K]: each group's dy^T x (grouped along the rows)


def _tile_mm_reference(a, b, plan, counters, k, out, done=None):
    out.copy_(tg.tile_gemm_reference(a, b, plan.cu_G1[1:], plan, counters))
    if done is not None:
        done += tg.done_counts_reference(plan).to(done.device)
    return out


def wgrad_reference(dy_MN: torch.Tensor, x_MK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(dy_MN.t(), x_MK, offs=offs_G)`` in fp32 matmuls per group, cast to dy's dtype
    (groups without rows: zeros)."""
    out = torch.zeros(offs_G.numel(), dy_MN.shape[1], x_MK.shape[1], dtype=torch.float32, device=dy_MN.device)
    start = 0
    for g, end in enumerate(offs_G.tolist()):
        out[g] = dy_MN[start:end].float().t() @ x_MK[start:end].float()
        start = end
    return out.to(dy_MN.dtype)


def _pull_reference(recv, x, plan, counters, k, rate, copy, preload=False):
    """``tile_pull``'s reference: every path copies the same rows (``pull_reference``), but copy="none" moves
    none: the rows are in place and the pull only releases what it would add (``slot_releases``)."""
    if preload:  # nothing to load: the reference runs in order, after the GEMM it would feed
        return
    if rate:
        raise ValueError(f"pull_reference: rate={rate:g}; the reference cannot pace: pass rate=0")
    if copy == "none":
        if counters.shape != (plan.slots,):
            raise ValueError(
                f"pull_reference: counters {tuple(counters.shape)}, the plan {plan.slots} slots; pass the "
                f"plan's counters ({plan.slots},)"
            )
        counters += tp.slot_releases(plan).to(counters.device)
        return
    tp.pull_reference(recv, x.sources, plan, counters)


REFERENCES = Ops(
    concurrent=False,
    grouped_mm=tg.grouped_mm_reference,
    swiglu=swiglu_reference,
    combine=combine_reference,
    tile_mm=_tile_mm_reference,
    pull=_pull_reference,
    tile_combine=lambda y, meta, slot, done, target, order, k, preload=False: (
        None if preload else tc.tile_combine_reference(y, meta, slot, done, target)
    ),
    swiglu_backward=swiglu_backward_reference,
    wgrad=wgrad_reference,
)

KERNELS = Ops(
    concurrent=True,
    grouped_mm=lambda a, b, offs: torch._grouped_mm(a, b, offs=offs),
    swiglu=swiglu,
    combine=combine,
    tile_mm=lambda a, b, plan, counters, k, out, done=None: tg.tile_grouped_mm(
        a, b, plan, counters, sms_held_back=k, out=out, done_S=done
    ),
    pull=lambda recv, x, plan, counters, k, rate, copy, preload=False: tp.tile_pull(
        recv, x.table_P, plan, counters, programs=k, rate=rate, copy=copy, preload=preload
    ),
    tile_combine=lambda y, meta, slot, done, target, order, k, preload=False: tc.tile_combine(
        y, meta, slot, done, target, order_T=order, programs=k, preload=preload
    ),
    swiglu_backward=swiglu_backward,
    wgrad=lambda dy, x, offs: torch._grouped_mm(dy.t(), x, offs=offs),
)


# ---- the compositions --------------------------------------------------------------------------------------


def plain_forward(recv_MH: torch.Tensor, x: LayerInputs, plan: LayerPlan, ops: Ops = KERNELS) -> torch.Tensor:
    """[T, H]: the plain layer without communication over the received rows ``recv_MH``."""
    offs = plan.fc1.cu_G1[1:]
    h = ops.grouped_mm(recv_MH, x.w1_G2FH.mT, offs)
    a = ops.swiglu(h, x.probs_M)
    return ops.combine(ops.grouped_mm(a, x.w2_GHF.mT, offs), plan.meta)


def _pair(ops: Ops, waiting: Callable, releasing: Callable | None) -> None:
    """``waiting`` (a kernel that spins until ``releasing`` has run) and ``releasing``: on the kernels, the
    releasing kernel loaded first by a launch that does nothing (``releasing(preload=True)``: CUDA loads a
    kernel at its first launch and that load may wait for the device to go idle, which the spinning kernel
    never lets it), then the waiting one, then the releasing one beside it; on the references, in order."""
    if releasing is None:
        waiting()
    elif ops.concurrent:
        releasing(preload=True)
        waiting()
        releasing()
    else:
        releasing()
        waiting()


def _combine_beside(ops: Ops, y_MH, plan: LayerPlan, buf: LayerBuffers, k: int, releasing: Callable, main,
                    side, on_side) -> torch.Tensor:  # fmt: skip
    """[T, H]: ``releasing`` (a GEMM storing ``y_MH``'s row tiles and releasing done counters) with the tile
    combine beside it on ``side``: the combine preloaded (``_pair``; its unwritten output let go at once),
    the GEMM launched (it waits on nothing, so it holds its SMs first), then the combine on the K SMs it
    leaves."""
    if side is not None:
        side.wait_stream(main)

    def sum_tokens(preload=False):
        with on_side():
            return ops.tile_combine(
                y_MH, plan.meta, plan.slot_TK, buf.done_S, plan.fc2.done_targets_S, plan.order_T, k,
                preload=preload,
            )  # fmt: skip

    sum_tokens(preload=True)
    releasing()
    return sum_tokens()


def _apart(op: str, side, main) -> None:
    """Refuses a side stream that is the current one: the kernel launched there beside a waiting GEMM would
    queue behind it, and the GEMM would wait forever."""
    if side is not None and side == main:
        raise ValueError(
            f"{op}: side is the current stream; the pull or combine beside the waiting GEMM must run on "
            "another stream (a waiting kernel launched first on one stream waits forever): pass a stream "
            "other than torch.cuda.current_stream()"
        )


def tiles_forward(
    buf: LayerBuffers,
    x: LayerInputs,
    plan: LayerPlan,
    ops: Ops = KERNELS,
    *,
    k: int,
    rate: float = 0.0,
    pull: bool = True,
    combine: str = "beside",
    copy: str = tp.COPIES[0],
    side: torch.cuda.Stream | None = None,
) -> torch.Tensor:
    """[T, H]: the tiles layer, on the current stream and ``side`` (the concurrent ops' second stream: needed
    with the kernels for a pull or ``combine="beside"``).

    1. arrival counters <- the local rows' counts (``pull``) or fc1's targets (``pull=False``: every row
       must be in ``buf.recv_MH`` already); done <- 0
    2. fc1 on the waiting GEMM (``SMs - k``), beside it the pull of the remote rows (k programs, ``rate``
       bytes/s, 0: unpaced; ``copy``: ``tile_pull``'s copy path; "none": every row must be in
       ``buf.recv_MH`` already, the pull only paces and releases the counters) on ``side``
    3. SwiGLU x probability
    4. ``combine="after"``: fc2 on the tile GEMM on all SMs (its input complete), then the combine on the
       full device; ``"beside"``: fc2 on the tile GEMM (``SMs - k``) releasing done counters, beside it the
       tile combine (k programs) on ``side``
    Returns once both streams' work is queued; the result is ready on the current stream."""
    if combine not in COMBINES:
        raise ValueError(f"tiles_forward: combine={combine!r}; it must be one of {', '.join(COMBINES)}")
    if copy not in tp.COPIES:
        raise ValueError(f"tiles_forward: copy={copy!r}; it must be one of {', '.join(tp.COPIES)}")
    if ops.concurrent and side is None and (pull or combine == "beside"):
        raise ValueError(
            "tiles_forward: concurrent kernels need a side stream for a pull or combine='beside' "
            "(side=torch.cuda.Stream()); on one stream a waiting kernel launched first waits forever"
        )
    main = torch.cuda.current_stream() if side is not None else None
    _apart("tiles_forward", side, main)
    on_side = (lambda: torch.cuda.stream(side)) if side is not None else contextlib.nullcontext
    buf.counters_S.copy_(plan.local_counts_S if pull else plan.fc1.targets_S)
    buf.done_S.zero_()
    if side is not None:
        side.wait_stream(main)

    def fc1():  # K SMs held back only for a pull beside it
        ops.tile_mm(buf.recv_MH, x.w1_G2FH.mT, plan.fc1, buf.counters_S, k if pull else 0, buf.h_M2F)

    def pull_rows(preload=False):
        with on_side():
            ops.pull(buf.recv_MH, x, plan.pull, buf.counters_S, k, rate, copy, preload=preload)

    _pair(ops, fc1, pull_rows if pull else None)
    a = ops.swiglu(buf.h_M2F, x.probs_M)
    arrived = plan.fc2.targets_S  # fc2's input is complete: SwiGLU ran to its end before it
    if combine == "after":
        ops.tile_mm(a, x.w2_GHF.mT, plan.fc2, arrived, 0, buf.y_MH)
        out = ops.combine(buf.y_MH, plan.meta)
    else:

        def fc2():
            ops.tile_mm(a, x.w2_GHF.mT, plan.fc2, arrived, k, buf.y_MH, buf.done_S)

        out = _combine_beside(ops, buf.y_MH, plan, buf, k, fc2, main, side, on_side)
    if side is not None:
        main.wait_stream(side)
        out.record_stream(main)
    return out


def plain_backward(
    dy_MH: torch.Tensor, bx: BackwardInputs, x: LayerInputs, plan: LayerPlan, ops: Ops = KERNELS
) -> Gradients:
    """The plain backward without communication over the received output gradient ``dy_MH``, in autograd's
    order: fc2's input gradient, fc2's weight gradient, SwiGLU's backward, fc1's input gradient, fc1's weight
    gradient, the per-token sum."""
    offs = plan.fc1.cu_G1[1:]
    da = ops.grouped_mm(dy_MH, x.w2_GHF, offs)
    dw2 = ops.wgrad(dy_MH, bx.a_MF, offs)
    dh, dprobs = ops.swiglu_backward(bx.h_M2F, x.probs_M, da)
    dx = ops.grouped_mm(dh, x.w1_G2FH, offs)
    dw1 = ops.wgrad(dh, bx.x_MH, offs)
    return Gradients(ops.combine(dx, plan.meta), dprobs, dw1, dw2)


def tiles_backward(
    buf: BackwardBuffers,
    bx: BackwardInputs,
    x: LayerInputs,
    plan: LayerPlan,
    ops: Ops = KERNELS,
    *,
    k: int,
    rate: float = 0.0,
    pull: bool = True,
    combine: str = "beside",
    wgrad: str = "beside",
    copy: str = tp.COPIES[0],
    side: torch.cuda.Stream | None = None,
    wgrad_stream: torch.cuda.Stream | None = None,
) -> Gradients:
    """The tiles backward, on the current stream, ``side`` (the concurrent ops' second stream: needed with the
    kernels for a pull or ``combine="beside"``) and ``wgrad_stream`` (the weight gradients',
    ``wgrad="beside"``).

    1. arrival counters <- the local rows' counts (``pull``) or their targets (``pull=False``: every row of
       the output gradient must be in ``buf.dy_MH`` already); done <- 0
    2. fc2's input gradient ``dy_MH @ w2`` on the waiting GEMM (``SMs - k``, B N-major), beside it the pull
       of the output gradient's remote rows (k programs, ``rate`` bytes/s, 0: unpaced; ``copy``: the pull's
       copy path; "none": every row must be in ``buf.dy_MH`` already, the pull only paces and releases the
       counters) on ``side``
    3. ``wgrad="beside"``: fc2's weight gradient ``dy^T a`` (``torch._grouped_mm``) on ``wgrad_stream`` once
       the pull has ended: it reads every row, nothing else
    4. SwiGLU's backward (with the probabilities: the probability gradient too); ``"beside"``: fc1's weight
       gradient ``dh^T x`` on ``wgrad_stream`` after it
    5. ``combine="after"``: fc1's input gradient ``dh @ w1`` on the tile GEMM on all SMs (nothing to wait
       on), then the combine on the full device: each token's sum over its routes; ``"beside"``: the GEMM on
       ``SMs - k`` releasing done counters, beside it the tile combine (k programs) on ``side``
    6. ``wgrad="after"``: both weight gradients, in turn, on the current stream
    Returns once every stream's work is queued; the results are ready on the current stream."""
    if combine not in COMBINES:
        raise ValueError(f"tiles_backward: combine={combine!r}; it must be one of {', '.join(COMBINES)}")
    if wgrad not in WGRADS:
        raise ValueError(f"tiles_backward: wgrad={wgrad!r}; it must be one of {', '.join(WGRADS)}")
    if copy not in tp.COPIES:
        raise ValueError(f"tiles_backward: copy={copy!r}; it must be one of {', '.join(tp.COPIES)}")
    if ops.concurrent and (
        (side is None and (pull or combine == "beside")) or (wgrad == "beside" and wgrad_stream is None)
    ):
        raise ValueError(
            "tiles_backward: concurrent kernels need a side stream and, with wgrad='beside', a weight-gradient "
            "stream (side=torch.cuda.Stream() for a pull or combine='beside', "
            "wgrad_stream=torch.cuda.Stream()); on one stream a waiting kernel launched first waits forever"
        )
    offs = plan.fc1.cu_G1[1:]
    aside = wgrad == "beside" and wgrad_stream is not None
    main = torch.cuda.current_stream() if side is not None or aside else None
    _apart("tiles_backward", side, main)
    on_side = (lambda: torch.cuda.stream(side)) if side is not None else contextlib.nullcontext
    on_wgrad = (lambda: torch.cuda.stream(wgrad_stream)) if aside else contextlib.nullcontext
    buf.counters_S.copy_(plan.local_counts_S if pull else plan.dgrad2.targets_S)
    buf.done_S.zero_()
    if side is not None:
        side.wait_stream(main)

    def dgrad2():  # K SMs held back only for a pull beside it
        ops.tile_mm(buf.dy_MH, x.w2_GHF, plan.dgrad2, buf.counters_S, k if pull else 0, buf.da_MF)

    def pull_rows(preload=False):
        with on_side():
            ops.pull(buf.dy_MH, bx, plan.pull, buf.counters_S, k, rate, copy, preload=preload)

    _pair(ops, dgrad2, pull_rows if pull else None)
    grads = {}
    if wgrad == "beside":
        if aside:
            wgrad_stream.wait_stream(side if pull and side is not None else main)
        with on_wgrad():
            grads["dw2"] = ops.wgrad(buf.dy_MH, bx.a_MF, offs)
    dh, dprobs = ops.swiglu_backward(bx.h_M2F, x.probs_M, buf.da_MF)
    if wgrad == "beside":
        if aside:
            wgrad_stream.wait_stream(main)
            dh.record_stream(wgrad_stream)
        with on_wgrad():
            grads["dw1"] = ops.wgrad(dh, bx.x_MH, offs)
    if combine == "after":
        ops.tile_mm(dh, x.w1_G2FH, plan.fc2, plan.fc2.targets_S, 0, buf.dx_MH)
        dx = ops.combine(buf.dx_MH, plan.meta)
    else:

        def dgrad1():  # its rows are all there: SwiGLU's backward ran to its end before it
            ops.tile_mm(dh, x.w1_G2FH, plan.fc2, plan.fc2.targets_S, k, buf.dx_MH, buf.done_S)

        dx = _combine_beside(ops, buf.dx_MH, plan, buf, k, dgrad1, main, side, on_side)
    if wgrad == "after":
        grads["dw2"] = ops.wgrad(buf.dy_MH, bx.a_MF, offs)
        grads["dw1"] = ops.wgrad(dh, bx.x_MH, offs)
    if side is not None:
        main.wait_stream(side)
        dx.record_stream(main)
    if aside:
        main.wait_stream(wgrad_stream)
        for g in grads.values():
            g.record_stream(main)
    return Gradients(dx, dprobs, grads["dw1"], grads["dw2"])
