"""The tiles engine (``--mok-engine tiles``): a layer call's experts on the tile-level overlap kernels,
forward and backward composed as in ``engine.tile_compose``, inside one autograd node.

Legend: T tokens (or received rows), K routes per token, G local experts, H hidden, F expert FFN width on this
rank, M expert-major rows, S counter slots.

    EP = 1     x_TH, probs_TK --(rows placed by the routing kernels' plan, ``DispatchPlan.meta``)--> x_MH
               -> fc1 -> SwiGLU x probability -> fc2 -> each token's sum over its routes: out_TH
    EP > 1     the plain engine's dispatch (all-to-all, sort by local expert) -> the same node over the
               received rows, each row its own token (K = 1) -> the plain engine's combine

Where each step runs (``TilesConfig.kernels``, decided when the layer is built):

- kernels: an sm_90 GPU with QuACK (``compat.require_quack_tile_gemm``), bf16 weights, EP = 1. Every row is
  this rank's, so the arrival counters start at their targets (nothing to pull); fc1 and fc2 run on the tile
  GEMM on all SMs, then the combine on the full device (``kernels.combine``, the plain engine's); in the
  backward fc2's and fc1's input gradients likewise, then the combine, the weight gradients on a second
  stream beside them.
- references: everywhere else (CPU, gloo, EP > 1 across GPUs): the kernels' pure-torch references in order,
  counters preset (no waits); the exchange is the plain engine's. Correct and testable, not fast.

A pull of exchanged rows from peers' buffers into the receive buffer (``kernels.tile_pull``, on ``sms`` SMs
beside fc1 and ``sms_backward`` beside fc2's input gradient) is what makes the engine overlap communication;
the transports do not yet expose peer buffers to it, so no layer call pulls and no SMs are held back.

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
from mok_megatron.kernels.routing import RoutingMeta


@dataclass(frozen=True)
class TilesConfig:
    """The tiles engine of one layer, fixed when the layer is built."""

    sms: int  # SMs held back for the pull beside the forward's fc1 (no layer call pulls yet)
    sms_backward: int  # the same beside the backward's fc2 input gradient
    kernels: bool  # the kernels (sm_90, QuACK, bf16, EP = 1); False: the references, counters preset
    tile: tg.TileConfig = tg.QWEN3  # the GEMMs' tile configuration (one counter layout)

    @property
    def ops(self) -> tcomp.Ops:
        return tcomp.KERNELS if self.kernels else tcomp.REFERENCES


def kernels_unavailable(device: torch.device, dtype: torch.dtype, ep_size: int) -> str | None:
    """Why a layer on ``device`` with ``dtype`` weights runs the references rather than the kernels, or None."""
    if ep_size != 1:
        return f"EP={ep_size}: the transports do not expose peer buffers to the pull yet"
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


@dataclass(frozen=True)
class TileCall:
    """One layer call: its plan, its weights' main-grad owners (None: ordinary gradients), the weight
    gradients' stream."""

    plan: tcomp.LayerPlan
    config: TilesConfig
    owners: tuple  # (fc1's, fc2's) main_grad owners or None
    wgrad: torch.cuda.Stream | None  # the backward's weight gradients' stream (kernels only)


def _routes(meta: RoutingMeta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(live routes' rows, their tokens, the live mask [T, K])."""
    row_TK = meta.row_TK.long()
    live_TK = row_TK >= 0
    token_TK = torch.arange(row_TK.shape[0], device=row_TK.device)[:, None].expand_as(row_TK)
    return row_TK[live_TK], token_TK[live_TK], live_TK


class _TileExperts(torch.autograd.Function):
    """out_TH = the composition over x_TH's routes; gradients for x_TH, probs_TK, w1, w2."""

    @staticmethod
    def forward(ctx, x_TH, probs_TK, w1_G2FH, w2_GHF, call: TileCall):
        plan, cfg = call.plan, call.config
        rows_N, tokens_N, live_TK = _routes(plan.meta)
        m = plan.pull.rows
        recv_MH = x_TH.new_zeros(m, x_TH.shape[1])
        recv_MH[rows_N] = x_TH[tokens_N]
        probs_M = torch.zeros(m, dtype=torch.float32, device=x_TH.device)
        probs_M[rows_N] = probs_TK[live_TK].float()
        x = tcomp.LayerInputs(
            sources=(recv_MH,),
            table_P=torch.zeros(1, dtype=torch.int64, device=x_TH.device),
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
        out = tcomp.tiles_forward(buf, x, plan, cfg.ops, k=cfg.sms, pull=False, combine="after")
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
        dy_MH = recv_MH.new_zeros(m, recv_MH.shape[1])
        dy_MH[rows_N] = dout_TH[tokens_N]  # the combine's adjoint: each route's row is its token's gradient
        x = tcomp.LayerInputs((recv_MH,), torch.zeros(1, dtype=torch.int64), w1_G2FH, w2_GHF, probs_M)
        bx = tcomp.BackwardInputs(
            dy_TH=dout_TH,
            sources=(dy_MH,),
            table_P=x.table_P,
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
            pull=False,
            combine="after",
            wgrad="beside" if cfg.kernels and call.wgrad is not None else "after",
            wgrad_stream=call.wgrad,
        )
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
    wgrad_stream: torch.cuda.Stream | None = None,
) -> torch.Tensor:
    """[T, H]: each token's sum over its routes (``meta``, rows grouped by expert with ``counts_G`` rows
    each) of fc2(SwiGLU(fc1(x)) x probability). Differentiable in x_TH, probs_TK and the weights.
    ``wgrad_stream``: the CUDA stream of the backward's weight gradients, which the kernels need
    (``config.kernels``)."""
    c_PG = counts_G.reshape(1, -1).long()
    plan = tcomp.layer_plan(
        c_PG,
        w1_G2FH.shape[2],
        w2_GHF.shape[2],
        meta,
        config.tile,
        elem_bytes=x_TH.element_size(),
    )
    call = TileCall(plan, config, tuple(owners), wgrad_stream)
    return _TileExperts.apply(x_TH, probs_TK, w1_G2FH, w2_GHF, call)
