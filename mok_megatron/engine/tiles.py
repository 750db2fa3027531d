"""The tiles engine (``--mok-engine tiles``): a layer call's experts on the tile-level overlap kernels,
forward and backward composed as in ``engine.tile_compose``, inside one autograd node.

Legend: T tokens (or received rows), K routes per token, G local experts, H hidden, F expert FFN width on this
rank, M expert-major rows, S counter slots, P source ranks of the received rows (source 0 this rank), N live
routes.

    EP = 1     x_TH, probs_TK --(rows placed by the routing kernels' plan, ``DispatchPlan.meta``)--> x_MH
               -> fc1 -> SwiGLU x probability -> fc2 -> each token's sum over its routes: out_TH
    EP > 1     the plain engine's dispatch (all-to-all, sort by local expert) -> the same node over the
               received rows, each row its own token (K = 1) -> the plain engine's combine

Where each step runs (``TilesConfig.kernels``, decided when the layer is built):

- kernels: an sm_90 GPU with QuACK (``compat.require_quack_tile_gemm``), bf16 weights, EP = 1. Without a pull
  source every row is this rank's, so the arrival counters start at their targets (nothing to pull); fc1 and
  fc2 run on the tile GEMM on all SMs, then the combine on the full device (``kernels.combine``, the plain
  engine's); in the backward fc2's and fc1's input gradients likewise, then the combine, the weight gradients
  on a second stream beside them.
- references: everywhere else (CPU, gloo, EP > 1 across GPUs): the kernels' pure-torch references in order,
  counters preset or released by the pull's reference before the GEMM (no waits); the exchange is the plain
  engine's. Correct and testable, not fast.

The pull. A transport given to the layer that exposes its peers' send buffers (``transport.base.PullSource``:
the loopback, one GPU standing in for one rank of an EP group) decides where the rows come from and how fast:
each local expert's rows split over P sources (``pull_split``: c_PG), the sources' buffers built from the
tokens' rows (``pull_sources``), the link's rate (``pull_rate``). The layer plan is then the real c_PG's
(source 0 this rank): the rank's own rows are placed in the receive buffer before the call (``local_rows``)
and the arrival counters start from them; the other sources' rows are pulled (``kernels.tile_pull``, on
``TilesConfig.sms`` SMs, paced at the transport's rate) beside fc1 on the waiting GEMM, which starts each row
tile once its rows are in. In the backward each route's output-gradient row (its token's dy row, in the
forward's row layout: the probabilities apply inside SwiGLU) goes through the same sources and is pulled
beside fc2's input gradient on ``sms_backward`` SMs. The received rows are the same rows in the same places
as without a pull, so the results are bitwise the pull-less engine's. On the references the pull is their
reference, run before the GEMM, unpaced (as the loopback's exchange waits no link time on CPU).

A link-only transport (``pull_moves_rows`` False: the loopback with ``LoopbackBytes.LINK``) moves no byte:
every row is placed before the call as without a transport (no source buffer is built), and the pull's
programs run with ``copy="none"`` (``kernels.tile_pull``): the same chunks at the same pace, releasing the
same counters, nothing copied. The GEMM then waits on the link's schedule alone, the ceiling it allows a
transport whose bytes cost this rank nothing; the results are again bitwise the pull-less engine's, and the
return trip is charged as with copies.

The return trip. Each remote row's result crosses the link back to its source: fc2's output rows in the
forward (the combine's exchange), fc1's input gradient rows in the backward (the dispatch's adjoint), as many
bytes as were pulled (``LayerPlan.remote_bytes``). Nothing on this rank computes beside them: with a paced
pull on the kernels the engine charges each as exposed link time, a wall-clock spin of remote_bytes / rate
(``kernels.link_delay.spin_ns``, as the loopback's exchange does) on a delay stream that the current stream
waits for, after the call's combine (the combine reads rows that stayed here first; its cost is the same
before or after the link time). Unpaced, and on the references, there is nothing to wait.

The streams besides the current one (``TileStreams``: the pull's, the weight gradients', the return trip's)
belong to the layer (``adapter.dispatcher``), one set per device, never the stream a call runs on (torch's
pool hands its streams out in turn; the layer takes a new set when it runs on one of its set's).

The combine runs after the GEMM, not beside it on the SMs the GEMM leaves (``kernels.tile_combine``): a
token's routes span all experts, so most tokens are complete only once fc2's last tiles are, and the
combine's bytes then move on K SMs. One H200, forward, counters preset, no pull
(``docs/results/2026-12-03-tile-layer-forward/``), ms at K = 2 / 4 / 8: DeepSeek-V3's EP=32 slice 4.475 /
4.486 / 4.482 after, 17.32 / 10.63 / 7.28 beside (plain layer 4.502); Qwen3's EP=8 slice 2.000 / 1.904 /
1.945 after, 19.18 / 10.54 / 6.15 beside (plain 2.136).

Weight gradients follow the torch backend's contract (``experts.main_grad``): with gradient accumulation
fusion and a ``main_grad``, they are added into it and autograd gets Megatron's dummy; otherwise they are
returned and accumulate into ``.grad``. The parameters are ``MoKGroupedMLP``'s (``fc1_weight`` [G, 2F, H],
``fc2_weight`` [G, H, F]): checkpoints and optimizers see the torch backend. SwiGLU's output is recomputed
in the backward from fc1's saved output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mok_megatron.engine import tile_compose as tcomp
from mok_megatron.experts.main_grad import fused_wgrad_result
from mok_megatron.kernels import tile_gemm as tg
from mok_megatron.kernels import tile_pull as tp
from mok_megatron.kernels.routing import RoutingMeta
from mok_megatron.transport.base import PullSource


@dataclass(frozen=True)
class TilesConfig:
    """The tiles engine of one layer, fixed when the layer is built."""

    sms: int  # SMs held back for the pull beside the forward's fc1 (a call with a pull source)
    sms_backward: int  # the same beside the backward's fc2 input gradient
    kernels: bool  # the kernels (sm_90, QuACK, bf16, EP = 1); False: the references, in order (no waits)
    tile: tg.TileConfig = tg.QWEN3  # the GEMMs' tile configuration (one counter layout)

    @property
    def ops(self) -> tcomp.Ops:
        return tcomp.KERNELS if self.kernels else tcomp.REFERENCES


def kernels_unavailable(device: torch.device, dtype: torch.dtype, ep_size: int) -> str | None:
    """Why a layer on ``device`` with ``dtype`` weights runs the references rather than the kernels, or None."""
    if ep_size != 1:
        return f"EP={ep_size}: only the one-GPU loopback exposes its peers' buffers to the pull"
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return "the kernels are QuACK's sm_90 kernels"
    if dtype != torch.bfloat16:
        return f"weights in {dtype}: the kernels take bf16"
    try:
        from mok_megatron.compat import require_quack_tile_gemm

        require_quack_tile_gemm()
    except ImportError as e:
        return f"QuACK: {e}"
    return None


def tile_config(hidden: int) -> tg.TileConfig:
    """The benchmarks' best tile configuration at ``hidden``: DeepSeek-V3's at H >= 4096, else Qwen3's
    (docs/results/2026-12-03-tile-gemm-gate)."""
    return tg.DEEPSEEK if hidden >= 4096 else tg.QWEN3


def row_routes(counts_G: torch.Tensor) -> RoutingMeta:
    """Expert-major rows each their own token (K = 1): the received rows of EP > 1, combined elsewhere."""
    c = counts_G.to(torch.int32)
    offs = torch.cumsum(c, 0).to(torch.int32)
    rows = int(offs[-1]) if offs.numel() else 0
    row_TK = torch.arange(rows, dtype=torch.int32, device=c.device)[:, None]
    return RoutingMeta(c, offs, offs, row_TK, rows, 1)


POOL_TRIES = 64  # new streams ``TileStreams.on`` takes at most (torch's pool: 32 per priority and device)


@dataclass(frozen=True)
class TileStreams:
    """The CUDA streams of a layer's tiles calls besides the current one (the kernels'), one set per device,
    owned by the layer (``adapter.dispatcher``)."""

    side: torch.cuda.Stream  # the pull, beside the GEMM that waits for its rows
    wgrad: torch.cuda.Stream  # the backward's weight gradients
    delay: torch.cuda.Stream  # the results' return trip: a paced pull's link time

    @classmethod
    def on(cls, device: torch.device) -> TileStreams:
        """Three distinct streams of ``device``, none of them its current stream: torch hands out its pool's
        streams in turn, so a new one may be the stream the caller runs on, and a pull queued on the stream of
        the GEMM that waits for it would never run."""
        current = torch.cuda.current_stream(device)
        picked: list = []
        for _ in range(POOL_TRIES):
            s = torch.cuda.Stream(device)
            if s != current and s not in picked:
                picked.append(s)
                if len(picked) == 3:
                    return cls(*picked)
        raise RuntimeError(
            f"TileStreams.on: {POOL_TRIES} streams of {device} gave {len(picked)} distinct ones besides the "
            "current stream, 3 needed (torch's stream pool)"
        )

    def holds(self, stream) -> bool:
        """Whether ``stream`` is one of these."""
        return stream in (self.side, self.wgrad, self.delay)


@dataclass(frozen=True)
class TileCall:
    """One layer call: its plan, its weights' main-grad owners (None: ordinary gradients), the streams
    besides the current one (kernels only), and where the received rows come from (``source``: a transport
    exposing its peers' buffers, with ``c_PG`` its split; None: every row placed, nothing pulled)."""

    plan: tcomp.LayerPlan
    config: TilesConfig
    owners: tuple  # (fc1's, fc2's) main_grad owners or None
    streams: TileStreams | None
    source: PullSource | None = None
    c_PG: torch.Tensor | None = None  # int64 [P, G]: the rows source p sends local expert g

    @property
    def pulls(self) -> bool:
        """Rows come from other sources: a pull beside the first GEMM of each direction. A link that moves
        no rows and sets no pace (the link-only loopback at an infinite rate) leaves nothing to pull: every
        row is placed and no SMs are held back."""
        src = self.source
        return src is not None and self.plan.remote_bytes > 0 and (src.pull_moves_rows or src.pull_rate > 0)

    @property
    def copy(self) -> str:
        """The pull's copy path (``tile_pull``): the rows copied through registers, or none moved when the
        transport's link carries no bytes (``pull_moves_rows`` False: every row placed before the call)."""
        return "none" if self.source is not None and not self.source.pull_moves_rows else "registers"

    @property
    def rate(self) -> float:
        """The pull's pace in bytes/s: the transport's on the kernels; the references cannot pace (0)."""
        return self.source.pull_rate if self.pulls and self.config.kernels else 0.0

    @property
    def side(self) -> torch.cuda.Stream | None:
        return self.streams.side if self.pulls and self.streams is not None else None

    @property
    def wgrad(self) -> torch.cuda.Stream | None:
        return None if self.streams is None else self.streams.wgrad


def _routes(meta: RoutingMeta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(live routes' rows, their tokens, the live mask [T, K])."""
    row_TK = meta.row_TK.long()
    live_TK = row_TK >= 0
    token_TK = torch.arange(row_TK.shape[0], device=row_TK.device)[:, None].expand_as(row_TK)
    return row_TK[live_TK], token_TK[live_TK], live_TK


def _row_tokens(rows_N: torch.Tensor, tokens_N: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 [M]: the token of each received row; every row must be read by one route (dropless, no padding
    rows), as the sources carry one row per route."""
    if rows_N.numel() != rows:
        raise ValueError(
            f"tile_experts: {rows_N.numel()} routes read {rows} received rows; a pull source needs every row "
            "read by exactly one route (dropless routing, rows not padded)"
        )
    token_M = torch.empty(rows, dtype=torch.int64, device=rows_N.device)
    token_M[rows_N] = tokens_N
    return token_M


def _expert_rows(call: TileCall, rows_TH: torch.Tensor, rows_N, tokens_N, m: int):
    """(the expert-major buffer [M, H] with the rows in place that cross no link, the sources the pull reads,
    their address table). Without a source: every route's row placed (rows no route reads zero), one source
    (the buffer itself). A link-only source (``pull_moves_rows`` False): every row placed the same way, no
    source buffer (the pull reads none: its table is P zeros). With one that moves rows: the transport's
    sources of ``rows_TH``, the local source's rows placed, the rest left to the pull (NaN on the references,
    so a row the pull missed shows in the results)."""
    if call.source is None or not call.source.pull_moves_rows:
        rows_MH = rows_TH.new_zeros(m, rows_TH.shape[1])
        rows_MH[rows_N] = rows_TH[tokens_N]
        if call.source is None:
            return rows_MH, (rows_MH,), torch.zeros(1, dtype=torch.int64, device=rows_TH.device)
        return rows_MH, (), torch.zeros(call.c_PG.shape[0], dtype=torch.int64, device=rows_TH.device)
    sources = call.source.pull_sources(rows_TH, _row_tokens(rows_N, tokens_N, m), call.c_PG)
    if call.config.kernels:
        rows_MH = rows_TH.new_empty(m, rows_TH.shape[1])
        table_P = tp.source_table(sources)
    else:
        rows_MH = rows_TH.new_full((m, rows_TH.shape[1]), float("nan"))
        table_P = torch.zeros(len(sources), dtype=torch.int64, device=rows_TH.device)
    own = sources[tcomp.LOCAL]
    rows_MH[tcomp.local_rows(call.c_PG, own.shape[0])] = own
    return rows_MH, sources, table_P


def _return_trip(call: TileCall, device: torch.device) -> None:
    """The remote rows' results back over the link: with a paced pull on the kernels, remote_bytes / rate of
    wall time spun on the delay stream, which the current stream then waits for."""
    rate = call.rate
    if rate <= 0 or call.streams is None or device.type != "cuda":
        return
    from mok_megatron.kernels.link_delay import spin_ns

    main, delay = torch.cuda.current_stream(device), call.streams.delay
    delay.wait_stream(main)
    with torch.cuda.stream(delay):
        spin_ns(round(call.plan.remote_bytes / rate * 1e9), device)
    main.wait_stream(delay)


class _TileExperts(torch.autograd.Function):
    """out_TH = the composition over x_TH's routes; gradients for x_TH, probs_TK, w1, w2."""

    @staticmethod
    def forward(ctx, x_TH, probs_TK, w1_G2FH, w2_GHF, call: TileCall):
        plan, cfg = call.plan, call.config
        rows_N, tokens_N, live_TK = _routes(plan.meta)
        m = plan.pull.rows
        recv_MH, sources, table_P = _expert_rows(call, x_TH, rows_N, tokens_N, m)
        probs_M = torch.zeros(m, dtype=torch.float32, device=x_TH.device)
        probs_M[rows_N] = probs_TK[live_TK].float()
        x = tcomp.LayerInputs(
            sources=sources,
            table_P=table_P,
            w1_G2FH=w1_G2FH,
            w2_GHF=w2_GHF,
            probs_M=probs_M,
        )
        buf = tcomp.LayerBuffers(
            recv_MH=recv_MH,
            h_M2F=recv_MH.new_empty(m, w1_G2FH.shape[1]),
            y_MH=recv_MH.new_empty(m, w2_GHF.shape[1]),
            counters_S=torch.zeros_like(plan.fc1.targets_S),
            done_S=torch.zeros_like(plan.fc1.targets_S),
        )
        out = tcomp.tiles_forward(
            buf, x, plan, cfg.ops, k=cfg.sms, rate=call.rate, pull=call.pulls, combine="after",
            copy=call.copy, side=call.side,
        )  # fmt: skip
        _return_trip(call, x_TH.device)
        ctx.call = call
        ctx.probs_dtype = probs_TK.dtype
        ctx.save_for_backward(recv_MH, buf.h_M2F, probs_M, w1_G2FH, w2_GHF, x_TH)
        return out

    @staticmethod
    def backward(ctx, dout_TH):
        recv_MH, h_M2F, probs_M, w1_G2FH, w2_GHF, x_TH = ctx.saved_tensors
        call = ctx.call
        plan, cfg = call.plan, call.config
        ops = cfg.ops
        rows_N, tokens_N, live_TK = _routes(plan.meta)
        m = recv_MH.shape[0]
        dout_TH = dout_TH.contiguous().to(recv_MH.dtype)
        # the combine's adjoint: each route's row is its token's gradient
        dy_MH, sources, table_P = _expert_rows(call, dout_TH, rows_N, tokens_N, m)
        x = tcomp.LayerInputs((recv_MH,), torch.zeros(1, dtype=torch.int64), w1_G2FH, w2_GHF, probs_M)
        bx = tcomp.BackwardInputs(
            dy_TH=dout_TH,
            sources=sources,
            table_P=table_P,
            x_MH=recv_MH,
            h_M2F=h_M2F,
            a_MF=ops.swiglu(h_M2F, probs_M),
        )
        buf = tcomp.BackwardBuffers(
            dy_MH=dy_MH,
            da_MF=recv_MH.new_empty(m, w2_GHF.shape[2]),
            dx_MH=recv_MH.new_empty(m, recv_MH.shape[1]),
            counters_S=torch.zeros_like(plan.fc1.targets_S),
            done_S=torch.zeros_like(plan.fc1.targets_S),
        )
        grads = tcomp.tiles_backward(
            buf,
            bx,
            x,
            plan,
            ops,
            k=cfg.sms_backward,
            rate=call.rate,
            pull=call.pulls,
            combine="after",
            wgrad="beside" if cfg.kernels and call.wgrad is not None else "after",
            copy=call.copy,
            side=call.side,
            wgrad_stream=call.wgrad,
        )
        _return_trip(call, dout_TH.device)
        dprobs_TK = torch.zeros(live_TK.shape, dtype=ctx.probs_dtype, device=dout_TH.device)
        dprobs_TK[live_TK] = grads.dprobs_M[rows_N].to(ctx.probs_dtype)
        dw = []
        for got, owner, weight in zip(
            (grads.dw1_G2FH, grads.dw2_GHF), call.owners, (w1_G2FH, w2_GHF), strict=True
        ):
            if owner is None:
                dw.append(got.to(weight.dtype))
            else:  # Megatron's gradient-accumulation-fusion contract, as the torch backend
                owner.main_grad.add_(got)
                dw.append(fused_wgrad_result(owner))
        return grads.dx_TH.to(x_TH.dtype), dprobs_TK, dw[0], dw[1], None


def tile_experts(
    x_TH: torch.Tensor,
    probs_TK: torch.Tensor,
    meta: RoutingMeta,
    counts_G: torch.Tensor,
    w1_G2FH: torch.Tensor,
    w2_GHF: torch.Tensor,
    config: TilesConfig,
    owners: tuple = (None, None),
    streams: TileStreams | None = None,
    source: PullSource | None = None,
) -> torch.Tensor:
    """[T, H]: each token's sum over its routes (``meta``, rows grouped by expert with ``counts_G`` rows
    each) of fc2(SwiGLU(fc1(x)) x probability). Differentiable in x_TH, probs_TK and the weights.
    ``streams``: the streams besides the current one, which the kernels need (``config.kernels``: the weight
    gradients beside the rest, a pull beside its GEMM). ``source``: the transport whose peers' buffers the
    rows are pulled from (None: every row placed, nothing pulled); reads its split's sizes on the host."""
    if source is not None and config.kernels and streams is None:
        raise ValueError(
            "tile_experts: a pull source with the kernels (config.kernels) and streams=None; the pull runs "
            "beside its GEMM on another stream: pass streams=TileStreams.on(device)"
        )
    c_PG = counts_G.reshape(1, -1).long() if source is None else source.pull_split(counts_G).long()
    plan = tcomp.layer_plan(
        c_PG,
        w1_G2FH.shape[2],
        w2_GHF.shape[2],
        meta,
        config.tile,
        elem_bytes=x_TH.element_size(),
    )
    call = TileCall(plan, config, tuple(owners), streams, source, c_PG)
    return _TileExperts.apply(x_TH, probs_TK, w1_G2FH, w2_GHF, call)
