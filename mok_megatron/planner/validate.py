"""Each measured point against the model: in-sample (calibrated on every file) and held-out
(calibrated without the point's own source file: benchmarks.md or one run directory)."""

from __future__ import annotations

from dataclasses import dataclass

from mok_megatron.planner.calibrate import Calibration, calibrate, family, megatron_link_ms, mok_link_ms
from mok_megatron.planner.measurements import EPPoint, Layer1, Measurements
from mok_megatron.planner.shapes import MoEShape

TOLERANCE = 0.15


@dataclass(frozen=True)
class Check:
    source: str
    what: str
    measured_ms: float
    in_sample_ms: float
    held_out_ms: float | None  # None: the held-out calibration lacks a needed term

    @property
    def in_sample_err(self) -> float:
        return self.in_sample_ms / self.measured_ms - 1

    @property
    def held_out_err(self) -> float | None:
        return None if self.held_out_ms is None else self.held_out_ms / self.measured_ms - 1


def predict_layer1(cal: Calibration, p: Layer1) -> float:
    return cal.compute[p.impl].ms(p.tokens, p.moe)


def predict_ep(cal: Calibration, p: EPPoint) -> float:
    local = MoEShape(p.moe.hidden, p.moe.ffn, p.moe.experts // p.ep, p.moe.topk)
    t1 = cal.compute[p.impl].ms(p.tokens, local)
    if p.impl != "mok":
        return t1 + megatron_link_ms(p)
    chunks, mode = (1, "exact") if p.transport == "plain" else (p.chunks, p.mode)
    return cal.mok_ep_ms(t1, mok_link_ms(p), family(local, p.tokens), chunks, mode, p.transport)


def _safe(fn, cal, p):
    try:
        return fn(cal, p)
    except KeyError:
        return None


def checks(m: Measurements) -> list[Check]:
    full = calibrate(m)
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
        what = f"EP=1 {p.impl} {p.shape} (E_local {p.moe.experts}, {p.tokens} tok)"
        out.append(Check(p.source, what, p.ms, predict_layer1(full, p), ho))
    for p in m.ep:
        if p.source not in held:
            held[p.source] = calibrate(m.without(p.source))
        h = held[p.source]
        ho = _safe(predict_ep, h, p) if p.impl in h.compute else None
        if p.impl == "mok":
            what = f"EP=2 mok {p.transport} {p.mode} x{p.chunks} {p.shape}"
        else:
            what = f"EP=2 {p.impl} {p.shape}"
        out.append(Check(p.source, what, p.ms, predict_ep(full, p), ho))
    return out


def table(rows: list[Check]) -> str:
    lines = [
        "| source | point | measured ms | model ms (in-sample) | error | model ms (held-out) | error |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ho = "-" if r.held_out_ms is None else f"{r.held_out_ms:.2f}"
        he = "-" if r.held_out_err is None else f"{100 * r.held_out_err:+.1f}%"
        lines.append(
            f"| {r.source} | {r.what} | {r.measured_ms:.2f} | {r.in_sample_ms:.2f} | "
            f"{100 * r.in_sample_err:+.1f}% | {ho} | {he} |"
        )
    return "\n".join(lines)


def summary(rows: list[Check]) -> str:
    ins = [abs(r.in_sample_err) for r in rows]
    ho = [abs(r.held_out_err) for r in rows if r.held_out_err is not None]
    bad_in = sum(e > TOLERANCE for e in ins)
    bad_ho = sum(e > TOLERANCE for e in ho)
    return (
        f"{len(rows)} measured points. In-sample: max |error| {100 * max(ins):.1f}%, mean {100 * sum(ins) / len(ins):.1f}%, "
        f"{bad_in} outside {100 * TOLERANCE:.0f}%. Held-out ({len(ho)} points with a held-out fit): max "
        f"{100 * max(ho):.1f}%, mean {100 * sum(ho) / len(ho):.1f}%, {bad_ho} outside {100 * TOLERANCE:.0f}%."
    )
