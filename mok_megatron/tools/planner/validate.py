"""Each measured point against the model: in-sample (calibrated on every source) and held-out
(leave-one-source-out: calibrated without the point's own source, the layer table's folder or one results
folder, i.e. one machine start). A held-out MoK EP>1 prediction whose code state was only measured on
real EP in that source uses another state's fit and is marked "other code state". ``held_out_errors``
gives the headline the out-of-sample error of each planner term (``TERMS``)."""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass

from mok_megatron.tools.planner.calibrate import (
    ENGINE_IMPLS,
    STATES,
    Calibration,
    calibrate,
    declared_only,
    kernels_of,
    family,
    local_shape,
    megatron_link_ms,
    mok_link_ms,
    PLAIN,
    state_of,
)
from mok_megatron.tools.planner.measurements import EPPoint, Layer1, Measurements, load

TOLERANCE = 0.15


@dataclass(frozen=True)
class Check:
    source: str
    what: str
    measured_ms: float
    in_sample_ms: float
    held_out_ms: float | None  # None: the held-out calibration lacks a needed term
    anchored_ms: float | None = None  # EP>1: held-out model with t1 = the source's own EP=1 time
    note: str = ""  # why a held-out prediction is missing or uses another code state
    cross: bool = False  # the held-out prediction had to use another code state's fit
    run_outlier: float | None = (
        None  # EP=1: measured / median of the same point's sources - 1, when > TOLERANCE
    )
    host_bound: bool = False  # the in-sample fit puts the point on its host floor (Megatron / Megatron+TE)
    impl: str = ""
    ep: int = 1
    transport: str = ""  # EP>1: nccl a2a (Megatron), plain, collective, copy_engine, nvlink

    @property
    def in_sample_err(self) -> float:
        return self.in_sample_ms / self.measured_ms - 1

    @property
    def held_out_err(self) -> float | None:
        return None if self.held_out_ms is None else self.held_out_ms / self.measured_ms - 1

    @property
    def anchored_err(self) -> float | None:
        return None if self.anchored_ms is None else self.anchored_ms / self.measured_ms - 1


def predict_layer1(cal: Calibration, p: Layer1) -> float:
    return cal.fit(p.impl, state_of(p.source))[0].ms(p.tokens, p.moe)


def predict_ep(cal: Calibration, p: EPPoint, t1_ms: float | None = None) -> float:
    """The EP>1 time; ``t1_ms`` (the source's own EP=1 same-work time) replaces the modelled t1, which
    takes the machine's speed out of the comparison (the anchored column)."""
    local = local_shape(p)
    fit = cal.fit(p.impl, state_of(p.source))[0]
    t1 = t1_ms or fit.ms(p.tokens, local)
    if p.impl != "mok":
        if t1_ms is None:
            return fit.ep_ms(p.tokens, local, megatron_link_ms(p))
        scale = t1_ms / fit.ms(p.tokens, local)
        return fit.ep_ms(p.tokens, local, megatron_link_ms(p) / scale) * scale
    gen = state_of(p.source)
    if p.transport == PLAIN:
        return cal.mok_plain_ms(t1, megatron_link_ms(p), local, p.tokens, gen)
    return cal.mok_ep_ms(t1, mok_link_ms(p), family(local, p.tokens), p.chunks, p.mode, p.transport, gen)


def _same_engine(cal: Calibration, p: EPPoint) -> bool:
    """The EP>1 terms of ``p``'s prediction come from its own code state's real-EP rows."""
    gen = state_of(p.source)
    if p.transport == PLAIN:
        got = cal.overlap.plain_overhead(local_shape(p), p.tokens, gen)
        return got is not None and got[1]
    return cal.overlap.engine(gen)[1]


def _ep_note(cal: Calibration, p: EPPoint) -> str:
    if p.impl != "mok":
        return ""
    gen = state_of(p.source)
    if p.transport == PLAIN:
        if _same_engine(cal, p):
            return ""
        return f"other code state: {gen}'s plain engine measured on real EP only in this source"
    eng, same = cal.overlap.engine(gen)
    if not same:
        return f"other code state ({eng.name}): {gen} measured on real EP only in this source"
    mode = p.mode
    if mode not in eng.kappa:
        if any(mode in e.kappa for e in cal.overlap.engines.values()):
            return f"kappa({mode}) transferred from a different code state"
        return f"{mode} measured on real EP only in this source: the state's exact kappa is used"
    if p.transport not in eng.transport_factor:
        return f"{p.transport} factor from a different code state"
    return ""


def _safe(fn, cal, p):
    try:
        return fn(cal, p)
    except KeyError:
        return None


def checks(m: Measurements) -> list[Check]:
    """Every point of a declared source (MoK rows of undeclared sources are not predicted: see
    calibrate.undeclared_report)."""
    m = declared_only(m)
    full = calibrate(m)
    outliers = run_outliers(m)
    held = {}
    out = []
    for p in m.layer1:
        if p.source not in held:
            try:
                held[p.source] = calibrate(m.without(p.source))
            except ValueError:
                held[p.source] = None
        h = held[p.source]
        ho = _safe(predict_layer1, h, p) if h and p.impl in h.compute else None
        note = "" if ho is not None else f"no {p.impl} point in another source"
        cross = ho is not None and not h.fit(p.impl, state_of(p.source))[1]
        if cross:
            note = f"other code state: {state_of(p.source)} has too few EP=1 points without this source; fit over every source"
        what = f"EP=1 {p.impl} {p.shape} (E_local {p.moe.experts}, {p.tokens} tok)"
        dev = outliers.get(p)
        if dev is not None:
            note = f"run outlier: {100 * dev:+.0f}% vs the median of this point's sources" + (
                f"; {note}" if note else ""
            )
        hb = full.fit(p.impl, state_of(p.source))[0].host_bound(p.tokens, p.moe)
        out.append(
            Check(
                p.source,
                what,
                p.ms,
                predict_layer1(full, p),
                ho,
                note=note,
                cross=cross,
                run_outlier=dev,
                host_bound=hb,
                impl=p.impl,
            )
        )
    ones = {(p.source, p.impl, p.shape): p.ms for p in m.layer1}
    start = {(p.source, p.impl, p.shape): d for p, d in outliers.items()}  # EP=1 run outliers by source
    for p in m.ep:
        if p.source not in held:
            held[p.source] = calibrate(m.without(p.source))
        h = held[p.source]
        ho = _safe(predict_ep, h, p) if p.impl in h.compute else None
        note = _ep_note(h, p) if ho is not None else f"no {p.impl} point in another source"
        if p.impl == "mok":
            what = f"EP=2 mok {p.transport} {p.mode} x{p.chunks} {p.shape}"
        else:
            what = f"EP=2 {p.impl} {p.shape}"
        t1 = ones.get((p.source, p.impl, p.shape))
        an = None if ho is None or t1 is None else predict_ep(h, p, t1)
        cross = (
            ho is not None
            and p.impl == "mok"
            and not (_same_engine(h, p) and h.fit(p.impl, state_of(p.source))[1])
        )
        if cross and "other code state" not in note:
            note = f"other code state: {state_of(p.source)} EP=1 fit lacks points without this source"
        hb = p.impl != "mok" and full.fit(p.impl)[0].host_bound(p.tokens, local_shape(p))
        dev = start.get((p.source, p.impl, p.shape))  # the same start's EP=1 same-work point is one
        if dev is not None:
            note = (
                f"run outlier: its source's EP=1 same-work point is {100 * dev:+.0f}% vs that point's median"
                + (f"; {note}" if note else "")
            )
        out.append(
            Check(
                p.source,
                what,
                p.ms,
                predict_ep(full, p),
                ho,
                an,
                note,
                cross,
                dev,
                host_bound=hb,
                impl=p.impl,
                ep=p.ep,
                transport=p.transport,
            )
        )
    return out


def table(rows: list[Check]) -> str:
    lines = [
        "| source | point | measured ms | in-sample ms | error | held-out ms | error | anchored ms | error | note |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ho = "-" if r.held_out_ms is None else f"{r.held_out_ms:.2f}"
        he = "-" if r.held_out_err is None else f"{100 * r.held_out_err:+.1f}%"
        an = "-" if r.anchored_ms is None else f"{r.anchored_ms:.2f}"
        ae = "-" if r.anchored_err is None else f"{100 * r.anchored_err:+.1f}%"
        lines.append(
            f"| {r.source} | {r.what} | {r.measured_ms:.2f} | {r.in_sample_ms:.2f} | "
            f"{100 * r.in_sample_err:+.1f}% | {ho} | {he} | {an} | {ae} | {r.note} |"
        )
    return "\n".join(lines)


def _stats(errs: list[float]) -> str:
    if not errs:
        return "none"
    bad = sum(e > TOLERANCE for e in errs)
    return (
        f"{len(errs)} points, max |error| {100 * max(errs):.1f}%, mean {100 * sum(errs) / len(errs):.1f}%, "
        f"{bad} outside {100 * TOLERANCE:.0f}%"
    )


def summary(rows: list[Check]) -> str:
    ins = [abs(r.in_sample_err) for r in rows]
    typical = [abs(r.in_sample_err) for r in rows if r.run_outlier is None]
    ho = [abs(r.held_out_err) for r in rows if r.held_out_err is not None]
    same = [abs(r.held_out_err) for r in rows if r.held_out_err is not None and not r.cross]
    newest = [abs(r.in_sample_err) for r in rows if r.source in _newest_sources(rows)]
    anch = [abs(r.anchored_err) for r in rows if r.anchored_err is not None and not r.cross]
    return (
        f"{len(rows)} measured points.\n- In-sample: {_stats(ins)}.\n- In-sample, without the run outliers "
        f"(> {100 * TOLERANCE:.0f}% from the median of the same point's sources): {_stats(typical)}.\n- Held-out (leave-one-source-out): {_stats(ho)}."
        f"\n- Held-out, same code state: {_stats(same)}.\n- In-sample, newest code state's sources only: "
        f"{_stats(newest)}.\n- EP>1 held-out, anchored on the source's own EP=1 time, same code state: "
        f"{_stats(anch)}."
    )


@dataclass(frozen=True)
class HeldOut:
    """The out-of-sample error of one planner term: mean |error| of the points that carry it."""

    what: str  # the points and the error, in words
    error: float  # mean |error|
    points: int


@dataclass(frozen=True)
class Term:
    """The points that carry one planner term and the error that measures it."""

    what: str
    ep: int  # 1 or 2
    impl: str
    kind: str | None  # EP=2 MoK: "pipelined" or "plain"
    error: str  # the Check attribute: held_out_err, or anchored_err (the EP>1 terms given the EP=1 time)


# Keys: the headline's rows (their points' held-out error) and predict.Perturbation's fields (each fitted
# input's error). Megatron points: with the host floor hidden only the GPU-bound ones (the prediction uses
# the GPU line alone); MoK points: only those predicted within their own code state (a target uses the
# newest state's own fits; a cross-state error measures a code change, not the model).
TERMS = {
    "megatron": Term("EP=2 Megatron+TE, held out", 2, "megatron-te", None, "held_out_err"),
    "megatron-1f1b": Term("EP=1 Megatron+TE, held out", 1, "megatron-te", None, "held_out_err"),
    "mok": Term("EP=2 MoK pipelined, held out", 2, "mok", "pipelined", "held_out_err"),
    "mok-1f1b": Term("EP=2 MoK plain engine, held out", 2, "mok", PLAIN, "held_out_err"),
    "megatron_ep1": Term(
        "Megatron+TE's EP=1 fit: EP=1 points held out", 1, "megatron-te", None, "held_out_err"
    ),
    "megatron_ep": Term(
        "Megatron alltoall's exposed all-to-all: EP=2 points anchored", 2, "megatron-te", None, "anchored_err"
    ),
    "mok_ep1": Term("MoK's EP=1 fit: EP=1 points held out", 1, "mok", None, "held_out_err"),
    "mok_ep": Term("MoK's pipeline on real EP: EP=2 points anchored", 2, "mok", "pipelined", "anchored_err"),
    "mok_plain": Term("MoK's plain engine at EP>1: EP=2 points anchored", 2, "mok", PLAIN, "anchored_err"),
}


def term_points(rows: list[Check], term: str, host: str = "hidden") -> list[float]:
    """The errors of the points that carry ``term`` (TERMS) under the host assumption ``host``."""
    t = TERMS[term]
    out = []
    for r in rows:
        if r.impl != t.impl or (r.ep > 1) != (t.ep > 1) or getattr(r, t.error) is None:
            continue
        if t.kind is not None and (r.transport == PLAIN) != (t.kind == PLAIN):
            continue
        if t.impl in ENGINE_IMPLS and r.cross:
            continue
        if t.impl not in ENGINE_IMPLS and host == "hidden" and r.host_bound:
            continue
        out.append(getattr(r, t.error))
    return out


def held_out_errors(rows: list[Check], host: str = "hidden") -> dict[str, HeldOut]:
    """TERMS -> the mean |error| of their points."""
    out = {}
    for term, t in TERMS.items():
        errs = [abs(e) for e in term_points(rows, term, host)]
        if errs:
            out[term] = HeldOut(t.what, sum(errs) / len(errs), len(errs))
    return out


@functools.cache
def package_errors(host: str = "hidden") -> dict[str, HeldOut]:
    """held_out_errors of the package data's leave-one-source-out validation."""
    return held_out_errors(_package_checks(), host)


@functools.cache
def _package_checks() -> tuple[Check, ...]:
    return tuple(checks(load()))


def _newest_sources(rows: list[Check]) -> set[str]:
    gens = {r.source: state_of(r.source) for r in rows if state_of(r.source) is not None}
    last = max(gens.values(), key=STATES.index)
    return {s for s, g in gens.items() if g == last}


@dataclass(frozen=True)
class Spread:
    """One point measured in several sources (machine starts): the run-to-run spread of the measurement."""

    what: str
    runs: tuple[str, ...]
    ms: tuple[float, ...]

    @property
    def spread(self) -> float:
        """(max - min) / median."""
        return (max(self.ms) - min(self.ms)) / statistics.median(self.ms)


def _repeats(m: Measurements) -> dict[tuple, list[Layer1]]:
    """EP=1 points grouped by (implementation, per-rank shape, tokens, MoK layer kernels): a MoK
    point only repeats within the code states that share its kernels (calibration.json 'kernels'; an
    EP=1 layer runs no pipeline, so faster kernels are not run-to-run spread)."""
    by: dict[tuple, list] = {}
    for p in m.layer1:
        gen = kernels_of(state_of(p.source)) if p.impl in ENGINE_IMPLS else ""
        key = (p.impl, p.moe.hidden, p.moe.ffn, p.moe.experts, p.moe.topk, p.tokens, gen)
        by.setdefault(key, []).append(p)
    return by


def run_outliers(m: Measurements) -> dict[Layer1, float]:
    """EP=1 points measured in at least 3 sources whose time is more than TOLERANCE from the median of
    the same point's sources (a slow or fast machine start; the model predicts the typical machine):
    point -> measured / median - 1."""
    out = {}
    for pts in _repeats(m).values():
        if len({p.source for p in pts}) >= 3:
            med = statistics.median(p.ms for p in pts)
            out.update({p: p.ms / med - 1 for p in pts if abs(p.ms / med - 1) > TOLERANCE})
    return out


def spreads(m: Measurements) -> list[Spread]:
    """EP=1 points (same implementation, per-rank shape, tokens; MoK: same layer kernels)
    measured in more than one source."""
    out = []
    for (impl, h, _f, e, _k, t, gen), pts in _repeats(m).items():
        if len({p.source for p in pts}) > 1:
            what = f"EP=1 {impl}{f' ({gen} kernels)' if gen else ''} H{h} E_local {e} {t} tok"
            out.append(Spread(what, tuple(p.source for p in pts), tuple(p.ms for p in pts)))
    return sorted(out, key=lambda s: -s.spread)


def spread_table(rows: list[Spread]) -> str:
    lines = ["| point | sources | ms | spread (max-min)/median |", "|---|---|---|---:|"]
    for s in rows:
        lines.append(
            f"| {s.what} | {', '.join(s.runs)} | {', '.join(f'{x:.2f}' for x in s.ms)} | {100 * s.spread:.0f}% |"
        )
    return "\n".join(lines)


def profile_table(profiles) -> str:
    """The profiled configurations: launches and host enqueue time (what makes a layer host-bound)."""
    lines = [
        "| source | configuration | wall ms | kernel launches | host enqueue ms | us per launch | unprofiled ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for p in profiles:
        un = "-" if p.unprofiled_ms is None else f"{p.unprofiled_ms:.2f}"
        lines.append(
            f"| {p.source} | {p.what} | {p.wall_ms:.2f} | {p.launches} | {p.host_ms:.2f} | "
            f"{p.host_us_per_launch:.0f} | {un} |"
        )
    return "\n".join(lines)


def train_table(runs) -> str:
    """The ``mok bench train`` runs (whole training steps in Megatron's loop; read, not fitted): per run its
    precision and MoK expert backend, tokens/s/GPU, MoK's speed-up over the comparison's Megatron run of
    the same precision, and an FP8 run's step over its layer's bf16 step."""
    lines = [
        "| source | comparison | preset | machine | run | precision | experts | tokens/s/GPU | step ms "
        "| vs Megatron | FP8 step / bf16 step |",
        "|---|---|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in runs:
        precision = f"FP8 {r.fp8_recipe}" if r.fp8_recipe else "bf16"
        experts = r.expert_backend or "Megatron's"
        vs = "-" if r.vs_megatron is None else f"{r.vs_megatron:.2f}x"
        bf16 = "-" if r.step_vs_bf16 is None else f"{r.step_vs_bf16:.2f}x"
        lines.append(
            f"| {r.source} | {r.comparison} | {r.preset} | {r.machine} | {r.run} | {precision} | {experts} | "
            f"{r.tokens_per_s_per_gpu:,.0f} | {r.step_ms:.1f} | {vs} | {bf16} |"
        )
    return "\n".join(lines)
