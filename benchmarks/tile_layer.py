"""One MoE layer's expert forward and backward on the tile kernels, against the plain layer without
communication: how much of the dispatch and of the output gradient's exchange does the tile engine hide, and
what do its GEMMs and combines cost?

One GPU stands in for an EP rank (loopback), one process, per slice of ``tile_gemm_gate.SHAPES`` (without
``--shapes``: ``tile_gemm_gate.DEFAULT_SHAPES``; the 16k-token DeepSeek-V3 slice by name):

    plain     the received rows already in place (expert-major): ``torch._grouped_mm`` fc1 -> SwiGLU x
              probability (``kernels.swiglu``, the torch backend's) -> ``torch._grouped_mm`` fc2 -> the
              per-token sum (``kernels.combine``); replayed from a CUDA graph (the loopback's baseline,
              docs/performance.md), its eager time beside
    tiles     the waiting fc1 GEMM (``kernels.tile_gemm``, ``SMs - K``, launched first) with the pull
              (``kernels.tile_pull``, K programs, another stream) moving the remote sources' rows into the
              receive buffer at a paced link rate (``--gbps``; 0: unpaced); SwiGLU; fc2 on the waiting GEMM
              releasing done counters, with ``kernels.tile_combine`` (K programs, another stream, launched
              after the GEMM) summing each token once its row tiles are stored (``--combine beside``), or fc2 on all
              SMs followed by ``kernels.combine`` (``after``)
    preset    the tiles layer with every arrival counter preset and no pull: the GEMMs' and the combine's own
              cost against plain, apart from any waiting

The backward (``--phase backward``; ``both``, the default, runs both and sums them), from the output gradient
dy_TH and the forward's saved rows, fc1 output and activation:

    plain     the received output gradient already in place: ``torch._grouped_mm`` fc2 input gradient
              ``dy @ w2`` and weight gradient ``dy^T a``, SwiGLU's backward with the probabilities
              (``kernels.swiglu.swiglu_backward``: the probability gradient too), fc1's input gradient
              ``dh @ w1`` and weight gradient ``dh^T x``, the per-token sum over each token's routes (the
              dispatch's adjoint: ``kernels.combine`` without probabilities); CUDA-graphed
    tiles     the output-gradient exchange: each route's dy row (the combine's adjoint; the probabilities
              apply inside SwiGLU, so it is dy itself), sent as the forward's rows were, pulled by the K
              programs beside fc2's input gradient on the waiting GEMM (B N-major); SwiGLU's backward; fc1's
              input gradient on the tile GEMM (nothing to wait on) releasing done counters with the tile
              combine beside it (``--combine beside``), or on all SMs followed by the combine (``after``);
              the weight gradients (``--wgrad beside``) on a third stream, fc2's once the pull has ended and
              fc1's once SwiGLU's backward has, overlapping the GEMMs, or (``after``) on the main stream at
              the end
    preset    as for the forward

The backward's link bytes are the output gradient's remote rows (as many as the dispatch's); the input
gradient's return to the source ranks is not modelled as an exchange: the per-token sum stands in for it,
as the forward's combine does for the combine's exchange.

The pull's copy path (``--copy``, a comma list of ``tile_pull.COPIES``; each row carries its ``copy``):
``registers`` and ``tma`` move the remote rows; ``none`` is the link time only, the ceiling the schedule
allows: no byte moved (every row is in the receive buffer before the run, as an ideal transport would have
landed it without costing this GPU anything), the same K programs walking the same chunks at the same pace,
releasing the counters the waiting GEMM polls. Its rows are the tiles layer's time when only the link's
pace holds the GEMM back: link ms = remote bytes / rate as for the copying paths, and what a copying path
hides less than ``none`` at the same K and rate is the copy's cost beside the GEMM (one SM's register copy
moves ~38 GB/s there on one H200), not the schedule's. Unpaced (``--gbps 0``) it models no link (the counters
released as fast as the programs walk the table): those rows are skipped, with the reason in the JSON's
``skipped`` and one printed line, and no pull alone is timed for it.

Per phase, slice, K, combine (backward: and weight-gradient placement) and rate: layer ms (median over rounds
of the mean of back-to-back calls, CUDA events), exposed = layer - plain, link = remote bytes / rate
(unpaced: the pull alone's time), hidden = 1 - exposed / link; ``slowdown`` = preset - plain and ``waiting``
= layer - preset split the exposed time. ``both`` rows sum a backward row and the forward row of the same
slice, K, combine and rate (hidden from the summed exposed and link times). Per slice, the plain backward's
two weight gradients alone (``wgrad_ms``): what an overlap can take off.

The rank's own rows. Source 0 is this rank. Its rows cross no link: in an engine the permute that builds the
send buffers writes them straight into the receive buffer, and neither layer here includes the permute. So
they are placed before the layer and the counters start from their rows (``LayerPlan.local_counts_S``); the
pull moves sources 1..P-1 only, and only their bytes count as link bytes.

Tokens. The T = ceil(M / top-k) tokens of the combine take rows ``t, t + T, t + 2T, ...`` of the M received
rows (``strided_routes``): with the received rows about T x top-k, a token's routes fall in top-k different
experts spread over all of them, as top-k routing over the EP group's experts does, so most tokens are
complete only once fc2's last experts are.

Checks before timing: the preset tiles layer against plain (``MATCH``: bf16 outputs of fp32 accumulations
in QuACK's order against cuBLAS's, through two GEMMs and a sum of top-k rows) and bitwise against
``kernels.combine`` of its own fc2 output; every pulled layer bitwise against the preset one, its remote rows
NaN before the run (a tile loaded before its rows carries NaN out); copy none's every row in place before
the run (it moves none: the check shows its counters reach their targets, nothing waits forever, and the
results are the preset one's). The backward the same way: the preset one's input gradient against plain's
within ``MATCH``, its probability and weight gradients within ``GRAD_REL`` relative error norm, its input
gradient bitwise ``kernels.combine`` of its own expert rows; every pulled one bitwise the preset one in all
four, the output gradient's remote rows NaN before the run (copy none: in place). A mismatch is reported
and not timed.

A waiting kernel whose counters never reach their targets never ends: ``--case-timeout`` ends the process
(status 3) after writing the JSON gathered so far (``tile_gemm_gate.CaseWatchdog``); a CUDA error that loses
the context ends it with status 4. Compilation happens in a warm-up of launches that wait on nothing: QuACK,
~30-60 s each on first use, one variant per (slice configuration, B's major mode, done release): fc1 (B
K-major), fc2 (K-major, releasing), fc2's input gradient (N-major), fc1's input gradient (N-major,
releasing; only with ``--combine beside``), so 4 per slice and 8 in the default run (the ``after`` GEMMs on
all SMs reuse the non-releasing variants); Triton: the pull, SwiGLU forward and backward, the combines.

``tiles_forward`` / ``plain_forward`` and ``tiles_backward`` / ``plain_backward`` are the compositions, from
``mok_megatron.engine.tile_compose`` (the tiles engine's); given ``REFERENCES`` they run the kernels' torch
references in order (the releasing step before the waiting one), which is how the CPU tests check them (and
the plain backward against autograd of the plain forward).

Legend: P source ranks, G local experts, H hidden, F expert FFN width, M received rows (expert-major), T
tokens, K routes per token (top-k), S counter slots.

    python -m benchmarks.tile_layer --json layer.json      # sm_90 and quack-kernels 0.4.x
    python -m benchmarks.tile_layer --shapes qwen3-ep8 --k 8 --gbps 900 --combine beside
    python -m benchmarks.tile_layer --phase backward --wgrad beside,after --json layer-backward.json
    python -m benchmarks.tile_layer --combine after --k 8,16 --copy registers,none --gbps 900,450   # ceiling
    python -m benchmarks.tile_layer --shapes deepseek-v3-ep32-16k --combine after --k 8,16 --gbps 900,450
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable

import torch

from benchmarks.tile_gemm_gate import (
    DEFAULT_SHAPES,
    SHAPE_CONFIG,
    SHAPES,
    CaseWatchdog,
    counts_by_source,
    parse_ks,
    time_ms,
)
from mok_megatron.engine import tile_compose
from mok_megatron.engine.tile_compose import (  # noqa: F401  (the composition, read by the tests through here)
    CHUNK_ROWS,
    COMBINES,
    KERNELS,
    LOCAL,
    REFERENCES,
    WGRADS,
    BackwardBuffers,
    BackwardInputs,
    Gradients,
    LayerBuffers,
    LayerInputs,
    LayerPlan,
    Ops,
    backward_buffers,
    layer_buffers,
    only_sources,
    plain_backward,
    plain_forward,
    tiles_backward,
    tiles_forward,
    wgrad_reference,
)
from mok_megatron.kernels import tile_gemm as tg
from mok_megatron.kernels import tile_pull as tp
from mok_megatron.kernels.combine import combine
from mok_megatron.kernels.routing import RoutingMeta
from mok_megatron.kernels.swiglu import swiglu_backward

PHASES = ("forward", "backward", "both")
# why the rows of copy none at --gbps 0 are skipped (every other copy path's unpaced rows are timed)
UNPACED_LINK_ONLY = (
    "copy none moves no byte and, unpaced, releases every counter as fast as its programs walk the table: "
    "it models no link (give a rate > 0)"
)
# the preset tiles layer against plain: bf16 outputs of fp32 accumulations in two orders (QuACK's tiles,
# cuBLAS), through fc1, SwiGLU, fc2 and a sum of top-k rows of about unit size (the tile combine tests' BF16_SUM)
MATCH = dict(rtol=1.6e-2, atol=3e-2)
# the preset tiles backward's probability and weight gradients against plain's, as relative error norms: each
# element a sum over F (dprobs) or over an expert's rows (weights) of products whose bf16 inputs differ by an
# ulp between the two GEMM orders, so single elements near zero cancel and an elementwise bound would not hold
GRAD_REL = 1e-2


# ---- the plan --------------------------------------------------------------------------------------------


def strided_routes(rows: int, topk: int, device=None) -> torch.Tensor:
    """int32 [T, K], T = ceil(rows / K): route (t, k) reads row ``t + k * T`` (-1 past the last row)."""
    if topk < 1 or rows < 0:
        raise ValueError(f"strided_routes: rows={rows}, topk={topk}; rows must be >= 0 and topk >= 1")
    t = -(-rows // topk)
    row_TK = torch.arange(t, device=device)[:, None] + torch.arange(topk, device=device)[None, :] * t
    return torch.where(row_TK < rows, row_TK, -1).to(torch.int32)


def routing_of(c_G: torch.Tensor, topk: int) -> RoutingMeta:
    """The routing metadata of ``strided_routes`` over the expert-major rows of ``c_G`` rows per expert."""
    c = c_G.to(torch.int32)
    offs = torch.cumsum(c, 0).to(torch.int32)
    rows = int(c.sum())
    row_TK = strided_routes(rows, topk, c_G.device)
    return RoutingMeta(c, offs, offs, row_TK, rows, 1)


def layer_plan(
    c_PG: torch.Tensor,
    hidden: int,
    ffn: int,
    topk: int,
    config: tg.TileConfig,
    chunk_rows: int = CHUNK_ROWS,
    elem_bytes: int = 2,
    local: int = LOCAL,
) -> LayerPlan:
    """``engine.tile_compose.layer_plan`` with the tokens of ``strided_routes`` over the received rows."""
    meta = routing_of(c_PG.sum(0), topk) if c_PG.dim() == 2 else None
    return tile_compose.layer_plan(c_PG, hidden, ffn, meta, config, chunk_rows, elem_bytes, local)


def layer_inputs(c_PG: torch.Tensor, hidden: int, ffn: int, dtype, device, seed: int = 0) -> LayerInputs:
    """Random sources, weights scaled so each GEMM's outputs are about unit size, probabilities in [0, 1)."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    n_p, n_g = c_PG.shape

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    sources = tuple(randn(int(n), hidden) for n in c_PG.sum(1).tolist())
    return LayerInputs(
        sources=sources,
        table_P=tp.source_table(sources),
        w1_G2FH=randn(n_g, 2 * ffn, hidden, scale=hidden**-0.5),
        w2_GHF=randn(n_g, hidden, ffn, scale=ffn**-0.5),
        probs_M=torch.rand(int(c_PG.sum()), generator=gen, device=device),
    )


def received_rows(x: LayerInputs, plan: LayerPlan) -> torch.Tensor:
    """[M, H]: the receive buffer once every row is in (the plain layer's input)."""
    recv = x.sources[0].new_zeros(plan.pull.rows, x.w1_G2FH.shape[2])
    for part in (plan.local, plan.pull):
        tp.pull_reference(recv, x.sources, part, torch.zeros_like(plan.local_counts_S))
    return recv


def source_of_rows(c_PG: torch.Tensor) -> torch.Tensor:
    """int64 [M]: the source of each expert-major received row (each expert's rows by source)."""
    n_p, n_g = c_PG.shape
    return torch.arange(n_p, device=c_PG.device).repeat(n_g).repeat_interleave(c_PG.t().flatten().long())


def split_by_source(rows_MH: torch.Tensor, c_PG: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The send buffers that a pull of ``c_PG`` turns into the expert-major ``rows_MH``: source p's rows, grouped
    by local expert (a source's rows keep their expert-major order)."""
    src_M = source_of_rows(c_PG).to(rows_MH.device)
    return tuple(rows_MH[src_M == p].contiguous() for p in range(c_PG.shape[0]))


def route_rows(rows_TH: torch.Tensor, meta: RoutingMeta) -> torch.Tensor:
    """[M, H]: each expert-major row its token's row (the dispatch; the unweighted combine's adjoint); rows no
    route reads are zero. Differentiable in ``rows_TH``."""
    rows_TK = meta.row_TK.long()
    live = rows_TK >= 0
    token_TK = torch.arange(rows_TK.shape[0], device=rows_TK.device)[:, None].expand_as(rows_TK)
    out = rows_TH.new_zeros(meta.num_rows, rows_TH.shape[1])
    return out.index_put((rows_TK[live],), rows_TH[token_TK[live]])


def backward_inputs(
    c_PG: torch.Tensor, x: LayerInputs, plan: LayerPlan, ops: Ops, seed: int = 0
) -> BackwardInputs:
    """A unit-size random output gradient and the forward's saved tensors (the plain forward's, by ``ops``)."""
    x_MH = received_rows(x, plan)
    h_M2F = ops.grouped_mm(x_MH, x.w1_G2FH.mT, plan.fc1.cu_G1[1:])
    gen = torch.Generator(device=x_MH.device).manual_seed(seed + 1)
    dy_TH = torch.randn(plan.meta.row_TK.shape[0], x_MH.shape[1], generator=gen, device=x_MH.device)
    dy_TH = dy_TH.to(x_MH.dtype)
    sources = split_by_source(route_rows(dy_TH, plan.meta), c_PG)
    return BackwardInputs(
        dy_TH=dy_TH,
        sources=sources,
        table_P=tp.source_table(sources),
        x_MH=x_MH,
        h_M2F=h_M2F,
        a_MF=ops.swiglu(h_M2F, x.probs_M),
    )


def received_gradient(bx: BackwardInputs, plan: LayerPlan) -> torch.Tensor:
    """[M, H]: the output gradient's receive buffer once every row is in (the plain backward's input)."""
    dy = bx.dy_TH.new_zeros(plan.pull.rows, bx.dy_TH.shape[1])
    for part in (plan.local, plan.pull):
        tp.pull_reference(dy, bx.sources, part, torch.zeros_like(plan.local_counts_S))
    return dy


def backward_errors(out: Gradients, ref: Gradients) -> list[str]:
    """How a backward's results miss the plain backward's (empty: within the tolerances): NaN anywhere; the
    input gradient past ``MATCH`` elementwise; the probability and weight gradients past ``GRAD_REL`` in
    relative error norm."""
    bad = []
    for name, got in out.tensors().items():
        want = getattr(ref, name)
        if bool(torch.isnan(got).any()):
            bad.append(f"{name} has NaN")
        elif name == "dx_TH":
            if not torch.allclose(got.float(), want.float(), **MATCH):
                bad.append(f"{name} past {MATCH} (relative error {_rel_err(got, want):.1e})")
        elif _rel_err(got, want) > GRAD_REL:
            bad.append(f"{name} relative error {_rel_err(got, want):.1e} > {GRAD_REL:g}")
    return bad


# ---- timing ------------------------------------------------------------------------------------------------


def graphed(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """``fn`` captured in a CUDA graph after two warm-up calls: (replay, the graph's output tensor)."""
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def hidden_row(layer_ms: float, plain_ms: float, preset_ms: float, link_ms: float) -> dict:
    """exposed = layer - plain; hidden = 1 - exposed / link; slowdown = preset - plain; waiting = layer -
    preset."""
    exposed = layer_ms - plain_ms
    return dict(
        layer_ms=layer_ms,
        exposed_ms=exposed,
        link_ms=link_ms,
        hidden=1 - exposed / link_ms if link_ms > 0 else None,
        slowdown_ms=preset_ms - plain_ms,
        waiting_ms=layer_ms - preset_ms,
    )


class ContextLost(Exception):
    pass


def _context_error() -> BaseException | None:
    try:
        torch.cuda.synchronize()
    except Exception as e:  # torch.AcceleratorError / RuntimeError, by torch version
        return e
    return None


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def sweep_shape(name: str, a, ks, rates, combines, phases, wgrads, watchdog, streams, res) -> None:
    """Builds one slice, checks and times the plain layer and the tiles layer of each phase at every K,
    combine (and weight-gradient placement) and rate, appending rows to ``res["rows"]`` (refusals to
    ``res["refused"]``, errors to ``res["skipped"]``)."""
    dev = torch.device("cuda")
    shape = SHAPES[name]
    cfg = getattr(tg, SHAPE_CONFIG[name])
    c_PG = counts_by_source(shape, a.seed).to(dev)
    h, f = shape["hidden"], shape["ffn"]
    plan = layer_plan(c_PG, h, f, shape["topk"], cfg, a.chunk_rows)
    x = layer_inputs(c_PG, h, f, torch.bfloat16, dev, a.seed)
    buf = layer_buffers(x, plan)
    rows = plan.pull.rows
    info = dict(
        shape=name,
        config=repr(cfg),
        rows=rows,
        tokens=plan.meta.row_TK.shape[0],
        remote_bytes=plan.remote_bytes,
    )
    res["shapes"][name] = info
    cases = []
    if "forward" in phases:
        cases.append(_forward_phase(name, a, combines, watchdog, streams, info, x, plan, buf))
    if "backward" in phases:
        cases.append(_backward_phase(name, a, c_PG, combines, wgrads, watchdog, streams, info, x, plan))
    warm_up(name, x, plan, buf, cases, max(ks), rates, a.copies, watchdog)

    for k in ks:
        case = f"{name} k={k}"
        try:
            pull_ms = {"none": None}  # no row moved: no pull alone to time
            for cp in (c for c in a.copies if c != "none"):
                with watchdog.case(f"{case} pull alone ({cp})"):
                    pull_ms[cp] = time_ms(lambda k=k, cp=cp: _pull_alone(x, plan, buf, k, 0.0, cp), a.iters,
                                          a.rounds)  # fmt: skip
                print(
                    f"  k={k:2d}: pull alone ({cp}) {pull_ms[cp]:.3f} ms = "
                    f"{plan.remote_bytes / pull_ms[cp] / 1e6:.0f} GB/s",
                    flush=True,
                )
            for ph in cases:
                _sweep_phase(name, a, k, rates, ph, watchdog, res, plan.remote_bytes, pull_ms)
        except ContextLost:
            raise
        except Exception as e:
            lost = _context_error()
            if lost is not None:
                raise ContextLost(f"{case}: {type(e).__name__}: {e}".splitlines()[0][:300]) from e
            res["skipped"].append(dict(shape=name, k=k, error=f"{type(e).__name__}: {e}"[:300]))
            print(f"  {case} skipped: {type(e).__name__}: {e}"[:200], flush=True)
    torch.cuda.synchronize()


@dataclasses.dataclass(frozen=True)
class _Phase:
    """One phase's cases at one slice: its plain time, its variants (each a dict of the tiles layer's keyword
    arguments, the rows' columns too) and how to run, reset and check its tiles layer."""

    name: str
    plain_ms: float
    variants: list[dict]
    run: Callable  # (variant, rate, pull) -> output
    fill: Callable  # (): every received row in place
    poison: Callable  # (): the remote rows NaN, the local ones in place
    refuse: Callable  # (preset output) -> why it may not be timed, or None
    err: Callable  # (output) -> relative error of its main output against plain's
    same: Callable  # (output, preset output) -> bitwise equal
    clone: Callable
    warm: list  # (what, launch(k)) pairs compiling its kernels


def _label(variant: dict) -> str:
    return " ".join(f"{v}" if n == "combine" else f"{n} {v}" for n, v in variant.items())


def _forward_phase(name, a, combines, watchdog, streams, info, x, plan, buf) -> _Phase:
    recv = received_rows(x, plan)
    plain_eager = plain_forward(recv, x, plan)  # compiles SwiGLU and the combine
    replay, plain_out = graphed(lambda: plain_forward(recv, x, plan))
    with watchdog.case(f"{name} plain forward"):
        replay()
        torch.cuda.synchronize()
        if not torch.equal(plain_out, plain_eager):
            raise RuntimeError(f"{name}: the graphed plain layer differs from the eager one")
        plain_ms = time_ms(replay, a.iters, a.rounds)
        plain_eager_ms = time_ms(lambda: plain_forward(recv, x, plan), a.iters, a.rounds)
    info.update(plain_ms=plain_ms, plain_eager_ms=plain_eager_ms)
    print(
        f"{name}: {plan.pull.rows} rows ({plan.remote_bytes / 1e9:.3f} GB remote), plain forward "
        f"{plain_ms:.3f} ms graphed ({plain_eager_ms:.3f} eager)",
        flush=True,
    )

    def refuse(out):
        if torch.isnan(out).any() or not torch.allclose(out.float(), plain_out.float(), **MATCH):
            return f"differs from plain ({MATCH})"
        if not torch.equal(out, combine(buf.y_MH, plan.meta)):
            return "not bitwise kernels.combine of its fc2 output"
        return None

    targets = plan.fc1.targets_S
    warm = [
        ("fc1", lambda k: KERNELS.tile_mm(buf.recv_MH, x.w1_G2FH.mT, plan.fc1, targets, k, buf.h_M2F)),
        ("fc2", lambda k: KERNELS.tile_mm(
            KERNELS.swiglu(buf.h_M2F, x.probs_M), x.w2_GHF.mT, plan.fc2, plan.fc2.targets_S, k, buf.y_MH,
            torch.zeros_like(buf.done_S),
        )),
        ("tile combine", lambda k: KERNELS.tile_combine(
            buf.y_MH, plan.meta, plan.slot_TK, plan.fc2.done_targets_S.clone(), plan.fc2.done_targets_S,
            plan.order_T, k,
        )),
    ]  # fmt: skip
    return _Phase(
        name="forward",
        plain_ms=plain_ms,
        variants=[dict(combine=c, copy=cp) for c in combines for cp in a.copies],
        run=lambda v, k, rate, pull: tiles_forward(
            buf, x, plan, k=k, rate=rate, pull=pull, side=streams[0], **v
        ),
        fill=lambda: buf.recv_MH.copy_(recv),
        poison=lambda: _place_local(buf.recv_MH, x.sources, plan),
        refuse=refuse,
        err=lambda out: _rel_err(out, plain_out),
        same=torch.equal,
        clone=torch.clone,
        warm=warm,
    )


def _backward_phase(name, a, c_PG, combines, wgrads, watchdog, streams, info, x, plan) -> _Phase:
    bx = backward_inputs(c_PG, x, plan, KERNELS, a.seed)
    dy = received_gradient(bx, plan)
    buf = backward_buffers(bx, x, plan)
    offs = plan.fc1.cu_G1[1:]
    plain_eager = plain_backward(dy, bx, x, plan)
    replay, plain_out = graphed(lambda: plain_backward(dy, bx, x, plan))
    dh = swiglu_backward(bx.h_M2F, x.probs_M, torch._grouped_mm(dy, x.w2_GHF, offs=offs))[0]  # plain's
    wgrad_replay, _ = graphed(lambda: (KERNELS.wgrad(dy, bx.a_MF, offs), KERNELS.wgrad(dh, bx.x_MH, offs)))
    with watchdog.case(f"{name} plain backward"):
        replay()
        torch.cuda.synchronize()
        for what, t in plain_out.tensors().items():
            if not torch.equal(t, getattr(plain_eager, what)):
                raise RuntimeError(f"{name}: the graphed plain backward's {what} differs from the eager one")
        plain_ms = time_ms(replay, a.iters, a.rounds)
        eager_ms = time_ms(lambda: plain_backward(dy, bx, x, plan), a.iters, a.rounds)
        wgrad_ms = time_ms(wgrad_replay, a.iters, a.rounds)
    info.update(plain_backward_ms=plain_ms, plain_backward_eager_ms=eager_ms, wgrad_ms=wgrad_ms)
    print(
        f"{name}: plain backward {plain_ms:.3f} ms graphed ({eager_ms:.3f} eager), its two weight gradients "
        f"{wgrad_ms:.3f} ms",
        flush=True,
    )

    def refuse(out):
        bad = backward_errors(out, plain_out)
        if bad:
            return "differs from plain: " + "; ".join(bad)
        if not torch.equal(out.dx_TH, combine(buf.dx_MH, plan.meta)):
            return "not bitwise kernels.combine of its fc1 input gradient"
        return None

    def same(out, preset):
        return all(torch.equal(t, getattr(preset, n)) for n, t in out.tensors().items())

    warm = [
        (
            "fc2 dgrad",
            lambda k: KERNELS.tile_mm(dy, x.w2_GHF, plan.dgrad2, plan.dgrad2.targets_S, k, buf.da_MF),
        ),
        ("swiglu backward", lambda k: KERNELS.swiglu_backward(bx.h_M2F, x.probs_M, buf.da_MF)),
    ]
    if "beside" in combines:
        warm.append(("fc1 dgrad releasing", lambda k: KERNELS.tile_mm(
            dh, x.w1_G2FH, plan.fc2, plan.fc2.targets_S, k, buf.dx_MH, torch.zeros_like(buf.done_S)
        )))  # fmt: skip
    return _Phase(
        name="backward",
        plain_ms=plain_ms,
        variants=[dict(combine=c, wgrad=w, copy=cp) for c in combines for w in wgrads for cp in a.copies],
        run=lambda v, k, rate, pull: tiles_backward(
            buf, bx, x, plan, k=k, rate=rate, pull=pull, side=streams[0], wgrad_stream=streams[1], **v
        ),
        fill=lambda: buf.dy_MH.copy_(dy),
        poison=lambda: _place_local(buf.dy_MH, bx.sources, plan),
        refuse=refuse,
        err=lambda out: _rel_err(out.dx_TH, plain_out.dx_TH),
        same=same,
        clone=lambda out: Gradients(**{n: t.clone() for n, t in out.tensors().items()}),
        warm=warm,
    )


def warm_up(name: str, x: LayerInputs, plan: LayerPlan, buf: LayerBuffers, cases, k: int, rates, copies,
            watchdog):  # fmt: skip
    """Compiles every kernel of the phases' tiles layers by launches that wait on nothing (arrival and done
    counters preset); compilation runs on the host before each launch, outside the watched synchronize."""
    steps = [step for ph in cases for step in ph.warm]
    paced = sorted(r * 1e9 for r in rates if r > 0)
    for cp in copies:
        # unpaced, and one paced variant (copy none: the paced one alone, its unpaced rows are skipped)
        for rate in paced[:1] if cp == "none" else sorted({0.0, *paced})[:2]:
            steps.append((
                f"pull ({cp}) at {rate:g} B/s", lambda k, rate=rate, cp=cp: _pull_alone(x, plan, buf, k, rate, cp)
            ))  # fmt: skip
    for what, launch in steps:
        launch(k)
        with watchdog.case(f"{name} warm-up {what}"):
            torch.cuda.synchronize()


def _pull_alone(
    x: LayerInputs, plan: LayerPlan, buf: LayerBuffers, k: int, rate: float = 0.0, copy: str = tp.COPIES[0]
) -> None:
    buf.counters_S.copy_(plan.local_counts_S)
    KERNELS.pull(buf.recv_MH, x, plan.pull, buf.counters_S, k, rate, copy)


def _place_local(recv_MH: torch.Tensor, sources, plan: LayerPlan) -> None:
    recv_MH.fill_(float("nan"))
    tp.pull_reference(recv_MH, sources, plan.local, torch.zeros_like(plan.local_counts_S))


def _sweep_phase(name, a, k, rates, ph: _Phase, watchdog, res, remote_bytes: int, pulls: dict) -> None:
    """``pulls``: the pull alone's ms per copy path (the unpaced rows' link time; None for copy none, whose
    unpaced rows are skipped). A pulled run of copy none starts with every row in place (``ph.fill``: it moves
    none), the others with the remote rows NaN (``ph.poison``)."""
    plain_ms = ph.plain_ms
    for v in ph.variants:
        pull_ms = pulls.get(v["copy"])
        link_only = v["copy"] == "none"
        base = dict(
            phase=ph.name, shape=name, k=k, plain_ms=plain_ms, pull_ms=pull_ms, remote_bytes=remote_bytes
        )
        label = _label(v)
        case = f"{name} {ph.name} k={k} {label}"
        with watchdog.case(f"{case} preset check"):
            ph.fill()
            out = ph.run(v, k, 0.0, False)
            torch.cuda.synchronize()
            err = ph.err(out)
            why = ph.refuse(out)
        if why is not None:
            res["refused"].append(dict(base, **v, kind="preset", rel_err=err, why=why))
            print(f"  {case} preset: {why} (relative error {err:.1e}); not timed", flush=True)
            continue
        preset = ph.clone(out)
        with watchdog.case(f"{case} preset"):
            preset_ms = time_ms(lambda v=v: ph.run(v, k, 0.0, False), a.iters, a.rounds)
        res["rows"].append(
            dict(base, **v, kind="preset", gbps=None, rel_err=err, preset_ms=preset_ms,
                 **hidden_row(preset_ms, plain_ms, preset_ms, 0.0))
        )  # fmt: skip
        print(
            f"  {ph.name:8s} k={k:2d} {label:19s} preset   : layer {preset_ms:.3f} ms ({preset_ms - plain_ms:+.3f} "
            f"ms over plain; relative error {err:.1e})",
            flush=True,
        )
        for gbps in rates:
            rate = gbps * 1e9
            if link_only and rate == 0:  # no bytes and no pace: nothing to time (``main`` says so once)
                continue
            link = "unpaced" if rate == 0 else f"{gbps:g} GB/s"
            with watchdog.case(f"{case} at {link} check"):
                if link_only:
                    ph.fill()
                else:
                    ph.poison()
                out = ph.run(v, k, rate, True)
                torch.cuda.synchronize()
                same = ph.same(out, preset)
            if not same:
                why = "differs from the preset layer (a row tile read before its rows?)"
                res["refused"].append(dict(base, **v, kind="pull", gbps=gbps, why=why))
                print(f"  {case} at {link}: {why}; not timed", flush=True)
                continue
            with watchdog.case(f"{case} at {link}"):
                ms = time_ms(lambda v=v, rate=rate: ph.run(v, k, rate, True), a.iters, a.rounds)
            link_ms = remote_bytes / rate * 1e3 if rate > 0 else pull_ms
            row = dict(base, **v, kind="pull", gbps=gbps, preset_ms=preset_ms,
                       **hidden_row(ms, plain_ms, preset_ms, link_ms))  # fmt: skip
            res["rows"].append(row)
            print(
                f"  {ph.name:8s} k={k:2d} {label:19s} {link:9s}: layer {ms:.3f} ms, exposed {row['exposed_ms']:.3f} "
                f"of link {link_ms:.3f} ms: hidden {row['hidden']:.1%} (slowdown {row['slowdown_ms']:+.3f}, "
                f"waiting {row['waiting_ms']:+.3f})",
                flush=True,
            )


def both_rows(rows: list[dict]) -> list[dict]:
    """Forward plus backward: per backward row, the forward row of the same slice, K, combine, copy path, kind
    and rate; times, exposed and link times summed, hidden = 1 - exposed / link of the sums."""
    key = ("shape", "k", "combine", "copy", "kind", "gbps")
    fwd = {tuple(r[n] for n in key): r for r in rows if r["phase"] == "forward"}
    out = []
    for b in rows:
        f = fwd.get(tuple(b[n] for n in key)) if b["phase"] == "backward" else None
        if f is None:
            continue
        link = f["link_ms"] + b["link_ms"]
        out.append(
            dict(
                {n: b[n] for n in key},
                phase="both",
                wgrad=b["wgrad"],
                plain_ms=f["plain_ms"] + b["plain_ms"],
                remote_bytes=f["remote_bytes"] + b["remote_bytes"],
                preset_ms=f["preset_ms"] + b["preset_ms"],
                **hidden_row(f["layer_ms"] + b["layer_ms"], f["plain_ms"] + b["plain_ms"],
                             f["preset_ms"] + b["preset_ms"], link),
            )
        )  # fmt: skip
    return out


def print_table(res: dict) -> None:
    print(
        f"\n{'slice':18s} {'phase':8s} {'k':>3s} {'combine':7s} {'wgrad':6s} {'copy':9s} {'link':>9s} {'plain':>7s} "
        f"{'preset':>7s} {'layer':>7s} {'exposed':>8s} {'link ms':>8s} {'hidden':>7s}"
    )
    for r in res["rows"]:
        link = "preset" if r["kind"] == "preset" else ("unpaced" if not r["gbps"] else f"{r['gbps']:g} GB/s")
        hidden = "" if r["hidden"] is None else f"{r['hidden']:.1%}"
        link_ms = "" if r["kind"] == "preset" else f"{r['link_ms']:.3f}"
        print(
            f"{r['shape']:18s} {r['phase']:8s} {r['k']:3d} {r['combine']:7s} {r.get('wgrad', ''):6s} {r['copy']:9s} "
            f"{link:>9s} "
            f"{r['plain_ms']:7.3f} {r['preset_ms']:7.3f} {r['layer_ms']:7.3f} {r['exposed_ms']:8.3f} "
            f"{link_ms:>8s} {hidden:>7s}"
        )


def _parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--gbps {text!r}; it must be a comma list of GB/s, e.g. 900,450,0") from None
    if not rates or min(rates) < 0:
        raise ValueError(f"--gbps {text!r}; it must name at least one rate, every rate >= 0 (0: unpaced)")
    return list(dict.fromkeys(rates))


def _parse_copies(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in tp.COPIES]
    if bad or not names:
        raise ValueError(f"--copy {text!r}; it must be a comma list of {', '.join(tp.COPIES)}")
    return list(dict.fromkeys(names))


def _parse_combines(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in COMBINES]
    if bad or not names:
        raise ValueError(f"--combine {text!r}; it must be a comma list of {', '.join(COMBINES)}")
    return list(dict.fromkeys(names))


def _parse_phase(text: str) -> tuple[str, ...]:
    if text not in PHASES:
        raise ValueError(f"--phase {text!r}; it must be one of {', '.join(PHASES)}")
    return ("forward", "backward") if text == "both" else (text,)


def _parse_wgrads(text: str) -> list[str]:
    names = [w.strip() for w in text.split(",") if w.strip()]
    if not names or any(w not in WGRADS for w in names):
        raise ValueError(f"--wgrad {text!r}; it must be a comma list of {', '.join(WGRADS)}")
    return list(dict.fromkeys(names))


def _no_device() -> str | None:
    """Why this machine cannot run the tiles layer, or None."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return "needs an sm_90 GPU (QuACK's sm_90 kernels); none here"
    try:
        from mok_megatron.compat import require_quack_tile_gemm

        require_quack_tile_gemm()
    except ImportError as e:
        return f"needs QuACK: {e}"
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"a comma list of {', '.join(SHAPES)}")
    p.add_argument(
        "--k", default="2,4,8", help="SMs that communicate (held back from the GEMMs), a comma list"
    )
    p.add_argument("--gbps", default="900,450,0", help="paced link rates in GB/s, a comma list; 0: unpaced")
    p.add_argument(
        "--combine", default="beside,after", help="the combine beside fc2 (tile_combine) or after it"
    )
    p.add_argument(
        "--phase",
        default="both",
        help="forward, backward, or both (each timed on its own, then their sums per K, combine and rate)",
    )
    p.add_argument(
        "--wgrad",
        default="beside",
        help="the backward's weight gradients beside the rest on their own stream, or after it on the main "
        "stream, a comma list",
    )
    p.add_argument(
        "--copy",
        default=tp.COPIES[0],
        help=f"the pull's copy path ({', '.join(tp.COPIES)}: kernels.tile_pull; none: the link time only, no "
        "byte moved), a comma list",
    )
    p.add_argument("--chunk-rows", type=int, default=CHUNK_ROWS)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--case-timeout",
        type=float,
        default=120.0,
        help="seconds one check or timing may take (compilation not counted); past it the JSON gathered so "
        "far is written and the process exits with status 3; 0: no limit",
    )
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    try:
        ks = parse_ks(a.k)
        rates = _parse_rates(a.gbps)
        combines = _parse_combines(a.combine)
        a.copies = _parse_copies(a.copy)
        phases = _parse_phase(a.phase)
        wgrads = _parse_wgrads(a.wgrad)
    except ValueError as e:
        print(f"tile_layer: {e}", file=sys.stderr)
        return 2
    shapes = a.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        print(f"tile_layer: --shapes {','.join(unknown)}; known: {','.join(SHAPES)}", file=sys.stderr)
        return 2
    if min(ks) < 1:
        print(
            f"tile_layer: --k {a.k}; every K must be >= 1 (the pull's and the combine's programs)",
            file=sys.stderr,
        )
        return 2
    small = [
        f"--{n.replace('_', '-')} {getattr(a, n)}"
        for n in ("chunk_rows", "iters", "rounds")
        if getattr(a, n) < 1
    ]
    if small:
        print(f"tile_layer: {', '.join(small)}; each must be >= 1", file=sys.stderr)
        return 2
    why = _no_device()
    if why is not None:
        print(f"tile_layer: {why}", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in shapes:
        cfg = getattr(tg, SHAPE_CONFIG[name])
        for k in ks:
            bad = tg.sms_held_back_error(k, sms, cfg)
            if bad is not None:
                print(f"tile_layer: --k {k} for {name}: {bad}; drop it from --k", file=sys.stderr)
                return 2

    dev = torch.device("cuda")
    res = dict(
        device=torch.cuda.get_device_name(dev),
        argv=sys.argv[1:] if argv is None else argv,
        incomplete=None,
        shapes={},
        rows=[],
        refused=[],
        skipped=[],
    )
    if "none" in a.copies and 0.0 in rates:
        res["skipped"].append(dict(copy="none", gbps=0.0, error=UNPACED_LINK_ONLY))
        print(f"tile_layer: copy none unpaced skipped: {UNPACED_LINK_ONLY}", flush=True)

    def write(incomplete=None) -> str:
        if not a.json:
            return "no --json: nothing written"
        with open(a.json, "w") as fh:
            json.dump(dict(res, incomplete=incomplete), fh, indent=1)
        return f"results so far in {a.json}"

    watchdog = CaseWatchdog(a.case_timeout, lambda case: write(incomplete=f"timed out: {case}"))
    streams = (torch.cuda.Stream(), torch.cuda.Stream())  # the concurrent kernels', the weight gradients'
    try:
        with torch.no_grad():
            for name in shapes:
                sweep_shape(name, a, ks, rates, combines, phases, wgrads, watchdog, streams, res)
                torch.cuda.empty_cache()
    except ContextLost as e:
        where = write(incomplete=f"CUDA context lost: {e}")
        print(f"tile_layer: CUDA error, the context is lost ({e}); {where}", file=sys.stderr)
        return 4
    res["rows"] += both_rows(res["rows"])
    print_table(res)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
