"""A schematic timeline of one MoE layer forward + backward per configuration, drawn from the
model's terms (not a trace): compute lane (expert work + engine overhead) and link lane (all-to-all).
PNG with matplotlib when it is installed (``pip install matplotlib``), otherwise SVG."""

from __future__ import annotations

from pathlib import Path

from mok_megatron.tools.planner.headline import KIND, LABEL
from mok_megatron.tools.planner.predict import LayerPrediction


def segments(p: LayerPrediction) -> list[tuple[str, float, float, str]]:
    """(lane, start ms, length ms, label). Forward is 1/3 of the work, backward 2/3."""
    segs = []
    t = 0.0
    if p.impl.startswith("megatron") or p.impl == "mok-1f1b":  # one exchange, its phases in sequence
        hidden = p.exposed_ms == 0
        work = p.t1_ms + p.overhead_ms
        for phase, frac in (("fwd", 1 / 3), ("bwd", 2 / 3)):
            q = p.link_ms / 4
            segs.append(("link", t, q, f"{phase} dispatch"))
            t += 0 if hidden else q
            segs.append(("compute", t, work * frac, f"{phase} experts"))
            t += work * frac
            segs.append(("link", t if not hidden else t - q, q, f"{phase} combine"))
            t += 0 if hidden else q
        return segs
    c = max(p.chunks, 1)
    work = p.t1_ms + p.overhead_ms
    for phase, frac in (("fwd", 1 / 3), ("bwd", 2 / 3)):
        span = work * frac + p.exposed_ms / 2
        blk = work * frac / c
        lnk = p.link_ms / 2 / c
        gap = (span - work * frac) / c
        for i in range(c):
            s = t + i * (blk + gap)
            segs.append(("link", s, lnk, f"{phase} a2a {i}"))
            segs.append(("compute", s + gap, blk, f"{phase} mb {i}"))
        t += span
    return segs


def _label(p: LayerPrediction) -> str:
    if p.impl == "mok":
        return f"MoK {p.transport} {p.mode} x{p.chunks}: {p.total_ms:.1f} ms"
    return f"{LABEL[p.impl]} ({KIND[p.impl]}): {p.total_ms:.1f} ms"


def write(preds: list[LayerPrediction], path: str) -> str:
    """Writes the picture; returns the path written (.png, or .svg without matplotlib)."""
    colors = {"compute": "#4c72b0", "link": "#dd8452"}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _svg(preds, str(Path(path).with_suffix(".svg")), colors)
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.9 * len(preds)))
    ticks = []
    for row, p in enumerate(preds):
        y = 2 * row
        for lane, s, w, _ in segments(p):
            ax.broken_barh([(s, w)], (y + (0.0 if lane == "compute" else 0.9), 0.8), color=colors[lane])
        ticks.append((y + 0.85, _label(p)))
    ax.set_yticks([t for t, _ in ticks], [lab for _, lab in ticks], fontsize=8)
    ax.set_xlabel("ms (one MoE layer, forward + backward, one micro-batch; blue compute, orange link)")
    ax.invert_yaxis()
    fig.tight_layout()
    out = str(Path(path).with_suffix(".png"))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _svg(preds, path, colors) -> str:
    scale = 900 / max(max(s + w for _, s, w, _ in segments(p)) for p in preds)
    rows = []
    for row, p in enumerate(preds):
        y = 20 + 50 * row
        rows.append(f'<text x="2" y="{y - 4}" font-size="11">{_label(p)}</text>')
        for lane, s, w, _ in segments(p):
            yy = y + (0 if lane == "compute" else 18)
            rows.append(
                f'<rect x="{s * scale:.1f}" y="{yy}" width="{max(w * scale, 0.5):.1f}" height="16" '
                f'fill="{colors[lane]}"/>'
            )
    body = "\n".join(rows)
    Path(path).write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="920" height="{30 + 50 * len(preds)}">'
        f"\n{body}\n</svg>\n"
    )
    return path
