"""Fit the layer model to the measurements (data/measurements.json). Every number it returns comes from
a measured record or from data/calibration.json (measured baselines, which MoK code state each source
timed); nothing else is tuned.

Layer model, one MoE layer forward + backward on one rank, H200 (ms):
  EP=1 work   t1 = max(gpu, host)
              gpu  = FLOP / R + a * traffic_bytes + c * local_experts + d
              host = h0 + h * local_experts        (host-bound implementations only)
              R = measured grouped-GEMM rate; a, c, d (d: fixed cost per layer, e.g. MoK's engine) and
              h0, h fitted per implementation by non-negative relative least squares. The host line is
              the profiles' finding: Megatron without TE (SequentialMLP) and Megatron+TE (GroupedLinear)
              launch kernels per expert, and with many small experts the host enqueue time per launch
              (25-45 us under the profiler) exceeds the GPU work per launch.
  Megatron    gpu + link when GPU-bound; host + x * link when host-bound (x: the exposed fraction of
              the all-to-all, which partly runs in the GPU's idle gaps; median over the host-bound EP>1
              points, within [0, 1]); bytes per (token, expert) pair
  MoK         (t1 + kappa * O(chunks, mode) * t1 + e(chunks, mode) * link) * f(transport)
              O: engine overhead with an infinitely fast link, as a fraction of the plain layer, and
              e: the exposed fraction of link time, both from the loopback sweep; kappa (per code
              state and mode): real-EP overhead / loopback overhead; f: transport time / collective
              time, per code state, from the 2 x H200 runs.
  MoK plain   t1 + P * t1 + link (the six-phase engine without the pipeline, e.g. under Megatron's
              --overlap-moe-expert-parallel-comm): P, its EP>1 work beyond the EP=1 layer (the sort by
              local expert and the host-read splits the EP=1 plan does without), per code state and
              loopback shape from the 2 x H200 plain rows; link: one bf16 row per (token, expert) pair
              on another rank, as Megatron's dispatcher sends (engine/plain.py)
MoK's own EP=1 fit is made per code state when the state has enough points (its kernels changed
with the code); other implementations are fitted over every source.
Run-to-run spread (separate machine starts differ ~10 %) is not modelled: every fit is a relative
least-squares (or median) fit over all sources, i.e. the model predicts the typical machine.
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
from dataclasses import dataclass, field, replace

from mok_megatron.tools.planner import flops
from mok_megatron.tools.planner.hardware import GPUS
from mok_megatron.tools.planner.measurements import EPPoint, Layer1, Measurements, read_data
from mok_megatron.tools.planner.shapes import MoEShape

DATA = read_data("calibration.json")
# the loopback sweep's shapes (per-rank slice, emulated EP size), as ``mok_megatron.bench.shapes`` defines them
LOOPBACK_SHAPES = read_data()["loopback_shapes"]
H200 = GPUS["H200"]
H200_BF16_PEAK, H200_FP8_PEAK, H200_NVLINK, H200_HBM = (
    H200.bf16_tflops,
    H200.fp8_tflops,
    H200.nvlink_gbps,
    H200.hbm_tbps,
)


def mid(key: str) -> float:
    lo, hi = DATA["baselines"][key]["range"]
    return (lo + hi) / 2


def gemm_efficiency(precision: str) -> float:
    """Achieved / peak of the grouped GEMM, measured on the H200 (FP8 rowwise stands in for MXFP8)."""
    if precision == "bf16":
        return mid("grouped_gemm_bf16_tflops") / H200_BF16_PEAK
    return mid("grouped_gemm_fp8_tflops") / H200_FP8_PEAK


def link_efficiency() -> float:
    return mid("nccl_a2a_gbps") / H200_NVLINK


STATES = [g["name"] for g in DATA["code_states"]]  # MoK code states, oldest code first
ENGINE_IMPLS = {"mok"}  # implementations whose own code changes between code states


def state_of(source: str) -> str | None:
    """The MoK code state a source timed (data/calibration.json); None when it is not declared there
    (its MoK rows are then left out of every fit: see declared_only)."""
    for g in DATA["code_states"]:
        if source in g["sources"]:
            return g["name"]
    return None


def kernels_of(state: str | None) -> str | None:
    """The state whose EP=1 layer kernels ``state`` runs: its ``kernels`` entry in calibration.json
    when only the EP>1 pipeline changed, else itself. MoK's EP=1 fit pools every state that shares
    the kernels."""
    for g in DATA["code_states"]:
        if g["name"] == state:
            return g.get("kernels", state)
    return state


def undeclared(m: Measurements) -> tuple[str, ...]:
    """Sources with MoK rows but no code state in calibration.json."""
    mok = [p.source for p in m.layer1 if p.impl in ENGINE_IMPLS]
    mok += [p.source for p in m.ep if p.impl in ENGINE_IMPLS] + [r.source for r in m.loop]
    return tuple(s for s in dict.fromkeys(mok) if state_of(s) is None)


LOCAL_ROWS = ("overlap", "fused")  # --mok-local-rows choices a mode label may end with


def split_mode(label: str) -> tuple[str, str]:
    """("sync-free+graph fused") -> ("sync-free+graph", "fused"); a label without local rows (code
    before the --mok-local-rows option, or auto) -> (label, "")."""
    words = label.split()
    if len(words) > 1 and words[-1] in LOCAL_ROWS:
        return " ".join(words[:-1]), words[-1]
    return label, ""


def auto_local_rows(source: str, gbps: float) -> str:
    """The local rows ``--mok-local-rows auto`` chose for an unlabelled loopback row of ``source``
    (calibration.json: local_rows_auto of its code state, per emulated link GB/s); "" when the
    state declares no auto rule (code without the option) or not for this link speed."""
    for g in DATA["code_states"]:
        rule = g.get("local_rows_auto")
        if source in g["sources"] and rule:
            for choice in LOCAL_ROWS:
                if gbps in rule.get(f"{choice}_gbps", []):
                    return choice
    return ""


def labelled(m: Measurements) -> Measurements:
    """Loopback rows of a code state with an auto local-rows rule get the explicit label
    ("exact" -> "exact fused"), so they are tabled with the labelled rows of later states."""
    loop = []
    for r in m.loop:
        base, rows = split_mode(r.mode)
        auto = "" if rows else auto_local_rows(r.source, r.gbps)
        loop.append(replace(r, mode=f"{base} {auto}") if auto else r)
    return replace(m, loop=tuple(loop))


def declared_only(m: Measurements) -> Measurements:
    """``m`` without the MoK rows (EP=1, EP>1, loopback) of undeclared sources: they timed MoK code of
    unknown state, so fitting them to any state would be a guess. Other implementations' rows stay
    (their code does not change with MoK's). Loopback rows are labelled with their local rows."""
    bad = set(undeclared(m))
    m = labelled(m)
    if not bad:
        return m
    return replace(
        m,
        layer1=tuple(p for p in m.layer1 if not (p.source in bad and p.impl in ENGINE_IMPLS)),
        ep=tuple(p for p in m.ep if not (p.source in bad and p.impl in ENGINE_IMPLS)),
        loop=tuple(r for r in m.loop if r.source not in bad),
    )


def undeclared_report(m: Measurements) -> str:
    """One line naming the undeclared sources and the fix; empty when every source is declared."""
    bad = undeclared(m)
    if not bad:
        return ""
    return (
        f"Sources without a code state: {', '.join(bad)}. Their MoK rows are not used by any fit "
        "(Megatron/TE/torchtitan rows are). Fix: list each in code_states of "
        "mok_megatron/tools/planner/data/calibration.json (docs/planner.md, 'Adding a measurement')."
    )


# ---- EP=1 work ------------------------------------------------------------------------------------

HOST_BOUND = {"megatron", "megatron-te"}  # kernel launches per expert (SequentialMLP, TE GroupedLinear)
HOST_BOUND_MIN_EXPERTS = 32  # initial regime guess only; the fit reassigns points


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b, strict=True)]
    for i in range(n):
        piv = max(range(i, n), key=lambda r: abs(m[r][i]))
        if abs(m[piv][i]) < 1e-30:
            return None
        m[i], m[piv] = m[piv], m[i]
        for r in range(n):
            if r != i:
                f = m[r][i] / m[i][i]
                m[r] = [x - f * y for x, y in zip(m[r], m[i], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def _nnls(cols: list[list[float]], y: list[float], w: list[float]) -> list[float]:
    """Weighted least squares with non-negative coefficients, by trying every subset of columns
    (at most 3 columns here, so 7 subsets)."""
    best, best_r = [0.0] * len(cols), sum((v * q) ** 2 for v, q in zip(y, w, strict=True))
    for k in range(1, len(cols) + 1):
        for sub in itertools.combinations(range(len(cols)), k):
            a = [[sum(cols[i][n] * cols[j][n] * w[n] ** 2 for n in range(len(y))) for j in sub] for i in sub]
            b = [sum(cols[i][n] * y[n] * w[n] ** 2 for n in range(len(y))) for i in sub]
            p = _solve(a, b)
            if p is None or min(p) < 0:
                continue
            coef = [0.0] * len(cols)
            for i, v in zip(sub, p, strict=True):
                coef[i] = v
            r = sum(
                ((sum(coef[i] * cols[i][n] for i in range(len(cols))) - y[n]) * w[n]) ** 2
                for n in range(len(y))
            )
            if r < best_r * (1 - 1e-12):
                best, best_r = coef, r
    return best


@dataclass(frozen=True)
class ComputeFit:
    impl: str
    a_ms_per_byte: float
    c_ms_per_expert: float
    d_ms: float  # fixed GPU/engine cost per layer
    h0_ms: float  # host-bound line: h0 + h * local experts
    h_ms_per_expert: float
    points: int
    host_link_exposed: float = 1.0  # EP>1, host-bound: exposed fraction of the all-to-all (fitted)

    def gpu_ms(self, tokens: int, moe: MoEShape, rate_tflops: float, hbm_scale: float = 1.0) -> float:
        gemm = flops.expert_flops(tokens, moe) / (rate_tflops * 1e12) * 1e3
        return (
            gemm
            + self.a_ms_per_byte * flops.token_traffic_bytes(tokens, moe) * hbm_scale
            + self.c_ms_per_expert * moe.experts
            + self.d_ms
        )

    def host_ms(self, moe: MoEShape) -> float:
        return self.h0_ms + self.h_ms_per_expert * moe.experts if self.h_ms_per_expert else 0.0

    def ms(
        self, tokens: int, moe: MoEShape, rate_tflops: float | None = None, hbm_scale: float = 1.0
    ) -> float:
        rate = rate_tflops or mid("grouped_gemm_bf16_tflops")
        return max(self.gpu_ms(tokens, moe, rate, hbm_scale), self.host_ms(moe))

    def ep_ms(
        self,
        tokens: int,
        moe: MoEShape,
        link_ms: float,
        rate_tflops: float | None = None,
        hbm_scale: float = 1.0,
    ) -> float:
        """Megatron alltoall at EP>1: the all-to-all is fully exposed behind GPU-bound work; when the
        layer is host-bound part of it runs in the GPU's idle gaps (exposed fraction fitted)."""
        rate = rate_tflops or mid("grouped_gemm_bf16_tflops")
        gpu, host = self.gpu_ms(tokens, moe, rate, hbm_scale), self.host_ms(moe)
        if host > gpu:
            return max(host + self.host_link_exposed * link_ms, gpu + link_ms)
        return gpu + link_ms

    def host_bound(self, tokens: int, moe: MoEShape) -> bool:
        return self.host_ms(moe) > self.gpu_ms(tokens, moe, mid("grouped_gemm_bf16_tflops"))


def _gemm_ms(p: Layer1) -> float:
    return flops.expert_flops(p.tokens, p.moe) / (mid("grouped_gemm_bf16_tflops") * 1e12) * 1e3


def _fit_gpu(pts: list[Layer1]) -> tuple[float, float, float]:
    if not pts:
        return 0.0, 0.0, 0.0
    a, c, d = _nnls(
        [
            [flops.token_traffic_bytes(p.tokens, p.moe) for p in pts],
            [float(p.moe.experts) for p in pts],
            [1.0] * len(pts),
        ],
        [p.ms - _gemm_ms(p) for p in pts],
        [1 / p.ms for p in pts],
    )
    return a, c, d


def _fit_host(pts: list[Layer1]) -> tuple[float, float]:
    if not pts:
        return 0.0, 0.0
    cols = [[1.0] * len(pts), [float(p.moe.experts) for p in pts]]
    if len({p.moe.experts for p in pts}) < 2:
        cols = cols[1:]  # one expert count: the line through the origin
        return 0.0, _nnls(cols, [p.ms for p in pts], [1 / p.ms for p in pts])[0]
    h0, h = _nnls(cols, [p.ms for p in pts], [1 / p.ms for p in pts])
    return h0, h


def fit_compute(points: list[Layer1], impl: str) -> ComputeFit:
    pts = [p for p in points if p.impl == impl]
    if not pts:
        raise ValueError(f"no EP=1 measurement of {impl!r} to calibrate from")
    if impl not in HOST_BOUND:
        return ComputeFit(impl, *_fit_gpu(pts), 0.0, 0.0, len(pts))
    host = {i for i, p in enumerate(pts) if p.moe.experts >= HOST_BOUND_MIN_EXPERTS}
    for _ in range(10):  # alternate: fit each regime on its points, reassign each point to the max
        fit = ComputeFit(
            impl,
            *_fit_gpu([p for i, p in enumerate(pts) if i not in host]),
            *_fit_host([p for i, p in enumerate(pts) if i in host]),
            len(pts),
        )
        new = {i for i, p in enumerate(pts) if fit.host_bound(p.tokens, p.moe)}
        if new == host:
            break
        host = new
    return fit


# ---- MoK engine on real EP ----------------------------------------------------------------------


def family(moe: MoEShape, tokens: int, among=None) -> str:
    """The loopback shape nearest to this one (log distance in hidden size, then tokens), of ``among``
    (default: every loopback shape)."""
    cands = list(among or LOOPBACK_SHAPES)

    def dist(n):
        s = LOOPBACK_SHAPES[n]
        return (abs(math.log(s["hidden"] / moe.hidden)), abs(math.log(s["tokens"] / tokens)))

    return min(cands, key=dist)


def _joint_oe(fin: list) -> tuple[float, float] | None:
    """O and e of one source's rows without an infinite-link row: ms - t0 = O * t0 + e * link_ms,
    least squares over >= 2 distinct link speeds, O >= 0 and e in [0, 1.5] as for the pinned fit."""
    if len({r.gbps for r in fin}) < 2:
        return None
    t0 = fin[0].t0_ms
    o, e = _nnls([[t0] * len(fin), [r.link_ms for r in fin]], [r.ms - r.t0_ms for r in fin], [1.0] * len(fin))
    return o, min(e, 1.5)


def _loop_tables(m: Measurements, prior: dict | None = None):
    """Per (shape, minibatches, mode): O from each source's infinite-link row, e by least squares over
    its finite rows with O pinned. A source without an infinite-link row takes O measured by the
    other sources of this table, else from ``prior`` (an older state's O: a change such as the
    combine-backward order is about the link), else fits O and e jointly (_joint_oe)."""
    over, expo = {}, {}
    by = {}
    for r in m.loop:
        by.setdefault((r.source, r.shape, r.chunks, r.mode), []).append(r)
    o_runs, e_runs, later = {}, {}, []
    for (_src, shape, chunks, mode), rows in by.items():
        inf = [r for r in rows if r.gbps == 0]
        fin = [r for r in rows if r.gbps > 0]
        if not inf:
            later.append(((shape, chunks, mode), fin))
            continue
        o_runs.setdefault((shape, chunks, mode), []).append((inf[0].ms - inf[0].t0_ms) / inf[0].t0_ms)
        if fin:
            e_runs.setdefault((shape, chunks, mode), []).append(
                _pinned_e(fin, o_runs[(shape, chunks, mode)][-1])
            )
    measured = {k: statistics.median(v) for k, v in o_runs.items()}
    for key, fin in later:
        o = measured.get(key, (prior or {}).get(key))
        if o is None:
            both = _joint_oe(fin)
            if both:
                o_runs.setdefault(key, []).append(both[0])
                e_runs.setdefault(key, []).append(both[1])
        elif fin:
            e_runs.setdefault(key, []).append(_pinned_e(fin, o))
            o_runs.setdefault(key, []).append(o)
    for k, v in o_runs.items():
        over[k] = statistics.median(v)
    for k, v in e_runs.items():
        expo[k] = statistics.median(v)
    return over, expo


def _pinned_e(fin: list, o: float) -> float:
    """e with O fixed: least squares of ms - t0 - O * t0 = e * link_ms, within [0, 1.5]."""
    num = sum((r.ms - r.t0_ms - o * r.t0_ms) * r.link_ms for r in fin)
    return min(max(num / sum(r.link_ms**2 for r in fin), 0.0), 1.5)


def mok_link_ms(p: EPPoint, eff: float | None = None) -> float:
    nbytes = flops.mok_bytes(p.tokens, p.moe, p.ep)
    return nbytes / (H200_NVLINK * 1e9 * (eff or link_efficiency())) * 1e3


def megatron_link_ms(p: EPPoint, eff: float | None = None) -> float:
    nbytes = flops.megatron_bytes(p.tokens, p.moe, p.ep)
    return nbytes / (H200_NVLINK * 1e9 * (eff or link_efficiency())) * 1e3


def local_shape(p: EPPoint) -> MoEShape:
    return MoEShape(p.moe.hidden, p.moe.ffn, p.moe.experts // p.ep, p.moe.topk)


@dataclass(frozen=True)
class EngineFit:
    """One code state on real EP: kappa per mode and the transport factors."""

    name: str
    kappa: dict  # mode -> kappa
    transport_factor: dict  # transport -> t(transport) / t(collective), same run/shape/minibatches/mode
    points: int


# The loopback overhead O used by kappa (real-EP overhead / O) and by every prediction is at least the
# loopback's run-to-run noise, ~2 % of the plain layer (two sweeps of the same code): a mode whose pipelined
# layer ties or beats the plain one at an infinite link (overlapped local rows) would otherwise divide by ~0 (kappa
# in the hundreds) or predict a negative overhead. Fitting and prediction use the same floored O.
O_FLOOR = 0.02


@dataclass(frozen=True)
class OverlapFit:
    """Loopback tables per (loopback shape, minibatch count, mode): overhead fraction O and exposed
    link fraction e (medians over sources); the real-EP corrections per code state."""

    overhead: dict  # (shape, chunks, mode) -> O, medians over every source
    exposed: dict  # (shape, chunks, mode) -> e, medians over every source
    engines: dict = field(default_factory=dict)  # code state -> EngineFit
    by_gen: dict = field(default_factory=dict)  # code state -> (overhead, exposed) of its own loopback rows
    o_measured: frozenset = (
        frozenset()
    )  # keys with an infinite-link row in some source (O measured, not fitted)
    plain: dict = field(default_factory=dict)  # code state -> {loopback shape: P} (the plain engine)

    def plain_overhead(self, moe: MoEShape, tokens: int, gen: str | None = None) -> tuple[float, bool] | None:
        """P of the plain engine in code state ``gen`` (default: the newest state with plain rows) at the
        nearest loopback shape its plain rows measured; False with the newest other state's P when
        ``gen`` has no plain rows; None when no state has."""
        have = [g for g in reversed(STATES) if self.plain.get(g)]
        if not have:
            return None
        g = gen if gen in have else have[0]
        by_shape = self.plain[g]
        return by_shape[family(moe, tokens, by_shape)], gen is None or g == gen

    def oe(self, key: tuple, gen: str | None = None) -> tuple[float, float]:
        """O and e of a loopback (shape, minibatches, mode) for code state ``gen`` (default: the
        newest state whose own loopback rows have this key): the state's own loopback rows when it
        has this key, else the medians over every source. kappa is fitted against the same numbers,
        so the two stay consistent."""
        key = self._measured_key(key)
        if gen is None:
            gen = next((g for g in reversed(STATES) if key in self.by_gen.get(g, ({}, {}))[0]), None)
        over, expo = self.by_gen.get(gen, ({}, {}))
        if key in over and key in expo:
            return max(over[key], O_FLOOR), expo[key]
        return max(self.overhead[key], O_FLOOR), self.exposed[key]

    def _measured_key(self, key: tuple) -> tuple:
        """A labelled mode whose O no loopback row measured at infinite link (every "overlap" mode: its
        O would be fitted jointly with e, clamped to 0) uses the same base mode with fused local rows:
        kappa, fitted per mode on real EP, then carries what the local rows change (assumption)."""
        shape, chunks, mode = key
        base, rows = split_mode(mode)
        alt = (shape, chunks, f"{base} fused")
        if rows == "overlap" and self.o_measured and key not in self.o_measured and alt in self.o_measured:
            return alt
        return key

    def options(self, shape: str) -> list[tuple[int, str]]:
        """(minibatches, mode) measured for ``shape`` with O from an infinite-link row; once modes carry
        local rows, only the labelled ones: they are the current code, the unlabelled ones older code
        (auto chose fused at an infinite link, so every overlap mode's O comes from its fused twin)."""
        got = sorted({(c, m) for (s, c, m) in self.overhead if s == shape and (s, c, m) in self.exposed})
        if self.o_measured:  # a jointly fitted O (no infinite-link row anywhere) is not offered
            got = [(c, m) for c, m in got if (shape, c, m) in self.o_measured]
        new = [(c, m) for c, m in got if split_mode(m)[1]]
        return new or got

    def engine(self, gen: str | None = None) -> tuple[EngineFit, bool]:
        """The fit of ``gen`` (default: the newest measured); False with the newest other code state
        when ``gen`` has no real-EP measurement."""
        have = [g for g in STATES if g in self.engines]
        if not have:
            raise ValueError("no MoK EP>1 measurement matches a loopback row: cannot calibrate kappa")
        if gen in self.engines:
            return self.engines[gen], True
        return self.engines[have[-1]], gen is None

    def k(self, mode: str, gen: str | None = None) -> float:
        """kappa of ``mode``; a mode this state did not measure gets the newest state's kappa for it
        that also measured exact, scaled by the two states' exact kappas."""
        eng, _ = self.engine(gen)
        if mode in eng.kappa:
            return eng.kappa[mode]
        base = split_mode(mode)[0]  # kappa does not depend on the local rows (assumption, unmeasured)
        if base != mode:
            return self.k(base, gen)
        for g in reversed(STATES):
            o = self.engines.get(g)
            if o and mode in o.kappa and "exact" in o.kappa and "exact" in eng.kappa:
                return eng.kappa["exact"] * o.kappa[mode] / o.kappa["exact"]
        return statistics.median(eng.kappa.values())

    def factor(self, transport: str, gen: str | None = None) -> float:
        eng, _ = self.engine(gen)
        if transport in eng.transport_factor:
            return eng.transport_factor[transport]
        for g in reversed(STATES):
            o = self.engines.get(g)
            if o and transport in o.transport_factor:
                return o.transport_factor[transport]
        return 1.0


def _engine_fit(name: str, eps: list[EPPoint], ones: dict, oe) -> EngineFit | None:
    kap: dict[str, list[float]] = {}
    for p in eps:
        if p.transport != "collective" or (p.source, p.shape) not in ones:
            continue
        key = (family(local_shape(p), p.tokens), p.chunks, p.mode)
        o_e = oe(key)
        if o_e is None or o_e[0] <= 0:
            continue
        t1 = ones[(p.source, p.shape)]
        kap.setdefault(p.mode, []).append((p.ms - t1 - o_e[1] * mok_link_ms(p)) / (o_e[0] * t1))
    if not kap:
        return None
    coll = {(p.source, p.shape, p.chunks, p.mode): p.ms for p in eps if p.transport == "collective"}
    ratios: dict[str, list[float]] = {}
    for p in eps:
        key = (p.source, p.shape, p.chunks, p.mode)
        if p.transport not in ("collective", PLAIN) and key in coll:
            ratios.setdefault(p.transport, []).append(p.ms / coll[key])
    return EngineFit(
        name,
        {mode: statistics.median(v) for mode, v in kap.items()},
        {"collective": 1.0, **{t: statistics.median(v) for t, v in ratios.items()}},
        len(eps),
    )


PLAIN = "plain"  # the EP>1 points of MoK's six-phase engine (no pipeline)


def _plain_fit(eps: list[EPPoint], ones: dict) -> dict:
    """P per loopback shape: (plain layer - the source's own EP=1 time - the all-to-all fully
    exposed) / that EP=1 time, median over the points, at least 0."""
    ps: dict[str, list[float]] = {}
    for p in eps:
        t1 = ones.get((p.source, p.shape))
        if p.transport == PLAIN and t1:
            ps.setdefault(family(local_shape(p), p.tokens), []).append((p.ms - t1 - megatron_link_ms(p)) / t1)
    return {fam: max(statistics.median(v), 0.0) for fam, v in ps.items()}


def fit_overlap(m: Measurements) -> OverlapFit:
    over, expo = _loop_tables(m)
    by_gen = {}
    for gen in STATES:
        rows = tuple(r for r in m.loop if state_of(r.source) == gen)
        if rows:
            by_gen[gen] = _loop_tables(Measurements((), (), rows), prior=over)
    ones = {(p.source, p.shape): p.ms for p in m.layer1 if p.impl == "mok"}
    engines, plain = {}, {}
    measured = frozenset((r.shape, r.chunks, r.mode) for r in m.loop if r.gbps == 0)
    for gen in STATES:
        eps = [p for p in m.ep if p.impl == "mok" and state_of(p.source) == gen]
        probe = OverlapFit(over, expo, {gen: EngineFit(gen, {}, {}, 0)}, by_gen, measured)

        def oe(key, probe=probe, gen=gen):
            return probe.oe(key, gen) if key in over and key in expo else None

        fit = _engine_fit(gen, eps, ones, oe)
        if fit:
            engines[gen] = fit
        if _plain_fit(eps, ones):
            plain[gen] = _plain_fit(eps, ones)
    if not engines:
        raise ValueError("no MoK EP>1 measurement matches a loopback row: cannot calibrate kappa")
    return OverlapFit(over, expo, engines, by_gen, measured, plain)


_LOOP_CHUNKS = re.compile(r"^(?P<key>.*) pipe C=(?P<c>\d+)(?P<rest>.*)$")  # profile_layer.py loopback rows
_EP_CHUNKS = re.compile(r"^(?P<key>.*) x(?P<c>\d+)$")  # ep.json profiled rows (measurements.ep_profiles)


@dataclass(frozen=True)
class HostFloor:
    """MoK's host enqueue floor on real EP for one code state (exact mode reads counts on the
    host, so the layer cannot run ahead of its own enqueue):
    t_host = launches(transport) x (1 + r x (minibatches - 1)) x per-launch host cost."""

    gen: str
    # transport, or "transport local-rows" with local-rows labels (fused and overlap launch 277-316 vs
    # 482-525 GPU ops at one minibatch) -> GPU ops per layer fwd+bwd at one minibatch (median over shapes)
    launches: dict
    us_per_launch: float  # host cost per launch without the profiler (lowest measured, see fit_host_floors)
    per_minibatch: float  # r: extra launches per extra minibatch, as a fraction of the one-minibatch count

    def ms(self, transport: str, chunks: int, local_rows: str = "") -> float | None:
        """The floor of ``transport`` with ``local_rows`` ("fused" / "overlap"; "" when the mode has
        none); a transport profiled only with local rows, asked without, takes the median of those."""
        n = self.launches.get(f"{transport} {local_rows}" if local_rows else transport)
        if n is None and not local_rows:
            by_rows = [v for k, v in self.launches.items() if k.split()[0] == transport]
            n = statistics.median(by_rows) if by_rows else None
        if n is None:
            return None
        return n * (1 + self.per_minibatch * (chunks - 1)) * self.us_per_launch / 1e3


def minibatch_launch_growth(profiles) -> float | None:
    """r from profiles of the same configuration at 1 and C minibatches (median of
    (launches_C / launches_1 - 1) / (C - 1)); None when no such pair was profiled."""
    by: dict[tuple, dict[int, int]] = {}
    for p in profiles:
        m = _LOOP_CHUNKS.match(p.what) or _EP_CHUNKS.match(p.what)
        if m:
            key = (p.source, m["key"], m.groupdict().get("rest") or "")
            by.setdefault(key, {})[int(m["c"])] = p.launches
    rs = [(n / c1[1] - 1) / (c - 1) for c1 in by.values() if 1 in c1 for c, n in c1.items() if c > 1]
    return statistics.median(rs) if rs else None


STALLED_PROFILE = 2.0


def fit_host_floors(m: Measurements) -> dict:
    """code state -> HostFloor, for the states with profiled MoK EP>1 rows (ep.json ``profile``).
    Launches: the profiled GPU-op count per transport at one minibatch (median over shapes). Per-launch
    cost: the profiled host time per launch times the row's unprofiled / profiled time (the profiler's
    own slowdown), lowest over the state's rows: the host time includes any waits for the GPU
    (syncs), so the smallest value is the closest to the pure enqueue cost. r: minibatch_launch_growth
    over every profile. A profiled step whose GPU span is more than ``STALLED_PROFILE`` x both its host time
    and its unprofiled time was stalled on the GPU (one qwen3 copy_engine step with a 340 ms copy
    stream): its unprofiled / profiled ratio does not measure the profiler's slowdown, so it is left out."""
    r = minibatch_launch_growth(m.profiles)
    out = {}
    for gen in STATES:
        rows = [
            p
            for p in m.profiles
            if state_of(p.source) == gen
            and " mok " in f" {p.what} "
            and p.unprofiled_ms
            and " EP=1 " not in p.what
            and "graph" not in p.what  # one graph replay per layer: no per-kernel enqueue to measure
            and p.wall_ms <= STALLED_PROFILE * max(p.host_ms, p.unprofiled_ms)
        ]
        if not rows or r is None:
            continue
        counts: dict[str, list[int]] = {}
        for p in rows:
            words = p.what.split(" mok ", 1)[1].split()
            tr = words[0] if len(words) < 2 or words[1] not in LOCAL_ROWS else f"{words[0]} {words[1]}"
            if p.what.endswith(" x1"):
                counts.setdefault(tr, []).append(p.launches)
        cost = min(1e3 * p.host_ms / p.launches * p.unprofiled_ms / p.wall_ms for p in rows)
        out[gen] = HostFloor(gen, {t: statistics.median(v) for t, v in counts.items()}, cost, r)
    return out


@dataclass(frozen=True)
class Calibration:
    compute: dict  # impl -> ComputeFit over every source
    overlap: OverlapFit
    sources: tuple  # measurement sources used
    compute_by_gen: dict = field(default_factory=dict)  # (impl, code state) -> ComputeFit (ENGINE_IMPLS)
    host_floors: dict = field(default_factory=dict)  # code state -> HostFloor (profiled states only)

    def host_floor(self, gen: str | None = None) -> HostFloor | None:
        """``gen``'s MoK host floor; gen None: the newest code state that has one."""
        if gen is not None:
            return self.host_floors.get(gen)
        return next((self.host_floors[g] for g in reversed(STATES) if g in self.host_floors), None)

    def fit(self, impl: str, gen: str | None = None) -> tuple[ComputeFit, bool]:
        """The EP=1 fit of ``impl`` for code state ``gen`` (default: the newest fitted); False with
        the fit over every source when that state has too few points of its own."""
        if impl not in ENGINE_IMPLS:
            return self.compute[impl], True
        have = [g for g in STATES if (impl, g) in self.compute_by_gen]
        if gen is None and have:
            return self.compute_by_gen[(impl, have[-1])], True
        if (impl, gen) in self.compute_by_gen:
            return self.compute_by_gen[(impl, gen)], True
        return self.compute[impl], False

    def mok_ep_ms(
        self,
        t1: float,
        link_ms: float,
        shape: str,
        chunks: int,
        mode: str,
        transport: str,
        gen: str | None = None,
    ) -> float:
        big_o, e = self.overlap.oe((shape, chunks, mode), gen)
        o = big_o * self.overlap.k(mode, gen) * t1
        gpu = (t1 + o + e * link_ms) * self.overlap.factor(transport, gen)
        graphed = "graph" in mode  # one CUDA graph replay per layer: no per-kernel enqueue
        floor = (
            self.host_floor(gen).ms(transport, chunks, split_mode(mode)[1])
            if gen in self.host_floors and not graphed
            else None
        )
        return max(gpu, floor or 0.0)

    def mok_plain_ms(
        self, t1: float, link_ms: float, moe: MoEShape, tokens: int, gen: str | None = None
    ) -> float:
        """MoK's plain engine at EP>1 with its all-to-all exposed (``link_ms``, Megatron's bytes):
        t1 + P * t1 + link, at least the state's host floor for the plain engine's launches."""
        p = self.overlap.plain_overhead(moe, tokens, gen)
        if p is None:
            raise KeyError("no plain-engine EP>1 measurement")
        floor = self.host_floor(gen).ms(PLAIN, 1) if gen in self.host_floors else None
        return max(t1 + p[0] * t1 + link_ms, floor or 0.0)


def fit_host_link(fit: ComputeFit, m: Measurements) -> ComputeFit:
    """The exposed all-to-all fraction of a host-bound implementation at EP>1, from its EP points and
    the same source's EP=1 time (median; 1.0 = no hiding when there is no such point)."""
    ones = {(p.source, p.impl, p.shape): p.ms for p in m.layer1}
    xs = []
    for p in m.ep:
        t1 = ones.get((p.source, p.impl, p.shape))
        if p.impl == fit.impl and t1 and fit.host_bound(p.tokens, local_shape(p)):
            xs.append(min(max((p.ms - t1) / megatron_link_ms(p), 0.0), 1.0))
    return replace(fit, host_link_exposed=statistics.median(xs)) if xs else fit


def _enough(pts: list[Layer1]) -> bool:
    """A code state's own fit needs 3 points (a, c, d) over at least 2 distinct shapes."""
    return len(pts) >= 3 and len({(p.moe, p.tokens) for p in pts}) >= 2


def calibrate(m: Measurements) -> Calibration:
    """Fits from ``m``; MoK rows of sources without a declared code state are left out."""
    m = declared_only(m)
    impls = sorted({p.impl for p in m.layer1})
    compute = {i: fit_host_link(fit_compute(list(m.layer1), i), m) for i in impls}
    by_gen = {}
    for impl in sorted(ENGINE_IMPLS & set(impls)):
        for gen in STATES:
            pts = [
                p for p in m.layer1 if p.impl == impl and kernels_of(state_of(p.source)) == kernels_of(gen)
            ]
            if _enough(pts):
                by_gen[(impl, gen)] = fit_compute(pts, impl)
    return Calibration(compute, fit_overlap(m), m.sources, by_gen, fit_host_floors(m))
