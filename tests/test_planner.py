"""The scale planner (mok plan): units, FLOP/byte counts against hand-computed cases, rejected
layouts, calibration against the repo's result files. No torch, no GPU; a few seconds."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import statistics
import subprocess
import sys

import pytest

from mok_megatron.tools.planner import (
    calibrate,
    flops,
    hardware,
    measurements,
    predict,
    recipe,
    shapes,
    timeline,
    validate,
)
from mok_megatron.tools.planner.links import LinkError, LinkModel
from mok_megatron.tools.planner.main import main

DSV3_SLICE = shapes.MoEShape(7168, 2048, 8, 8)


@pytest.fixture(scope="module")
def meas():
    return measurements.load()


@pytest.fixture(scope="module")
def cal(meas):
    return calibrate.calibrate(meas)


# ---- arithmetic -----------------------------------------------------------------------------------


def test_expert_flops_hand_computed_and_matches_the_benchmark_doc():
    # 3 (fwd+bwd) x 2 (FLOP per MAC) x T x K x (2F + F) x H
    assert flops.expert_flops(4096, DSV3_SLICE) == 3 * 2 * 4096 * 8 * 3 * 2048 * 7168
    assert flops.expert_flops(1, shapes.MoEShape(2, 3, 1, 1)) == 3 * 2 * 3 * 3 * 2
    # docs/benchmarks.md: MoK 18.63 ms on the DeepSeek slice = 465 expert TFLOP/s
    assert round(flops.expert_flops(4096, DSV3_SLICE) / 18.63e-3 / 1e12) == 465


def test_attention_flops_gqa_hand_computed():
    att = shapes.Attention(heads=2, head_dim=4, query_groups=1)
    hidden, seq = 8, 10
    proj = 2 * 8 * 2 * 4 + 2 * 2 * 8 * 1 * 4 + 2 * 2 * 4 * 8  # Q, K+V (one group), O
    core = 2 * 10 * 2 * 2 * 4 / 2  # QK^T + PV, causal half
    assert flops.attention_flops_per_token(att, hidden, seq) == proj + core


def test_remote_copies():
    # EP=2, 16 experts, 8 per rank, top-8: P(no expert on the other rank) = C(8,8)/C(16,8)
    moe = shapes.MoEShape(7168, 2048, 16, 8)
    assert flops.p_visit(moe, 2) == pytest.approx(1 - 1 / math.comb(16, 8))
    assert flops.megatron_remote_copies(moe, 2) == 4.0
    assert flops.mok_remote_ranks(moe, 1) == 0.0
    assert flops.a2a_bytes(10, 4, 2.0) == 4 * 10 * 2.0 * 4 * 2


def test_dedup_bytes_match_the_loopback_byte_counter(meas):
    """The planner's MoK bytes equal what the loopback transport counted in every overlap run."""
    from mok_megatron.bench.overlap import OVERLAP_SHAPES

    rows = [r for r in meas.loop if r.shape != "tiny"]
    assert rows
    for r in rows:
        s = OVERLAP_SHAPES[r.shape]
        moe = shapes.MoEShape(s["hidden"], s["ffn"], s["experts"] * s["ep"], s["topk"])
        mine = flops.mok_bytes(s["tokens"], moe, s["ep"])
        assert mine == pytest.approx(r.bytes_per_step, rel=1e-6), r


def test_link_units_and_placement():
    cl = hardware.cluster("gb300-nvl72")
    lm = LinkModel(1.0)
    assert lm.seconds(900e9, cl, 64) == pytest.approx(1.0)  # 900 GB at 900 GB/s
    h = hardware.cluster("h200-nvl8")
    assert lm.inter_share(h, 16) == pytest.approx(8 / 15)
    # 8 of 15 peers over 50 GB/s NICs dominate 7 over 450 GB/s NVLink
    assert lm.seconds(15e9, h, 16) == pytest.approx(8e9 / 50e9)


# ---- layouts that must be rejected ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(world=10, tp=4), "not divisible by TP x PP x CP"),
        (dict(world=16, pp=2, ep=16), "does not divide the 8 GPUs"),
        (dict(world=8, global_batch=12), "global batch 12"),
        (dict(world=8, tp=0), "tp=0"),
        (dict(world=8, precision="fp4"), "precision"),
    ],
)
def test_bad_layouts(kwargs, words):
    with pytest.raises(shapes.LayoutError, match=words):
        shapes.Layout(**kwargs)


def test_bad_model_layouts():
    dsv3 = shapes.model("deepseek-v3")
    with pytest.raises(shapes.LayoutError, match="256 experts do not split over EP=3"):
        shapes.Layout(world=3, ep=3, global_batch=3).check(dsv3)
    with pytest.raises(shapes.LayoutError, match="topk=9 > experts=8"):
        shapes.Model("x", 1, 1, 8, 8, shapes.Attention(1, 8), shapes.MoEShape(8, 8, 8, 9), 10, 16)
    with pytest.raises(hardware.HardwareError, match="MXFP8 needs Blackwell"):
        hardware.GPUS["H200"].peak_tflops("mxfp8")
    with pytest.raises(hardware.HardwareError, match="unknown"):
        hardware.cluster("tpu-v5")
    with pytest.raises(LinkError, match="copy_engine with EP=16"):
        LinkModel(0.5).seconds(1e9, hardware.cluster("h200-nvl8"), 16, "copy_engine")


def test_copy_engine_is_not_offered_across_nodes(cal):
    m = shapes.model("qwen3-30b-a3b")
    lay = shapes.Layout(world=32, ep=16, global_batch=32)
    opts = predict.layer_options(cal, m, lay, hardware.cluster("h200-nvl8"), predict.Assumptions())
    assert {o.transport for o in opts if o.impl == "mok"} == {"collective"}


def test_capacity_multiplier():
    dsv3 = shapes.model("deepseek-v3")
    # EP=64: 4 of 256 experts per rank, p_visit ~ 0.12 -> a quarter of a source's tokens is plenty
    assert predict.capacity_multiplier(dsv3, shapes.Layout(world=64, ep=64, global_batch=64)) == 0.25
    # EP=2: every token visits the other rank
    assert predict.capacity_multiplier(dsv3, shapes.Layout(world=2, ep=2, global_batch=2)) == 1.0


# ---- recipes, calibration, validation -------------------------------------------------------------


def test_layer_freq_and_recipe():
    assert recipe._layer_freq("([0]*3+[1]*58)", 61) == 58
    assert recipe._layer_freq("2", 4) == 2
    with pytest.raises(shapes.LayoutError, match="only ints"):
        recipe._layer_freq("__import__('os')", 1)
    m, lay, cl = recipe.load("examples/deepseek_v3_gb300.sh")
    assert (m.layers, m.moe_layers, m.mtp_layers, m.moe.experts, m.moe.shared_ffn) == (61, 58, 1, 256, 2048)
    assert (lay.world, lay.pp, lay.vpp, lay.ep, lay.dp, lay.precision) == (512, 8, 4, 64, 64, "mxfp8")
    assert (cl.gpu.name, cl.nvlink_domain) == ("GB300", 64)


def test_measurements_are_read_from_the_files(meas):
    bench = [p for p in meas.layer1 if p.source == "benchmarks.md"]
    assert {p.impl for p in bench} == {"mok", "megatron-te", "megatron"}
    raw = json.loads((measurements.DOCS / "results/2026-11-30/run8/ep.json").read_text())
    meg = next(r for r in raw if r["ep"] == 2 and r["impl"] != "mok" and r["shape"] == "dsv3")
    assert any(p.source == "run8" and p.impl == meg["impl"] and p.ms == meg["ms"] for p in meas.ep)


# In-sample points outside TOLERANCE that docs/planner.md explains one by one (not run outliers by the
# >= 3-runs rule): s4a's noisy host (its qwen3 MoK EP=1 point 11.25 ms vs 8.93 in s3c, the only other
# run; collective exact 31.86 ms vs copy_engine exact 20.63 ms in the same run), and s3c's qwen3 exact
# points, whose engine-4 kappa s4a's slow qwen3 point raises (the kappa is a median over both runs).
DOCUMENTED_MISSES = {
    ("s4a", "EP=1 mok qwen3 (E_local 64, 16384 tok)"),
    ("s4a", "EP=2 mok collective exact x1 qwen3"),
    ("s4a", "EP=2 mok copy_engine sync-free x1 qwen3"),
    ("s3c", "EP=2 mok collective exact x1 qwen3"),
    ("s3c", "EP=2 mok copy_engine exact x1 qwen3"),
    # s7e (the two-H200 machine's host): host-bound Megatron+TE Qwen3 at 64 local experts took 23.17 ms
    # at EP=1 (six machine starts: 17.1-31.4 ms) and 18.98 ms at EP=2, less than its own EP=1 same-work
    # point, so the anchored EP=2 prediction is +37 % and the typical-host fit -16 % / +15 %
    ("s7e", "EP=1 megatron-te qwen3 (E_local 64, 16384 tok)"),
    ("s7e", "EP=2 megatron-te qwen3"),
}


def test_model_reproduces_the_measurements_within_tolerance(meas):
    every = validate.checks(meas)
    rows = [r for r in every if (r.source, r.what) not in DOCUMENTED_MISSES]
    assert len(rows) == len(every) - len(DOCUMENTED_MISSES)  # the documented points still exist
    # run outliers (> TOLERANCE from the median of the same point's runs, >= 3 runs) are reported, not
    # fitted to: the model predicts the typical machine start
    ep1 = [r for r in rows if r.what.startswith("EP=1") and r.run_outlier is None]
    assert ep1 and all(abs(r.in_sample_err) < validate.TOLERANCE for r in ep1), validate.table(ep1)
    assert all("run outlier" in r.note for r in rows if r.run_outlier is not None)
    # Megatron + TE at EP=2 (link model from the NCCL baseline, no fit to these points): GPU-bound points
    # held out; host-bound ones anchored on the run's own EP=1 time, which measures that machine start's
    # host speed (host-bound EP=1 points spread 23-28 % between starts: docs/planner.md)
    te2 = [r for r in rows if r.what.startswith("EP=2 megatron-te")]
    assert te2 and any(r.host_bound for r in te2) and not all(r.host_bound for r in te2)
    err = [r.anchored_err if r.host_bound else r.held_out_err for r in te2]
    assert all(abs(e) < validate.TOLERANCE for e in err), validate.table(te2)
    mok2 = [r for r in rows if r.what.startswith("EP=2 mok")]
    assert mok2 and all(abs(r.in_sample_err) < validate.TOLERANCE for r in mok2), validate.table(mok2)
    # every in-sample point, except the one documented unmodelled cost (Megatron without TE at EP>1)
    rest = [r for r in rows if not r.what.startswith("EP=2 megatron ") and r.run_outlier is None]
    assert all(abs(r.in_sample_err) < validate.TOLERANCE for r in rest), validate.table(rest)
    # held-out points predicted within their own engine generation carry no cross-generation note
    assert all(("other engine" in r.note) == r.cross for r in rows if r.held_out_ms is not None)


def test_cli_validate_and_compare(capsys):
    assert main(["--validate"]) == 0
    out = capsys.readouterr().out
    assert "Held-out (leave-one-run-out)" in out and "Run-to-run spread" in out and "| s3a |" in out
    assert "us per launch" in out
    assert main(["--compare"]) == 0
    out = capsys.readouterr().out
    assert "published 1233" in out and "Drivers of the MoK / Megatron ratio" in out


def test_efficiencies_are_below_one_and_link_from_nccl():
    assert 0 < calibrate.gemm_efficiency("bf16") < 1 and 0 < calibrate.gemm_efficiency("fp8") < 1
    assert calibrate.link_efficiency() == pytest.approx(244 / 450)


def test_timeline_svg_and_png(tmp_path, cal):
    m = shapes.model("qwen3-30b-a3b")
    opts = predict.layer_options(
        cal,
        m,
        shapes.Layout(world=8, ep=8, global_batch=8),
        hardware.cluster("h200-nvl8"),
        predict.Assumptions(),
    )
    picks = [predict.best(opts, "megatron"), predict.best(opts, "mok")]
    svg = timeline._svg(picks, str(tmp_path / "t.svg"), {"compute": "blue", "link": "red"})
    assert "<rect" in open(svg).read()
    out = timeline.write(picks, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").exists() or out.endswith(".svg")


def test_cli(capsys):
    assert (
        main(
            [
                "--model",
                "qwen3-30b-a3b",
                "--cluster",
                "h200-nvl8",
                "--nodes",
                "4",
                "--pp",
                "1",
                "--vpp",
                "1",
                "--ep",
                "8",
                "--global-batch",
                "64",
                "--precision",
                "fp8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "Recommended MoK settings" in out and "megatron-1f1b" in out
    assert (
        main(
            [
                "--model",
                "deepseek-v3",
                "--cluster",
                "h200-nvl8",
                "--nodes",
                "1",
                "--ep",
                "8",
                "--pp",
                "1",
                "--vpp",
                "1",
                "--global-batch",
                "8",
            ]
        )
        == 2
    )  # mxfp8 on Hopper
    assert "MXFP8 needs Blackwell" in capsys.readouterr().err


def test_planner_does_not_import_torch():
    code = "import sys, mok_megatron.tools.planner.main; assert 'torch' not in sys.modules and 'megatron' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- calibration from the results directories ------------------------------------------------------


def test_nnls_recovers_non_negative_coefficients_and_clamps_negative_ones():
    xs = [1.0, 2.0, 3.0, 5.0]
    y = [2.0 * x + 0.5 for x in xs]
    assert calibrate._nnls([xs, [1.0] * 4], y, [1.0] * 4) == pytest.approx([2.0, 0.5])
    y_neg = [2.0 * x - 1.0 for x in xs]  # the intercept would be negative: dropped, slope refitted
    a, b = calibrate._nnls([xs, [1.0] * 4], y_neg, [1.0] * 4)
    assert b == 0.0 and a == pytest.approx(
        sum(x * v for x, v in zip(xs, y_neg, strict=True)) / sum(x * x for x in xs)
    )


def test_host_bound_fit_recovers_a_known_layer():
    true = calibrate.ComputeFit("megatron-te", 4e-9, 0.0, 0.0, 6.0, 0.2, 0)
    pts = []
    for e, t in ((4, 4096), (8, 4096), (8, 16384), (64, 16384), (128, 16384), (96, 8192)):
        moe = shapes.MoEShape(2048, 768, e, 8)
        pts.append(measurements.Layer1("synthetic", "megatron-te", f"e{e}", moe, t, true.ms(t, moe)))
    fit = calibrate.fit_compute(pts, "megatron-te")
    assert (fit.h0_ms, fit.h_ms_per_expert) == pytest.approx((6.0, 0.2), rel=1e-6)
    assert fit.a_ms_per_byte == pytest.approx(4e-9, rel=1e-6)
    assert fit.host_bound(16384, shapes.MoEShape(2048, 768, 128, 8))
    assert not fit.host_bound(16384, shapes.MoEShape(7168, 2048, 8, 8))
    # at EP>1 a host-bound layer hides part of the all-to-all in its idle GPU gaps
    moe = shapes.MoEShape(2048, 768, 128, 8)
    half = dataclasses.replace(fit, host_link_exposed=0.5)
    assert half.ep_ms(16384, moe, 2.0) == pytest.approx(fit.host_ms(moe) + 1.0)


def test_profile_headers_are_parsed(tmp_path):
    (tmp_path / "profile_x.txt").write_text(
        "== qwen3: wall 13.28 ms | GPU kernels 12.29 ms in 151 launches | host enqueue 3.87 ms\n"
        "== dsv3 EP=2 megatron: wall 24.84 ms | GPU busy 30.32 ms | copy 2.15 | host enqueue 10.01 ms | 318 kernels\n"
        "      1.981 ms x   2  cutlass\n"
    )
    prof = measurements.profile_results(tmp_path)
    assert [(p.what, p.launches, p.host_ms) for p in prof] == [
        ("qwen3", 151, 3.87),
        ("dsv3 EP=2 megatron", 318, 10.01),
    ]
    assert prof[0].host_us_per_launch == pytest.approx(3870 / 151)


def _with_copy_of(tmp_path, run: str, new: str):
    """docs/ copied to tmp_path plus results directory ``new``: a copy of ``run``'s files."""
    docs = measurements.DOCS
    (tmp_path / "results").mkdir()
    shutil.copy(docs / "benchmarks.md", tmp_path / "benchmarks.md")
    shutil.copytree(docs / "results/2026-11-30", tmp_path / "results/2026-11-30")
    shutil.copytree(tmp_path / f"results/2026-11-30/{run}", tmp_path / f"results/2026-11-30/{new}")
    return measurements.load(tmp_path)


def test_a_new_results_directory_declared_by_data_only(tmp_path, monkeypatch):
    """A new directory is read with no code change and joins a generation by its calibration.json entry."""
    m = _with_copy_of(tmp_path, "s3a", "s9z")
    assert "s9z" in m.sources and calibrate.engine_of("s9z") is None
    gens = [
        dict(g, runs=[*g["runs"], "s9z"] if "s3a" in g["runs"] else g["runs"])
        for g in calibrate.DATA["engine_generations"]
    ]
    monkeypatch.setitem(calibrate.DATA, "engine_generations", gens)
    assert calibrate.engine_of("s9z") == calibrate.engine_of("s3a") and not calibrate.undeclared(m)
    new = {(p.impl, p.shape, p.ms) for p in m.layer1 if p.source == "s9z"}
    assert new == {(p.impl, p.shape, p.ms) for p in m.layer1 if p.source == "s3a"}
    assert sum(p.source == "s9z" for p in m.ep) == sum(p.source == "s3a" for p in m.ep) > 0
    # with a second run of s3a's engine, its real-EP points get a same-engine held-out fit
    rows = [r for r in validate.checks(m) if r.source == "s3a" and "mok" in r.what and "EP=2" in r.what]
    assert rows and all("other engine" not in r.note for r in rows)


def test_a_new_engine_generation_is_declared_by_data_only(tmp_path, monkeypatch):
    m = _with_copy_of(tmp_path, "s3a", "s9z")
    gen = {"name": "engine-new", "runs": ["s9z"], "note": "test", "evidence": "test"}
    monkeypatch.setitem(calibrate.DATA, "engine_generations", [*calibrate.DATA["engine_generations"], gen])
    calibrate.GENERATIONS.append("engine-new")  # the list the modules share, as read from the file
    try:
        cal = calibrate.calibrate(m)
        assert calibrate.engine_of("s9z") == "engine-new"
        assert ("mok", "engine-new") in cal.compute_by_gen and "engine-new" in cal.overlap.engines
        assert cal.fit("mok")[0] is cal.compute_by_gen[("mok", "engine-new")]
        rows = validate.checks(m)
        assert any(r.source == "s9z" and "mok" in r.what for r in rows)
    finally:
        calibrate.GENERATIONS.remove("engine-new")


def test_an_undeclared_directory_is_reported_not_fitted(tmp_path):
    m = _with_copy_of(tmp_path, "s3a", "s9z")
    assert calibrate.undeclared(m) == ("s9z",)
    assert "s9z" in calibrate.undeclared_report(m) and "calibration.json" in calibrate.undeclared_report(m)
    without = m.without("s9z")
    assert not calibrate.undeclared(without) and calibrate.undeclared_report(without) == ""
    cal, ref = calibrate.calibrate(m), calibrate.calibrate(without)
    assert cal.compute_by_gen == ref.compute_by_gen and cal.overlap.engines == ref.overlap.engines
    rows = validate.checks(m)
    assert not any(r.source == "s9z" and " mok " in f" {r.what} " for r in rows)
    assert any(r.source == "s9z" and "megatron-te" in r.what for r in rows)  # engine-independent rows stay


def test_every_results_directory_declares_its_engine_generation(meas):
    assert not calibrate.undeclared(meas), calibrate.undeclared_report(meas)


def test_torchtitan_eager_and_compiled_are_separate_implementations(tmp_path):
    case = {"shape": "q", "hidden": 8, "ffn": 4, "experts": 2, "topk": 1, "tokens": 16}
    rows = [
        {"impl": "torchtitan", "note": "torch.compile", "fwd_bwd_ms": 1.0},
        {"impl": "torchtitan", "note": "eager (MOK_BENCH_TORCHTITAN_COMPILE=0)", "fwd_bwd_ms": 2.0},
        {"impl": "torchtitan", "note": "eager (torch.compile failed: X)", "fwd_bwd_ms": 3.0},
        {"impl": "megatron-te", "note": "", "fwd_bwd_ms": 4.0},
    ]
    (tmp_path / "layer-x.json").write_text(json.dumps({"cases": [dict(case, rows=rows)]}))
    fp8 = dict(case, dtype="fp8", rows=[{"impl": "mok", "note": "", "fwd_bwd_ms": 0.5}])
    (tmp_path / "layer-fp8.json").write_text(json.dumps({"cases": [fp8]}))
    got = [(p.impl, p.ms) for p in measurements.layer_results(tmp_path)]
    assert got == [
        ("torchtitan-compiled", 1.0),
        ("torchtitan-eager", 2.0),
        ("torchtitan-eager", 3.0),
        ("megatron-te", 4.0),
    ]  # the FP8 case is skipped (bf16 only)


def test_engine_generation_fallback_is_reported(meas):
    gens = {calibrate.engine_of(s) for s in meas.sources}
    assert calibrate.GENERATIONS[-1] in gens
    newest = [s for s in meas.sources if calibrate.engine_of(s) == calibrate.GENERATIONS[-1]]
    held = calibrate.calibrate(meas.without(newest[0])) if len(newest) == 1 else None
    if held is not None:
        eng, same = held.overlap.engine(calibrate.GENERATIONS[-1])
        assert not same and eng.name != calibrate.GENERATIONS[-1]


def test_run_to_run_spread_is_measured(meas):
    sp = validate.spreads(meas)
    assert sp and all(len(set(s.runs)) > 1 and s.spread >= 0 for s in sp)
    worst = sp[0]
    assert worst.spread == pytest.approx((max(worst.ms) - min(worst.ms)) / statistics.median(worst.ms))
    assert [s.spread for s in sp] == sorted((s.spread for s in sp), reverse=True)


def test_recommendation_prefers_the_simplest_configuration_within_the_margin():
    def lp(transport, mode, chunks, ms):
        return predict.LayerPrediction("mok", transport, chunks, mode, 1.0, 0.0, 0.0, 0.0, ms)

    margin = predict.DATA["recommendation_margin"]["value"]
    opts = [
        lp("copy_engine", "exact", 2, 10.0),
        lp("collective", "exact", 4, 10.0 * (1 + margin / 2)),
        lp("collective", "exact", 2, 10.0 * (1 + margin / 2)),
        lp("collective", "exact", 1, 10.0 * (1 + 2 * margin)),
    ]
    assert predict.recommended(opts) is opts[2]
    assert predict.recommended(opts[:1] + opts[3:]) is opts[0]  # collective x1 is too slow


# ---- host floor and shared kernels (issue 9, s3c) -------------------------------------------------


def test_a_generation_that_keeps_the_kernels_pools_the_ep1_fit(meas, cal):
    """calibration.json 'kernels': a generation that changed only the real-EP engine shares the EP=1 fit
    with the generation whose layer kernels it runs."""
    for g in calibrate.DATA["engine_generations"]:
        if "kernels" not in g:
            continue
        old, new = g["kernels"], g["name"]
        assert calibrate.kernels_of(new) == old and calibrate.kernels_of(old) == old
        assert cal.compute_by_gen[("mok", new)] == cal.compute_by_gen[("mok", old)]
        share = {
            x["name"] for x in calibrate.DATA["engine_generations"] if calibrate.kernels_of(x["name"]) == old
        }
        pooled = [p for p in meas.layer1 if p.impl == "mok" and calibrate.engine_of(p.source) in share]
        assert cal.compute_by_gen[("mok", new)].points == len(pooled)


def test_ep_json_profile_rows_are_read_with_their_unprofiled_time(tmp_path):
    rows = [
        {"shape": "qwen3", "ep": 2, "impl": "mok", "transport": "collective exact", "chunks": 1, "ms": 16.0,
         "profile": {"gpu_span_ms": 18.0, "gpu_ops": 500, "host_ms": 17.5}},
        {"shape": "qwen3", "ep": 2, "impl": "mok", "transport": "plain", "chunks": 1, "ms": 15.0},
    ]  # fmt: skip
    (tmp_path / "ep.json").write_text(json.dumps(rows))
    prof = measurements.ep_profiles(tmp_path)
    assert [(p.what, p.launches, p.host_ms, p.wall_ms, p.unprofiled_ms) for p in prof] == [
        ("qwen3 EP=2 mok collective exact x1", 500, 17.5, 18.0, 16.0)
    ]


def test_host_floor_arithmetic_hand_computed():
    f = calibrate.HostFloor("g", {"collective": 500}, 30.0, 0.75)
    assert f.ms("collective", 1) == pytest.approx(500 * 30e-3)  # 15 ms
    assert f.ms("collective", 3) == pytest.approx(500 * (1 + 0.75 * 2) * 30e-3)  # 37.5 ms
    assert f.ms("copy_engine", 1) is None  # never profiled: no floor
    P = measurements.Profile
    prof = [
        P("r", "dsv3-4k pipe C=1 det=True", 19.0, 255, 10.0),
        P("r", "dsv3-4k pipe C=4 det=True", 33.0, 840, 28.0),
        P("s", "qwen3 EP=2 mok collective exact x1", 18.0, 400, 16.0, 15.0),
        P("s", "qwen3 EP=2 mok collective exact x2", 30.0, 700, 28.0, 27.0),
    ]
    r = calibrate.minibatch_launch_growth(prof)
    assert r == pytest.approx(statistics.median([(840 / 255 - 1) / 3, 700 / 400 - 1]))


def test_host_floor_ignores_graph_replays_and_gpu_stalled_profiles():
    """Per-launch cost from eager profiles only: a CUDA graph replay enqueues one launch for the layer and a
    step stalled on the GPU (span > 2 x host and unprofiled time) says nothing about the profiler's slowdown."""
    P = measurements.Profile
    eager = P("s7e", "dsv3 EP=2 mok collective fused exact x1", 27.0, 300, 18.0, 21.0)
    prof = (
        eager,
        P("s7e", "dsv3 EP=2 mok collective fused exact x2", 30.0, 500, 25.0, 24.0),
        P("s7e", "dsv3 EP=2 mok collective fused sync-free+graph x1", 17.5, 300, 0.3, 17.0),
        P("s7e", "qwen3 EP=2 mok copy_engine fused exact x1", 356.0, 316, 18.7, 14.4),
    )
    floors = calibrate.fit_host_floors(measurements.Measurements((), (), (), prof))
    f = floors[calibrate.engine_of("s7e")]
    # the lowest eager one: 25 ms / 500 launches x 24 / 30 (the graph replay's 0.3 ms / 300 would be lower)
    assert f.us_per_launch == pytest.approx(
        min(1e3 * 18.0 / 300 * 21.0 / 27.0, 1e3 * 25.0 / 500 * 24.0 / 30.0)
    )
    assert f.launches == {"collective fused": 300}


def test_host_floor_is_a_lower_bound_of_its_generation_and_binds_only_with_host_measured(meas, cal):
    floor = cal.host_floor()
    assert floor is not None and 0 < floor.us_per_launch < 100
    # engine-5 on: launches per (transport, local rows); overlap launches more than fused; asked without
    # local rows, a transport gets the median over them
    n = floor.launches
    assert 100 < n["collective fused"] < n["collective overlap"] and 100 < n["copy_engine fused"]
    assert floor.ms("collective", 1) == pytest.approx(
        statistics.median([n["collective fused"], n["collective overlap"]]) * floor.us_per_launch / 1e3
    )
    # the per-launch cost is the lowest profiled one, corrected for the profiler's slowdown; a profiled
    # step stalled on the GPU (span > 2 x its host and unprofiled times) does not measure that slowdown
    rows = [
        p
        for p in meas.profiles
        if p.unprofiled_ms and calibrate.engine_of(p.source) == floor.gen and " mok " in p.what
    ]
    stalled = [p for p in rows if p.wall_ms > calibrate.STALLED_PROFILE * max(p.host_ms, p.unprofiled_ms)]
    assert [(p.source, p.what) for p in stalled] == [("s7e", "qwen3 EP=2 mok copy_engine fused exact x1")]
    assert floor.us_per_launch == pytest.approx(
        min(1e3 * p.host_ms / p.launches * p.unprofiled_ms / p.wall_ms for p in rows if p not in stalled)
    )
    eps = [p for p in meas.ep if p.impl == "mok" and calibrate.engine_of(p.source) == floor.gen]
    assert eps
    for p in eps:
        if (
            "graph" in p.mode
        ):  # one graph replay per layer: no per-kernel enqueue, no floor (the model's rule)
            continue
        f = floor.ms(p.transport, p.chunks, calibrate.split_mode(p.mode)[1])
        assert f is not None and f <= p.ms * (1 + validate.TOLERANCE), (p, f)
    model, layout, cl = recipe.load(str(measurements.DOCS.parent / "examples" / "deepseek_v3_gb300.sh"))
    hid = predict.layer_options(cal, model, layout, cl, predict.Assumptions("relative", "hidden"))
    mea = predict.layer_options(cal, model, layout, cl, predict.Assumptions("relative", "measured"))
    for h, m in zip(hid, mea, strict=True):
        if m.impl == "mok":
            f = 0.0 if "graph" in m.mode else floor.ms(m.transport, m.chunks, calibrate.split_mode(m.mode)[1])
            assert m.total_ms == pytest.approx(max(h.total_ms, f))
    assert any(m.total_ms > h.total_ms for h, m in zip(hid, mea, strict=True) if m.impl == "mok")


def test_local_rows_labels_from_the_auto_rule(meas):
    """s4c rows carry no local-rows label: calibration.json's auto rule labels them per link speed;
    s4d's labelled rows keep theirs; older runs stay unlabelled."""
    assert calibrate.split_mode("sync-free+graph fused") == ("sync-free+graph", "fused")
    assert calibrate.split_mode("exact") == ("exact", "")
    loop = calibrate.declared_only(meas).loop
    s4c = {(r.gbps, r.mode) for r in loop if r.source == "s4c" and r.mode.startswith("exact")}
    assert s4c == {(0.0, "exact fused"), (450.0, "exact fused"), (50.0, "exact overlap")}
    assert {r.mode for r in loop if r.source == "s4d"} >= {"exact overlap", "sync-free+graph fused"}
    assert {r.mode for r in loop if r.source == "run17"} == {"exact", "sync-free+graph"}


def test_pinned_and_joint_exposure_hand_computed():
    def row(gbps, ms, link):
        return measurements.LoopRow("x", "s", "m", gbps, 1, ms, 10.0, link, 0.0)

    # ms - t0 = O t0 + e link with O = 0.1, e = 0.5: 10 + 1 + 0.5 link
    fin = [row(450, 11 + 0.5 * 4, 4.0), row(50, 11 + 0.5 * 36, 36.0)]
    assert calibrate._pinned_e(fin, 0.1) == pytest.approx(0.5)
    o, e = calibrate._joint_oe(fin)
    assert (o, e) == (pytest.approx(0.1), pytest.approx(0.5))
    assert calibrate._joint_oe(fin[:1]) is None  # one link speed cannot separate O from e


def test_recommendation_picks_the_local_rows_for_the_link():
    def lp(mode, ms):
        return predict.LayerPrediction("mok", "collective", 2, mode, 5.0, 1.0, 2.0, 1.0, ms)

    opts = [lp("exact fused", 10.0), lp("exact overlap", 10.1), lp("sync-free+graph fused", 9.0)]
    assert predict.recommended(opts[:2], fast_link=True).mode == "exact fused"
    assert predict.recommended(opts[:2], fast_link=False).mode == "exact overlap"
    assert predict.recommended(opts).mode == "sync-free+graph fused"  # exact is > 3 % slower


def test_ep_labels_with_local_rows_read_as_the_loopback_spelling(tmp_path):
    rows = [
        {"shape": "qwen3", "ep": 2, "impl": "mok", "transport": t, "chunks": 1, "ms": 16.0}
        for t in ("collective exact", "copy_engine fused sync-free+graph", "collective overlap exact",
                  "collective no-B exact", "plain")
    ]  # fmt: skip
    (tmp_path / "ep.json").write_text(json.dumps(rows))
    got = [(p.transport, p.mode) for p in measurements.ep_results(tmp_path)[1]]
    assert got == [
        ("collective", "exact"),
        ("copy_engine", "sync-free+graph fused"),
        ("collective", "exact overlap"),
        ("plain", "exact"),
    ]  # no-B (local rows in region A only) is not a modelled mode


def test_a_labelled_engine6_ep_run_gets_its_own_kappa(tmp_path, monkeypatch):
    """What s4b (EP=2, --local-rows, engine-6) will look like: declared by data, its labelled modes get
    engine-6 kappas from engine-6's loopback rows, and every point is predicted."""
    shutil.copy(measurements.DOCS / "benchmarks.md", tmp_path / "benchmarks.md")
    shutil.copytree(measurements.DOCS / "results", tmp_path / "results")
    src = json.loads((tmp_path / "results/2026-12-01/s4a/ep.json").read_text())
    out = []
    for r in src:
        if r["impl"] == "mok" and r["transport"] != "plain":
            tr, mode = r["transport"].split()
            for lr in ("overlap", "fused"):
                out.append(
                    dict(r, transport=f"{tr} {lr} {'exact' if mode == 'exact' else 'sync-free+graph'}")
                )
        else:
            out.append(r)
    (tmp_path / "results/2026-12-01/s4b").mkdir()
    (tmp_path / "results/2026-12-01/s4b/ep.json").write_text(json.dumps(out))
    gens = [
        dict(g, runs=[*g["runs"], "s4b"]) if g["name"] == "engine-6" else g
        for g in calibrate.DATA["engine_generations"]
    ]
    monkeypatch.setitem(calibrate.DATA, "engine_generations", gens)
    m = measurements.load(tmp_path)
    assert not calibrate.undeclared(m)
    cal = calibrate.calibrate(m)
    assert "exact fused" in cal.overlap.engines["engine-6"].kappa
    rows = [r for r in validate.checks(m) if r.source == "s4b"]
    assert any("sync-free+graph fused" in r.what for r in rows) and all(r.in_sample_ms > 0 for r in rows)


def test_fp8_expert_rows_of_ep_and_overlap_runs_are_not_fitted(tmp_path):
    ep = [
        {"shape": "qwen3", "ep": 2, "impl": "mok", "transport": "collective exact", "chunks": 1, "ms": 16.0},
        {"shape": "qwen3", "ep": 2, "impl": "mok", "transport": "collective exact", "chunks": 1, "ms": 12.0,
         "expert_backend": "torch-fp8"},
        {"shape": "qwen3", "ep": 2, "impl": "mok", "transport": "collective exact", "chunks": 1, "ms": 15.0,
         "expert_backend": "torch"},
    ]  # fmt: skip
    (tmp_path / "ep.json").write_text(json.dumps(ep))
    assert [p.ms for p in measurements.ep_results(tmp_path)[1]] == [16.0, 15.0]
    base = {"shape": "dsv3-4k", "mode": "exact", "chunks": 1, "comm_ms": 1.0, "bytes_per_step": 10}
    overlap = [
        {"shape": "dsv3-4k", "gbps": None, "chunks": 0, "ms": 15.0, "comm_ms": 0.0, "expert_backend": "torch"},
        {**base, "gbps": 450.0, "ms": 19.0, "expert_backend": "torch"},
        {"shape": "dsv3-4k", "gbps": None, "chunks": 0, "ms": 11.0, "comm_ms": 0.0, "expert_backend": "torch-fp8"},
        {**base, "gbps": 450.0, "ms": 17.0, "expert_backend": "torch-fp8"},
    ]  # fmt: skip
    (tmp_path / "overlap.json").write_text(json.dumps(overlap))
    ones, loops = measurements.overlap_results(tmp_path)
    assert [o.ms for o in ones] == [15.0] and [(lp.ms, lp.t0_ms) for lp in loops] == [(19.0, 15.0)]


def test_link_only_rows_and_shared_expert_shapes_are_not_fitted(tmp_path):
    # the loopback without its copies (an ideal transport) and a slice with a shared expert (the model has
    # none) are measured for the docs, not for the planner
    base = {"chunks": 1, "comm_ms": 1.0, "bytes_per_step": 10, "expert_backend": "torch"}
    overlap = [
        {**base, "shape": "dsv3-4k", "gbps": None, "chunks": 0, "ms": 15.0, "comm_ms": 0.0},
        {**base, "shape": "dsv3-4k", "gbps": 900.0, "ms": 16.0, "mode": "sync-free+graph overlap"},
        {**base, "shape": "dsv3-4k", "gbps": 900.0, "ms": 15.5, "mode": "sync-free+graph+link-only overlap"},
        {**base, "shape": "dsv3-4k", "gbps": 900.0, "ms": 15.4, "mode": "sync-free+graph+late-wgrad+link-only fused"},
        {**base, "shape": "dsv3-4k-shared", "gbps": None, "chunks": 0, "ms": 17.0, "comm_ms": 0.0},
        {**base, "shape": "dsv3-4k-shared", "gbps": 900.0, "ms": 18.0, "mode": "sync-free+graph overlap"},
    ]  # fmt: skip
    (tmp_path / "overlap.json").write_text(json.dumps(overlap))
    ones, loops = measurements.overlap_results(tmp_path)
    assert [(o.shape, o.ms) for o in ones] == [("dsv3-4k", 15.0)]
    assert [(lp.mode, lp.ms) for lp in loops] == [("sync-free+graph overlap", 16.0)]


def test_overlap_local_rows_use_the_fused_loopback_overhead():
    """No loopback row measured an "overlap" mode at infinite link (its O would be fitted jointly with e and
    clamp to 0): such a mode takes the fused mode's O and e; kappa, fitted per mode on real EP, carries the
    difference. A measured key keeps its own numbers; unlabelled (older) modes are untouched."""
    fused, over = ("qwen3", 1, "exact fused"), ("qwen3", 1, "exact overlap")
    fit = calibrate.OverlapFit(
        overhead={fused: 0.3, over: 0.0, ("qwen3", 1, "exact"): 0.5},
        exposed={fused: 0.2, over: 0.9, ("qwen3", 1, "exact"): 0.4},
        o_measured=frozenset({fused, ("qwen3", 1, "exact")}),
    )
    assert fit.oe(over) == (0.3, 0.2) and fit.oe(fused) == (0.3, 0.2)
    assert fit.oe(("qwen3", 1, "exact")) == (0.5, 0.4)
    measured_too = dataclasses.replace(fit, o_measured=fit.o_measured | {over})
    # a measured O below the loopback's noise (here 0: the pipelined layer tied the plain one) is floored,
    # in kappa's fit and in every prediction alike (s9: overlapped local rows beat plain at an infinite link)
    assert measured_too.oe(over) == (calibrate.O_FLOOR, 0.9)
    negative = dataclasses.replace(measured_too, overhead={**fit.overhead, over: -0.03})
    assert negative.oe(over) == (calibrate.O_FLOOR, 0.9)


def test_plain_transport_is_compared_with_exact_fused_once_modes_carry_local_rows():
    eng = calibrate.EngineFit
    assert (
        calibrate.plain_mode(eng("engine-9", {"exact fused": 1.2, "exact overlap": 2.0}, {}, 4))
        == "exact fused"
    )
    assert calibrate.plain_mode(eng("engine-4", {"exact": 2.1, "sync-free": 1.9}, {}, 4)) == "exact"
