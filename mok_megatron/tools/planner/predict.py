"""Layer and step predictions on a target cluster from a Calibration (H200-measured), scaled by
peak ratios. Every scaling is listed in ASSUMPTIONS (printed by ``mok plan``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mok_megatron.tools.planner import flops
from mok_megatron.tools.planner.calibrate import (
    DATA,
    PLAIN,
    STATES,
    H200_HBM,
    Calibration,
    family,
    gemm_efficiency,
    link_efficiency,
    split_mode,
)
from mok_megatron.tools.planner.hardware import Cluster
from mok_megatron.tools.planner.links import LinkError, LinkModel
from mok_megatron.tools.planner.shapes import Layout, LayoutError, Model, MoEShape

ASSUMPTIONS = (
    "GEMM rate on the target = its dense peak for the precision x the grouped-GEMM efficiency measured on the "
    "H200 (bf16 {bf16:.0%}; FP8 rowwise {fp8:.0%}, also used for MXFP8); attention and dense layers run at "
    "the same efficiency",
    "non-GEMM MoE time (permute, activation, combine) scales with HBM bandwidth (H200 4.8 TB/s); per-expert, "
    "fixed and host terms do not scale",
    "all-to-all at {link:.0%} of link peak (NCCL on 2 x H200); NVLink and NIC shares run concurrently; EP groups "
    "on consecutive GPUs; uniform routing; bf16 tokens on the wire for both layers",
    "MoK EP=1 work from the newest code state with EP=1 points ({ep1}); engine overhead = loopback "
    "overhead fraction x kappa (real EP / loopback, from the 2 x H200 runs of the newest code state "
    "measured on real EP, {engine}), times the layer's compute ({scaling}); exposed link fraction "
    "from the loopback sweep; transport factors (copy_engine / collective) from the same runs",
    "host-bound launch floor of Megatron / Megatron+TE (h0 + h x local experts) and of MoK (launches per "
    "layer x per-launch host cost, from the newest profiled code state) {host} on the target "
    "(measured = as on the H200 test host; hidden = CUDA graphs or a faster host remove it); run-to-run "
    "spread (~10 % between machine starts) not modelled: the typical machine is predicted",
    "Megatron alltoall (fitted): all-to-all fully exposed (as measured at EP=2); Megatron alltoall with "
    "--overlap-moe-expert-parallel-comm and MoK under the same flag (its plain engine: EP=1 work x "
    "(1 + P), P from the 2 x H200 plain-engine runs of {plain}) are bounds: the all-to-all entirely "
    "hidden behind another micro-batch (never measured here); the other MoK rows are fitted",
    "step = (micro-batches + (PP-1)/VPP) x per-micro-batch time / PP; DP gradient/parameter traffic, optimizer, "
    "TP communication, recompute and pipeline imbalance are not modelled",
)


@dataclass(frozen=True)
class Assumptions:
    overhead_scaling: str = (
        "relative"  # relative: engine overhead shrinks with the target's compute; absolute: H200 ms
    )
    host: str = (
        "hidden"  # hidden: no host floor on the target (CUDA graphs / fast host); measured: the H200 floor
    )

    def __post_init__(self):
        if self.overhead_scaling not in ("relative", "absolute"):
            raise ValueError(f"overhead_scaling={self.overhead_scaling!r}: must be relative or absolute")
        if self.host not in ("measured", "hidden"):
            raise ValueError(
                f"host={self.host!r}: must be measured (H200 host floor kept) or hidden (CUDA graphs / fast host)"
            )

    def text(self, cal: Calibration | None = None) -> list[str]:
        ep1 = engine = plain = STATES[-1]
        if cal is not None:
            engine = cal.overlap.engine()[0].name
            ep1 = next((g for g in reversed(STATES) if ("mok", g) in cal.compute_by_gen), "every source")
            plain = next((g for g in reversed(STATES) if g in cal.overlap.plain), "no code state")
        return [
            a.format(
                bf16=gemm_efficiency("bf16"),
                fp8=gemm_efficiency("fp8"),
                link=link_efficiency(),
                scaling=self.overhead_scaling,
                engine=engine,
                ep1=ep1,
                plain=plain,
                host=self.host,
            )
            for a in ASSUMPTIONS
        ]


@dataclass(frozen=True)
class Perturbation:
    """Relative changes of the fitted inputs, for the headline's held-out error bands and its
    sensitivity (0 = as fitted). Each scales what its validation measures: an EP=1 fit its EP=1 work
    (MoK's relative engine overhead follows, as the model has it), an EP>1 term the layer time given
    that EP=1 work (the anchored error)."""

    megatron_ep1: float = 0.0  # Megatron+TE's EP=1 work (both Megatron rows)
    megatron_ep: float = 0.0  # Megatron alltoall's layer given its EP=1 work
    mok_ep1: float = 0.0  # MoK's EP=1 work (every MoK row)
    mok_ep: float = 0.0  # MoK's pipelined layer given its EP=1 work
    mok_plain: float = 0.0  # MoK's plain-engine layer (under Megatron's 1F1B overlap) given its EP=1 work


@dataclass(frozen=True)
class LayerPrediction:
    impl: str  # megatron, megatron-1f1b, mok, mok-1f1b
    transport: str
    chunks: int
    mode: str
    t1_ms: float  # per-rank expert work, no communication
    overhead_ms: float
    link_ms: float
    exposed_ms: float
    total_ms: float


def _rate(cluster: Cluster, precision: str) -> float:
    return cluster.gpu.peak_tflops(precision) * gemm_efficiency(precision)


def layer_options(
    cal: Calibration,
    model: Model,
    layout: Layout,
    cluster: Cluster,
    a: Assumptions,
    d: Perturbation = Perturbation(),
) -> list[LayerPrediction]:
    """Megatron alltoall, the Megatron 1F1B bound, the MoK 1F1B bound (its plain engine under the same
    schedule) and MoK for every measured (minibatches, mode) and transport that can run on this
    placement, for one MoE layer of one micro-batch (fwd+bwd)."""
    layout.check(model)
    if layout.ep < 2:
        raise LayoutError(
            f"{model.name}: EP={layout.ep}: MoK's overlap pipeline needs expert parallelism; at EP=1 both "
            "layers run the same per-rank work with no exchange, so there is nothing to plan. Plan a "
            "layout with EP > 1 (--ep, or a recipe whose --expert-model-parallel-size is > 1)."
        )
    moe, ep, tokens = model.moe, layout.ep, layout.moe_tokens(model)
    local = MoEShape(moe.hidden, moe.ffn, moe.experts // ep, moe.topk)
    rate, hbm = _rate(cluster, layout.precision), H200_HBM / cluster.gpu.hbm_tbps
    link = LinkModel(link_efficiency())
    meg_fit = cal.compute.get("megatron-te") or cal.compute["megatron"]
    lm = link.seconds(flops.megatron_bytes(tokens, moe, ep), cluster, ep) * 1e3
    meg_scale = 1 + d.megatron_ep1
    if a.host == "measured":
        t1m = meg_fit.ms(tokens, local, rate, hbm) * meg_scale
        tm = meg_fit.ep_ms(tokens, local, lm / meg_scale, rate, hbm) * meg_scale  # the link does not scale
    else:
        t1m = meg_fit.gpu_ms(tokens, local, rate, hbm) * meg_scale
        tm = t1m + lm
    tm *= 1 + d.megatron_ep
    out = [
        LayerPrediction("megatron", "nccl a2a", 1, "-", t1m, 0.0, lm, tm - t1m, tm),
        LayerPrediction("megatron-1f1b", "nccl a2a", 1, "-", t1m, 0.0, lm, 0.0, t1m),
    ]
    fit = cal.fit("mok")[0]
    t1 = fit.ms(tokens, local, rate, hbm) * (1 + d.mok_ep1)
    base = t1 if a.overhead_scaling == "relative" else fit.ms(tokens, local) * (1 + d.mok_ep1)
    nbytes = flops.mok_bytes(tokens, moe, ep)
    fam = family(local, tokens)
    ov = cal.overlap
    floor = cal.host_floor()
    plain = ov.plain_overhead(local, tokens)
    if plain is not None:  # the plain engine, its all-to-all (Megatron's bytes) hidden by the 1F1B schedule
        work = (t1 + plain[0] * base) * (1 + d.mok_plain)
        tp = work
        if floor is not None and a.host == "measured":  # exact: no CUDA graph, the enqueue floor applies
            tp = max(tp, floor.ms(PLAIN, 1) or 0.0)
        out.append(LayerPrediction("mok-1f1b", "nccl a2a", 1, PLAIN, t1, work - t1, lm, 0.0, tp))
    for transport in ("collective", "copy_engine"):
        try:
            lk = link.seconds(nbytes, cluster, ep, transport) * 1e3
        except LinkError:
            continue
        for chunks, mode in ov.options(fam):
            if not any(split_mode(mode)[0] in e.kappa or mode in e.kappa for e in ov.engines.values()):
                continue  # never measured on real EP: its real-EP overhead (kappa) is unknown
            big_o, e = ov.oe((fam, chunks, mode))
            o = big_o * ov.k(mode) * base
            ex = e * lk
            tot = (t1 + o + ex) * ov.factor(transport) * (1 + d.mok_ep)
            if floor is not None and a.host == "measured" and "graph" not in mode:  # H200 host enqueue floor
                tot = max(tot, floor.ms(transport, chunks, split_mode(mode)[1]) or 0.0)
            out.append(LayerPrediction("mok", transport, chunks, mode, t1, o, lk, ex, tot))
    if not any(o.impl == "mok" for o in out):
        raise LayoutError(
            f"{model.name}: no measured MoK configuration applies to its nearest loopback shape {fam!r} "
            f"on {cluster.name} at EP={ep}; mok plan predicts only configurations measured on the loopback "
            "and on real EP (mok plan --validate lists them)."
        )
    return out


def best(options: list[LayerPrediction], impl: str) -> LayerPrediction:
    return min((o for o in options if o.impl == impl), key=lambda o: o.total_ms)


def local_rows_choice(fast_link: bool) -> str:
    """--mok-local-rows preferred among options within the margin: fused over a fast link (inside one
    NVLink domain), overlap over a slow one - what ``auto`` does, and what the loopback sweeps
    measured (fused at least as fast at 450 GB/s with 2-4 minibatches, overlap at 50 GB/s)."""
    return "fused" if fast_link else "overlap"


def recommended(options: list[LayerPrediction], fast_link: bool = True) -> LayerPrediction:
    """The simplest MoK configuration (collective, exact, the local rows for this link, fewest
    minibatches first) within the recommendation margin (calibration.json) of the fastest one."""
    fastest = best(options, "mok").total_ms
    margin = DATA["recommendation_margin"]["value"]
    near = [o for o in options if o.impl == "mok" and o.total_ms <= fastest * (1 + margin)]
    pick = local_rows_choice(fast_link)
    return min(
        near,
        key=lambda o: (
            o.transport != "collective",
            split_mode(o.mode)[0] != "exact",
            split_mode(o.mode)[1] not in (pick, ""),
            o.chunks,
            o.total_ms,
        ),
    )


def capacity_multiplier(model: Model, layout: Layout, sigmas: float = 4.0) -> float:
    """Smallest of 0.25/0.5/0.75/1.0 that holds the tokens one source sends one destination rank
    (binomial, uniform routing) at ``sigmas`` standard deviations; routing skew is not modelled."""
    t, p = layout.moe_tokens(model), flops.p_visit(model.moe, layout.ep)
    need = (t * p + sigmas * math.sqrt(t * p * (1 - p))) / t
    return next((c for c in (0.25, 0.5, 0.75) if need <= c), 1.0)


@dataclass(frozen=True)
class StepPrediction:
    layer: LayerPrediction
    other_ms_per_mb: (
        float  # attention, dense FFN, router, shared expert, logits: whole model, one micro-batch
    )
    step_s: float
    tokens_per_s_gpu: float
    tflops_per_gpu: float


def step(model: Model, layout: Layout, cluster: Cluster, layer: LayerPrediction) -> StepPrediction:
    rate = _rate(cluster, layout.precision) * 1e12
    ntok = layout.micro_batch * model.seq / (layout.tp * layout.cp)  # per rank, per micro-batch
    att = flops.attention_flops_per_token(model.attention, model.hidden, model.seq)
    moe = model.moe
    router_shared = 2 * moe.hidden * moe.experts + 6.0 * moe.shared_ffn * moe.hidden
    dense = 6.0 * model.dense_ffn * model.hidden
    n_moe = model.moe_layers + model.mtp_layers
    per_tok = (
        (model.layers + model.mtp_layers) * att
        + (model.layers - model.moe_layers) * dense
        + n_moe * router_shared
        + (1 + model.mtp_layers) * 2 * model.hidden * model.vocab
    )
    other = flops.FWD_BWD * per_tok * ntok / rate * 1e3
    mb_ms = other + n_moe * layer.total_ms
    step_s = (layout.microbatches + (layout.pp - 1) / layout.vpp) * mb_ms / layout.pp / 1e3
    tokens = layout.global_batch * model.seq
    return StepPrediction(
        layer,
        other,
        step_s,
        tokens / step_s / layout.world,
        flops.model_flops_per_token(model) * tokens / step_s / layout.world / 1e12,
    )
