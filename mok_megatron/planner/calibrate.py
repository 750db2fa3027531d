"""Fit the layer model to the measurements (measurements.py). Every number it returns comes from a
result file or from the measured baselines quoted in issue 9 (BASELINES); nothing else is tuned.

Layer model, one MoE layer forward + backward on one rank, H200 (ms):
  EP=1 work   t1 = max(FLOP / R + a * traffic_bytes + c * local_experts,  h * local_experts)
              R = measured grouped-GEMM rate; a, c, h fitted per implementation (relative least
              squares); h (host-bound per-expert loop) only for Megatron without TE (SequentialMLP).
  Megatron    t1 + link   (no overlap inside the layer; bytes per (token, expert) pair)
  MoK         t1 + kappa * O(chunks, mode) * t1 + e(chunks, mode) * link   (deduplicated bytes)
              O: engine overhead with an infinitely fast link, as a fraction of the plain layer,
              and e: the exposed fraction of link time, both from the loopback sweep;
              kappa: real-EP overhead / loopback overhead, from the 2 x H200 runs.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from mok_megatron.bench_overlap import OVERLAP_SHAPES
from mok_megatron.planner import flops
from mok_megatron.planner.measurements import EPPoint, Layer1, Measurements
from mok_megatron.planner.shapes import MoEShape

# Measured baselines quoted in issue 9 (H200 and 2 x H200; ranges over shapes). Midpoints are used.
BASELINES = {
    "grouped_gemm_bf16_tflops": (627.0, 732.0),  # torch._grouped_mm, bf16, H200
    "grouped_gemm_fp8_tflops": (807.0, 1221.0),  # FP8 rowwise grouped GEMM, H200
    "nccl_a2a_gbps": (208.0, 280.0),  # NCCL all_to_all per rank, 2 x H200 NVLink
}
H200_BF16_PEAK, H200_FP8_PEAK, H200_NVLINK, H200_HBM = 989.4, 1978.9, 450.0, 4.8


def mid(key: str) -> float:
    lo, hi = BASELINES[key]
    return (lo + hi) / 2


def gemm_efficiency(precision: str) -> float:
    """Achieved / peak of the grouped GEMM, measured on the H200 (FP8 rowwise stands in for MXFP8)."""
    if precision == "bf16":
        return mid("grouped_gemm_bf16_tflops") / H200_BF16_PEAK
    return mid("grouped_gemm_fp8_tflops") / H200_FP8_PEAK


def link_efficiency() -> float:
    return mid("nccl_a2a_gbps") / H200_NVLINK


@dataclass(frozen=True)
class ComputeFit:
    impl: str
    a_ms_per_byte: float
    c_ms_per_expert: float
    h_ms_per_expert: float
    points: int

    def gpu_ms(self, tokens: int, moe: MoEShape, rate_tflops: float, hbm_scale: float = 1.0) -> float:
        gemm = flops.expert_flops(tokens, moe) / (rate_tflops * 1e12) * 1e3
        return (
            gemm
            + self.a_ms_per_byte * flops.token_traffic_bytes(tokens, moe) * hbm_scale
            + self.c_ms_per_expert * moe.experts
        )

    def ms(
        self, tokens: int, moe: MoEShape, rate_tflops: float | None = None, hbm_scale: float = 1.0
    ) -> float:
        rate = rate_tflops or mid("grouped_gemm_bf16_tflops")
        return max(self.gpu_ms(tokens, moe, rate, hbm_scale), self.h_ms_per_expert * moe.experts)


HOST_BOUND = {"megatron"}  # SequentialMLP: one GEMM launch per expert from Python
HOST_BOUND_MIN_EXPERTS = 32


def _ls(cols: list[list[float]], y: list[float], w: list[float]) -> list[float]:
    """Weighted least squares for 1 or 2 non-negative coefficients (drops a negative one and refits)."""
    if len(cols) == 2:
        a11 = sum((x * q) ** 2 for x, q in zip(cols[0], w, strict=True))
        a22 = sum((x * q) ** 2 for x, q in zip(cols[1], w, strict=True))
        a12 = sum(x * z * q * q for x, z, q in zip(cols[0], cols[1], w, strict=True))
        b1 = sum(x * v * q * q for x, v, q in zip(cols[0], y, w, strict=True))
        b2 = sum(x * v * q * q for x, v, q in zip(cols[1], y, w, strict=True))
        det = a11 * a22 - a12 * a12
        if det > 1e-12 * a11 * a22:
            p = [(b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det]
            if min(p) >= 0:
                return p
        p0, p1 = _ls(cols[:1], y, w)[0], _ls(cols[1:], y, w)[0]
        r0 = sum(((p0 * x - v) * q) ** 2 for x, v, q in zip(cols[0], y, w, strict=True))
        r1 = sum(((p1 * x - v) * q) ** 2 for x, v, q in zip(cols[1], y, w, strict=True))
        return [p0, 0.0] if r0 <= r1 else [0.0, p1]
    num = sum(x * v * q * q for x, v, q in zip(cols[0], y, w, strict=True))
    den = sum((x * q) ** 2 for x, q in zip(cols[0], w, strict=True))
    return [max(num / den, 0.0) if den else 0.0]


def fit_compute(points: list[Layer1], impl: str) -> ComputeFit:
    pts = [p for p in points if p.impl == impl]
    if not pts:
        raise ValueError(f"no EP=1 measurement of {impl!r} to calibrate from")
    rate = mid("grouped_gemm_bf16_tflops") * 1e12
    gemm = [flops.expert_flops(p.tokens, p.moe) / rate * 1e3 for p in pts]
    if impl in HOST_BOUND:
        gpu = [(p, g) for p, g in zip(pts, gemm, strict=True) if p.moe.experts < HOST_BOUND_MIN_EXPERTS]
        host = [p for p in pts if p.moe.experts >= HOST_BOUND_MIN_EXPERTS]
        a = (
            _ls(
                [[flops.token_traffic_bytes(p.tokens, p.moe) for p, _ in gpu]],
                [p.ms - g for p, g in gpu],
                [1 / p.ms for p, _ in gpu],
            )[0]
            if gpu
            else 0.0
        )
        h = (
            _ls([[p.moe.experts for p in host]], [p.ms for p in host], [1 / p.ms for p in host])[0]
            if host
            else 0.0
        )
        return ComputeFit(impl, a, 0.0, h, len(pts))
    a, c = _ls(
        [[flops.token_traffic_bytes(p.tokens, p.moe) for p in pts], [float(p.moe.experts) for p in pts]],
        [p.ms - g for p, g in zip(pts, gemm, strict=True)],
        [1 / p.ms for p in pts],
    )
    return ComputeFit(impl, a, c, 0.0, len(pts))


def family(moe: MoEShape, tokens: int) -> str:
    """The loopback shape nearest to this one (log distance in hidden size, then tokens)."""
    cands = [n for n in OVERLAP_SHAPES if n != "tiny"]

    def dist(n):
        s = OVERLAP_SHAPES[n]
        return (abs(math.log(s["hidden"] / moe.hidden)), abs(math.log(s["tokens"] / tokens)))

    return min(cands, key=dist)


@dataclass(frozen=True)
class OverlapFit:
    """Per (loopback shape, minibatch count, mode): overhead fraction O and exposed link fraction e
    (medians over runs), and kappa per mode (real EP / loopback overhead)."""

    overhead: dict  # (shape, chunks, mode) -> O
    exposed: dict  # (shape, chunks, mode) -> e
    kappa: dict  # mode -> kappa; "*" pooled
    transport_factor: dict  # transport -> t(transport) / t(collective) at EP=2

    def options(self, shape: str) -> list[tuple[int, str]]:
        return sorted({(c, m) for (s, c, m) in self.overhead if s == shape and (s, c, m) in self.exposed})

    def k(self, mode: str) -> float:
        return self.kappa.get(mode, self.kappa["*"])


def _loop_tables(m: Measurements):
    over, expo = {}, {}
    by = {}
    for r in m.loop:
        by.setdefault((r.source, r.shape, r.chunks, r.mode), []).append(r)
    o_runs, e_runs = {}, {}
    for (_src, shape, chunks, mode), rows in by.items():
        inf = [r for r in rows if r.gbps == 0]
        if not inf:
            continue
        o_abs = inf[0].ms - inf[0].t0_ms
        o_runs.setdefault((shape, chunks, mode), []).append(o_abs / inf[0].t0_ms)
        fin = [r for r in rows if r.gbps > 0]
        if fin:
            num = sum((r.ms - r.t0_ms - o_abs) * r.link_ms for r in fin)
            den = sum(r.link_ms**2 for r in fin)
            e_runs.setdefault((shape, chunks, mode), []).append(min(max(num / den, 0.0), 1.5))
    for k, v in o_runs.items():
        over[k] = statistics.median(v)
    for k, v in e_runs.items():
        expo[k] = statistics.median(v)
    return over, expo


def mok_link_ms(p: EPPoint, eff: float | None = None) -> float:
    nbytes = flops.mok_bytes(p.tokens, p.moe, p.ep)
    return nbytes / (H200_NVLINK * 1e9 * (eff or link_efficiency())) * 1e3


def megatron_link_ms(p: EPPoint, eff: float | None = None) -> float:
    nbytes = flops.megatron_bytes(p.tokens, p.moe, p.ep)
    return nbytes / (H200_NVLINK * 1e9 * (eff or link_efficiency())) * 1e3


def fit_overlap(m: Measurements) -> OverlapFit:
    over, expo = _loop_tables(m)
    ones = {(p.source, p.shape): p.ms for p in m.layer1 if p.impl == "mok"}
    kap: dict[str, list[float]] = {}
    for p in m.ep:
        if p.impl != "mok" or p.transport == "plain" or (p.source, p.shape) not in ones:
            continue
        fam = family(MoEShape(p.moe.hidden, p.moe.ffn, p.moe.experts // p.ep, p.moe.topk), p.tokens)
        key = (fam, p.chunks, p.mode)
        if key not in over or key not in expo or over[key] <= 0:
            continue
        t1 = ones[(p.source, p.shape)]
        real = p.ms - t1 - expo[key] * mok_link_ms(p)
        kap.setdefault(p.mode, []).append(real / (over[key] * t1))
    if not kap:
        raise ValueError("no MoK EP>1 measurement matches a loopback row: cannot calibrate kappa")
    kappa = {mode: statistics.median(v) for mode, v in kap.items()}
    kappa["*"] = statistics.median([x for v in kap.values() for x in v])
    coll = {(p.source, p.shape, p.chunks, p.mode): p.ms for p in m.ep if p.transport == "collective"}
    ratios: dict[str, list[float]] = {}
    for p in m.ep:
        key = (p.source, p.shape, p.chunks, p.mode)
        if p.impl == "mok" and p.transport not in ("plain", "collective") and key in coll:
            ratios.setdefault(p.transport, []).append(p.ms / coll[key])
    factor = {"collective": 1.0, **{t: statistics.median(v) for t, v in ratios.items()}}
    return OverlapFit(over, expo, kappa, factor)


@dataclass(frozen=True)
class Calibration:
    compute: dict  # impl -> ComputeFit
    overlap: OverlapFit
    sources: tuple  # measurement sources used

    def mok_ep_ms(
        self, t1: float, link_ms: float, shape: str, chunks: int, mode: str, transport: str
    ) -> float:
        key = (shape, chunks, mode)
        o = self.overlap.overhead[key] * self.overlap.k(mode) * t1
        return (t1 + o + self.overlap.exposed[key] * link_ms) * self.overlap.transport_factor.get(
            transport, 1.0
        )


def calibrate(m: Measurements) -> Calibration:
    impls = sorted({p.impl for p in m.layer1})
    sources = tuple(
        sorted({p.source for p in m.layer1} | {p.source for p in m.ep} | {p.source for p in m.loop})
    )
    return Calibration({i: fit_compute(list(m.layer1), i) for i in impls}, fit_overlap(m), sources)
