"""``mok bench layer`` outputs: a markdown table (stdout), a JSON file and a PNG bar chart."""

from __future__ import annotations

import json

from mok_megatron.bench.timing import PHASES
from mok_megatron.bench.clocks import format_summary


def _mem(v) -> str:
    return "n/a" if v is None else f"{v:,.0f}"


def _cells(d: dict) -> list[str]:
    """Per phase: 'median ms [min..max] (expert TFLOP/s at the median)'."""
    return [
        f"{d[p + '_ms']:.3f} ms [{d[p + '_min_ms']:.3f}..{d[p + '_max_ms']:.3f}] ({d[p + '_tflops']:.3g})"
        for p in PHASES
    ]


def markdown(cases: list[dict]) -> str:
    """One table per (shape, routing) case, skipped peers listed under it with their reasons."""
    out = []
    for c in cases:
        out.append(
            f"### {c['shape']} (H {c['hidden']}, F {c['ffn']}, {c['experts']} experts, top-{c['topk']}, "
            f"{c['tokens']} tokens), routing {c['routing']}, {c['dtype']}, {c['device']}"
        )
        out.append(
            f"\nMedian [min..max] of {c['iters']} after {c['warmup']} warm-up, ms (expert TFLOP/s at the "
            "median); 'back to back': steps "
            "enqueued without a sync between them (the host may run ahead, as in training); peak memory: "
            f"{c['peak_mem']}; errors relative to {c['reference']}.\n"
        )
        out.append(
            "| impl | fwd | bwd | fwd+bwd | fwd+bwd back to back | peak MiB | rel err out | rel err dx | note |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|")
        for r in c["rows"]:
            cells = _cells(r)
            out.append(
                f"| {r['impl']} | {' | '.join(cells)} | {_mem(r['peak_mem_mib'])} | "
                f"{r['rel_err_out']:.1e} | {r['rel_err_dx']:.1e} | {r['note']} |"
            )
        bound = c.get("expert_gemms")
        if bound:
            cells = _cells(bound)
            out.append(
                f"| expert GEMMs alone | {' | '.join(cells)} | | | | the six torch._grouped_mm calls only: "
                "the floor under any layer built on them |"
            )
        for s in c["skipped"]:
            out.append(f"| {s['impl']} | skipped: {s['reason']} | | | | | | | |")
        out.append("")
        out.extend(_clock_lines(c))
    return "\n".join(out)


def _clock_lines(c: dict) -> list[str]:
    """What the GPU's clocks did while each row was timed (median SM clock / max, power, slowdowns)."""
    seen = [(r["impl"], r.get("gpu")) for r in c["rows"]]
    if c.get("expert_gemms"):
        seen.append(("expert GEMMs alone", c["expert_gemms"].get("gpu")))
    if not any(s for _, s in seen):
        why = c.get("gpu_clocks")
        return [f"GPU clocks: not sampled ({why}).", ""] if why and why != "nvidia-smi" else []
    lines = [
        "GPU while timed (nvidia-smi, median SM clock / max, median power of limit, slowdown reasons seen):"
    ]
    lines += [f"- {impl}: {format_summary(s)}" for impl, s in seen]
    return lines + [""]


def write_json(path: str, cases: list[dict], meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({**meta, "cases": cases}, f, indent=1)


def write_png(path: str, cases: list[dict]) -> str:
    """Grouped bars: forward+backward ms per implementation, one group per (shape, routing).
    Returns a message saying what was written, or why nothing was (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"PNG not written: matplotlib is not installed ({e}); pip install matplotlib for --png"
    impls = list(dict.fromkeys(r["impl"] for c in cases for r in c["rows"]))
    labels = [f"{c['shape']}\n{c['routing']}" for c in cases]
    width = 0.8 / max(len(impls), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases) * max(len(impls), 1) * 0.5), 4.5))
    for j, impl in enumerate(impls):
        xs, ys = [], []
        for i, c in enumerate(cases):
            row = next((r for r in c["rows"] if r["impl"] == impl), None)
            if row is not None:
                xs.append(i + (j - (len(impls) - 1) / 2) * width)
                ys.append(row["fwd_bwd_ms"])
        ax.bar(xs, ys, width, label=impl)
    ax.set_xticks(range(len(cases)), labels, fontsize=8)
    ax.set_ylabel("forward + backward, ms (lower is better)")
    dev = cases[0]["device"] if cases else "?"
    ax.set_title(f"MoE layer, one {dev}, median of {cases[0]['iters'] if cases else 0}")
    ax.legend(title="implementation", fontsize=8)
    skipped = sorted({s["impl"] for c in cases for s in c["skipped"]})
    if skipped:
        fig.text(0.01, 0.01, "skipped (see JSON/table for reasons): " + ", ".join(skipped), fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"PNG written: {path}"
