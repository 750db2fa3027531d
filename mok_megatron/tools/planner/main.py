"""``mok plan``: predicted layer and step times and tokens/s/GPU for Megatron's alltoall layer (fitted),
MoK (fitted), and both under Megatron's own EP overlap (bounds), the recommended MoK flags and one
headline; ``--validate`` (each measured point vs the model), ``--compare`` (published GB300 numbers).

Give a model (its own layout; any layout flag overrides it) or a recipe:
    mok plan --model deepseek-v3
    mok plan --recipe examples/deepseek_v3_gb300.sh
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from mok_megatron.tools.planner import calibrate, hardware, measurements, predict, recipe, shapes, validate
from mok_megatron.tools.planner.headline import KIND, LABEL, headline
from mok_megatron.tools.planner.links import LinkError

# Published numbers the planner is checked against (not measured here; see docs/planner.md).
PUBLISHED = {
    "megatron_dsv3_gb300_tflops": 1233.0,  # Megatron-Core DeepSeek-V3 on GB300, TFLOP/s/GPU
    "mok_tokens_per_s_gpu": (760.9, 1070.2),  # baseline -> MoK on 512 GB300, secondary source
}
LAYOUT_FLAGS = ("tp", "pp", "vpp", "ep", "cp", "micro_batch", "global_batch", "precision")


def model_setup(name: str, ns=None) -> tuple[shapes.Model, shapes.Layout, hardware.Cluster]:
    """``name``'s own layout (shapes.LAYOUTS), each value overridden by a flag given in ``ns``."""
    d = shapes.LAYOUTS.get(name)
    if d is None:
        raise shapes.LayoutError(
            f"model {name!r}: no default layout; choose one of {', '.join(shapes.LAYOUTS)}"
        )
    given = {f: getattr(ns, f, None) for f in (*LAYOUT_FLAGS, "cluster", "nodes")}
    val = {f: d[f] if given.get(f) is None else given[f] for f in (*LAYOUT_FLAGS, "cluster", "nodes")}
    cl = hardware.cluster(val["cluster"])
    if given["cluster"] is None:
        cl = dataclasses.replace(cl, nvlink_domain=d["nvlink_domain"])
    layout = shapes.Layout(val["nodes"] * cl.gpus_per_node, **{f: val[f] for f in LAYOUT_FLAGS})
    return shapes.model(name), layout, cl


def _setup(ns):
    if ns.recipe:
        model, layout, cl = recipe.load(ns.recipe)
        if ns.cluster:
            cl = dataclasses.replace(hardware.cluster(ns.cluster), nvlink_domain=cl.nvlink_domain)
        return model, layout, cl
    return model_setup(ns.model, ns)


def _name(o: predict.LayerPrediction) -> str:
    return LABEL[o.impl] if o.impl != "mok" else f"mok {o.transport} {o.mode} x{o.chunks}"


def plan(ns) -> str:
    m = measurements.load()
    cal = calibrate.calibrate(m)
    model, layout, cl = _setup(ns)
    a = predict.Assumptions(ns.overhead_scaling, ns.host)
    h = headline(cal, model, layout, cl, a)
    opts = list(h.options)
    rec = h.recommendation.layer
    lines = [
        f"{model.name} on {layout.world} x {cl.gpu.name} ({cl.name}, NVLink domain {cl.nvlink_domain}); "
        f"TP {layout.tp} PP {layout.pp} VPP {layout.vpp} EP {layout.ep} DP {layout.dp}, micro-batch "
        f"{layout.micro_batch}, global {layout.global_batch}, {layout.precision}; "
        f"{layout.moe_tokens(model)} tokens per rank per MoE layer",
        "",
        "| configuration | kind | expert work ms | overhead ms | link ms | exposed ms | MoE layer ms | step s | "
        "tokens/s/GPU | TFLOP/s/GPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    shown = [h.rows[k].layer for k in ("megatron", "megatron-1f1b", "mok-1f1b") if k in h.rows]
    mok = sorted((o for o in opts if o.impl == "mok"), key=lambda o: o.total_ms)
    mok = mok if ns.all else mok[:3] + ([rec] if rec not in mok[:3] else [])
    for o in shown + mok:
        st = predict.step(model, layout, cl, o)
        mark = " (recommended)" if o is rec else ""
        lines.append(
            f"| {_name(o)}{mark} | {KIND[o.impl]} | {o.t1_ms:.2f} | {o.overhead_ms:.2f} | {o.link_ms:.2f} | "
            f"{o.exposed_ms:.2f} | {o.total_ms:.2f} | {st.step_s:.2f} | {st.tokens_per_s_gpu:.0f} | "
            f"{st.tflops_per_gpu:.0f} |"
        )
    lines += [
        "",
        "fitted: the layer model calibrated on the measurements (mok plan --validate); bound: Megatron's "
        "layer or MoK's plain engine under --overlap-moe-expert-parallel-comm, the all-to-all entirely "
        "hidden (never measured). The recommendation is chosen among the fitted MoK rows.",
        h.recommendation.text(),
        h.text(),
        "Held-out error of each fitted input (mean |error|, mok plan --validate) and how far moving it by "
        "that error moves each comparison:",
        *h.sensitivity_text(),
        f"Other work per micro-batch ({h.megatron.other_ms_per_mb:.1f} ms: attention, dense layers, router, "
        "shared expert, logits) is the same for every row.",
        *(
            [
                "With --host measured both layers keep the H200 test host's floor: Megatron+TE h0 + h x local "
                "experts, MoK launches per layer x per-launch host cost (newest profiled code state)."
            ]
            if a.host == "measured"
            else []
        ),
        "",
        *([calibrate.undeclared_report(m), ""] if calibrate.undeclared(m) else []),
        "Assumptions:",
        *[f"- {t}" for t in a.text(cal)],
    ]
    if ns.timeline:
        from mok_megatron.tools.planner import timeline

        path = timeline.write(shown + mok[:3], ns.timeline)
        if Path(path).suffix != Path(ns.timeline).suffix:
            lines.append(
                f"\nmatplotlib is not installed, so the timeline was written as SVG to {path} instead of "
                f"{ns.timeline} (pip install matplotlib, or mok-megatron[plan], writes PNG)."
            )
        else:
            lines.append(f"\nTimeline written to {path}")
    return "\n".join(lines)


def compare() -> str:
    """The DeepSeek-V3 GB300 layout (examples/deepseek_v3_gb300.sh) against the published numbers."""
    cal = calibrate.calibrate(measurements.load())
    model, layout, cl = model_setup("deepseek-v3")
    pub_meg = PUBLISHED["megatron_dsv3_gb300_tflops"]
    base, moktok = PUBLISHED["mok_tokens_per_s_gpu"]
    lines = [
        "| MoK overhead scaling, host floor (both layers) | Megatron alltoall TFLOP/s/GPU (published 1233) "
        "| error | MoK recommended | MoK / alltoall (published +40.6%) | Megatron + 1F1B bound | "
        "MoK + 1F1B bound | bound / bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    heads = {}
    for scaling, host in (("relative", "hidden"), ("absolute", "hidden"), ("relative", "measured")):
        h = heads[(scaling, host)] = headline(cal, model, layout, cl, predict.Assumptions(scaling, host))
        b = h.comparisons.get("bound")
        lines.append(
            f"| {scaling}, {host} | {h.megatron.tflops_per_gpu:.0f} | {h.megatron.tflops_per_gpu / pub_meg - 1:+.1%} | "
            f"{h.mok.tflops_per_gpu:.0f} | {h.gain:+.1%} | "
            + (
                f"{b.theirs.tflops_per_gpu:.0f} | {b.ours.tflops_per_gpu:.0f} | {b.lead:+.1%} |"
                if b
                else "- | - | - |"
            )
        )
    h = heads[("relative", "hidden")]
    r = h.recommendation.layer
    f = r.total_ms / (r.t1_ms + r.overhead_ms + r.exposed_ms)

    def gain(**kw) -> str:
        lp = dataclasses.replace(r, **kw)
        lp = dataclasses.replace(lp, total_ms=(lp.t1_ms + lp.overhead_ms + lp.exposed_ms) * f)
        return (
            f"{predict.step(model, layout, cl, lp).tokens_per_s_gpu / h.megatron.tokens_per_s_gpu - 1:+.1%}"
        )

    return "\n".join(
        [
            *lines,
            "",
            h.text(),
            f"Recommended MoK option (relative, hidden): {r.transport} {r.mode} x{r.chunks}: expert work "
            f"{r.t1_ms:.2f} ms, engine overhead {r.overhead_ms:.2f} ms, link {r.link_ms:.2f} ms of which "
            f"{r.exposed_ms:.2f} ms exposed, layer {r.total_ms:.2f} ms vs Megatron alltoall "
            f"{h.megatron.layer.total_ms:.2f} ms.",
            f"Drivers of the MoK / alltoall ratio: as predicted {gain()}; with zero engine overhead "
            f"{gain(overhead_ms=0.0)}; with the link fully hidden {gain(exposed_ms=0.0)}; both "
            f"{gain(overhead_ms=0.0, exposed_ms=0.0)}.",
            f"\nPublished MoK gain: {base} -> {moktok} tokens/s/GPU = {moktok / base - 1:+.1%}. Predicted Megatron "
            f"alltoall tokens/s/GPU for this layout (host floor hidden): {h.megatron.tokens_per_s_gpu:.0f}; the "
            "published absolute tokens/s do not match DeepSeek-V3 at ~1233 TFLOP/s/GPU, so only the ratio "
            "is compared.",
        ]
    )


def _validate() -> None:
    m = measurements.load()
    rows = validate.checks(m)
    print(validate.table(rows))
    print("\n" + validate.summary(rows))
    if calibrate.undeclared_report(m):
        print("\n" + calibrate.undeclared_report(m))
    print("\nRun-to-run spread of the EP=1 points measured in several sources:\n")
    print(validate.spread_table(validate.spreads(m)))
    print("\nProfiles (under the profiler, which inflates host time):\n")
    print(validate.profile_table(m.profiles))
    if m.train:
        print("\nTraining steps (mok bench train, Megatron's loop; measured, not fitted):\n")
        print(validate.train_table(m.train))
    for f in calibrate.calibrate(m).host_floors.values():
        counts = ", ".join(f"{t} {n:.0f}" for t, n in f.launches.items())
        print(
            f"\nMoK host floor ({f.gen}): launches per layer fwd+bwd at one minibatch: {counts}; "
            f"{f.us_per_launch:.1f} us per launch (lowest profiled host time per launch x unprofiled / "
            f"profiled time); +{f.per_minibatch:.2f} x the one-minibatch launches per extra minibatch."
        )


def _unwritable(path: str) -> str | None:
    """Why the picture cannot be written to ``path`` (checked before planning), or None."""
    target = Path(path)
    if target.is_dir():
        return "is a folder; give a file name such as timeline.png inside it."
    folder = target.absolute().parent
    if not folder.is_dir():
        return f"folder {folder} does not exist; create it (mkdir -p {folder}) or choose another path."
    if not os.access(folder, os.W_OK):
        return f"folder {folder} is not writable; choose another path."
    return None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mok plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--recipe",
        help="a recipe script (the repository's examples/*.sh; a wheel has none): model, layout and cluster "
        "from its DRY_RUN=1 command",
    )
    p.add_argument(
        "--model", choices=sorted(shapes.MODELS), help="a model with its own layout (shapes.LAYOUTS)"
    )
    p.add_argument("--cluster", choices=sorted(hardware.CLUSTERS))
    p.add_argument("--nodes", type=int)
    for f in ("tp", "pp", "vpp", "ep", "cp", "micro-batch", "global-batch"):
        p.add_argument(f"--{f}", type=int, help="default: the model's own layout")
    p.add_argument("--precision", choices=("bf16", "fp8", "mxfp8"), help="default: the model's own layout")
    p.add_argument(
        "--overhead-scaling",
        default="relative",
        choices=("relative", "absolute"),
        help="MoK engine overhead: a fraction of the layer's compute on the target (relative) or H200 ms",
    )
    p.add_argument(
        "--host",
        default="hidden",
        choices=("measured", "hidden"),
        help="Megatron's host-bound launch floor on the target: as measured on the H200 host, or hidden "
        "(CUDA graphs / a faster host)",
    )
    p.add_argument("--all", action="store_true", help="list every MoK configuration, not the best three")
    p.add_argument(
        "--timeline", metavar="PATH", help="write the timeline picture (PNG with matplotlib, else SVG)"
    )
    p.add_argument("--validate", action="store_true", help="each measured point vs the model, then exit")
    p.add_argument("--compare", action="store_true", help="DeepSeek-V3 GB300 layout vs the published numbers")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    argv = sys.argv[1:] if argv is None else argv
    ns = p.parse_args(argv)
    if not (ns.recipe or ns.model or ns.validate or ns.compare):
        p.print_usage(sys.stderr)
        print(
            "mok plan: give --model M (its own layout), --recipe examples/<recipe>.sh, --validate or --compare",
            file=sys.stderr,
        )
        return 2
    if ns.recipe and ns.model:
        print("mok plan: --recipe and --model both name a model; give one", file=sys.stderr)
        return 2
    if ns.timeline:
        problem = _unwritable(ns.timeline)
        if problem:
            print(f"mok plan: --timeline {ns.timeline}: {problem}", file=sys.stderr)
            return 2
    try:
        if ns.validate:
            _validate()
            return 0
        print(compare() if ns.compare else plan(ns))
    except (shapes.LayoutError, hardware.HardwareError, LinkError) as e:
        print(f"mok plan: {e}", file=sys.stderr)
        return 2
    return 0
