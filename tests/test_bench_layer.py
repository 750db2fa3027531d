"""``mok bench layer`` on CPU: the tiny shape, every routing pattern, mok / megatron / plain-pytorch checked
against each other, the JSON schema (median / min / max per phase), progress on stderr, peers that cannot
run here listed with their reasons, the PNG."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from mok_megatron.bench.routing import ROUTINGS, expert_load, expert_order, forced_logits, routed_input
from mok_megatron.bench.timing import PHASES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {
    **os.environ,
    "TORCHDYNAMO_DISABLE": "1",
    "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
}
ROW_KEYS = {
    "impl",
    "note",
    "ms",
    "min_ms",
    "max_ms",
    "expert_tflops",
    "rel_err_out",
    "rel_err_dx",
    "peak_mem_mib",
    "gpu",
} | {f"{p}_{k}" for p in PHASES for k in ("ms", "min_ms", "max_ms", "tflops")}
CASE_KEYS = {
    "shape",
    "hidden",
    "ffn",
    "experts",
    "topk",
    "tokens",
    "routing",
    "expert_rows",
    "dtype",
    "iters",
}
CASE_KEYS |= {"warmup", "device", "reference", "peak_mem", "rows", "skipped", "expert_gemms", "gpu_clocks"}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "mok_megatron.cli", "bench", "layer", "--shape", "tiny", "--routing", "all"]
    cmd += [
        "--impl",
        "mok,megatron,megatron-te,torchtitan,plain-pytorch,sonic",
        "--iters",
        "3",
        "--warmup",
        "1",
    ]
    cmd += ["--json", str(d / "b.json"), "--png", str(d / "b.png")]
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout, json.loads((d / "b.json").read_text()), d / "b.png", p.stderr


def test_every_routing_runs_and_the_json_has_the_schema(bench_run):
    _, doc, _, _ = bench_run
    assert doc["command"].startswith("mok bench layer")
    assert [c["routing"] for c in doc["cases"]] == list(ROUTINGS)
    for c in doc["cases"]:
        assert set(c) == CASE_KEYS
        assert (c["shape"], c["device"], c["reference"], c["peak_mem"]) == (
            "tiny",
            "cpu",
            "mok",
            "n/a on CPU",
        )
        titan = ["torchtitan"] if importlib.util.find_spec("torchtitan") is not None else []
        assert [r["impl"] for r in c["rows"]] == ["mok", "megatron", *titan, "plain-pytorch"]
        assert sum(c["expert_rows"]) == c["tokens"] * c["topk"]
        for r in c["rows"]:
            assert set(r) == ROW_KEYS
            assert r["peak_mem_mib"] is None
            assert r["ms"] == r["fwd_bwd_ms"] and all(r[f"{p}_ms"] > 0 for p in PHASES)
            assert (r["min_ms"], r["max_ms"]) == (r["fwd_bwd_min_ms"], r["fwd_bwd_max_ms"])
            assert all(r[f"{p}_min_ms"] <= r[f"{p}_ms"] <= r[f"{p}_max_ms"] for p in PHASES)
            assert max(r["rel_err_out"], r["rel_err_dx"]) < 5e-2
            assert r["fwd_bwd_tflops"] == pytest.approx(r["fwd_tflops"] * 3 * r["fwd_ms"] / r["fwd_bwd_ms"])
            assert r["gpu"] is None  # no nvidia-smi on the CPU box
        bound = c["expert_gemms"]
        assert all(bound[f"{p}_ms"] > 0 for p in PHASES) and bound["gpu"] is None
        assert all(bound[f"{p}_min_ms"] <= bound[f"{p}_ms"] <= bound[f"{p}_max_ms"] for p in PHASES)
        assert bound["fwd_bwd_tflops"] == pytest.approx(
            bound["fwd_tflops"] * 3 * bound["fwd_ms"] / bound["fwd_bwd_ms"]
        )
        assert c["gpu_clocks"] == "nvidia-smi not found"
    one_hot = doc["cases"][2]
    assert one_hot["expert_rows"][0] == one_hot["tokens"]


def test_peers_that_cannot_run_are_listed_with_reasons(bench_run):
    out, doc, _, _ = bench_run
    for c in doc["cases"]:
        reasons = {s["impl"]: s["reason"] for s in c["skipped"]}
        if importlib.util.find_spec("torchtitan") is None:
            assert reasons["torchtitan"] == "torchtitan not installed (pip install torchtitan)"
        if importlib.util.find_spec("sonicmoe") is None:
            assert reasons["sonic"] == "SonicMoE not installed (pip install sonic-moe)"
        else:
            assert reasons["sonic"] == "SonicMoE needs a Hopper or Blackwell GPU"
        if importlib.util.find_spec("transformer_engine") is None:
            assert "Transformer Engine not importable" in reasons["megatron-te"]
        else:
            assert reasons["megatron-te"] == "Transformer Engine needs a CUDA GPU"
    if importlib.util.find_spec("torchtitan") is None:
        assert "| torchtitan | skipped: " in out
    else:  # runs on CPU too, eager (compiling is tried on CUDA only)
        assert "| torchtitan | " in out and "| torchtitan | skipped: " not in out
    assert "| megatron-te | skipped: " in out and "| sonic | skipped: " in out
    assert out.count("| expert GEMMs alone | ") == len(ROUTINGS)
    assert out.count("GPU clocks: not sampled (nvidia-smi not found).") == len(ROUTINGS)
    assert out.count("| impl | fwd | bwd | fwd+bwd | fwd+bwd back to back | peak MiB |") == len(ROUTINGS)


def test_table_shows_median_min_and_max(bench_run):
    out, doc, _, _ = bench_run
    assert out.count("Median [min..max] of 3 after 1 warm-up") == len(ROUTINGS)
    for c in doc["cases"]:
        for r in c["rows"] + [dict(c["expert_gemms"], impl="expert GEMMs alone")]:
            cells = [
                f"{r[p + '_ms']:.3f} ms [{r[p + '_min_ms']:.3f}..{r[p + '_max_ms']:.3f}] ({r[p + '_tflops']:.3g})"
                for p in PHASES
            ]
            assert f"| {r['impl']} | {' | '.join(cells)} |" in out


def test_progress_one_line_per_case_and_implementation_in_order(bench_run):
    _, doc, _, err = bench_run
    lines = [ln for ln in err.splitlines() if re.match(r"\[\d+/\d+\] ", ln)]
    want = []
    n = len(doc["cases"])
    for i, c in enumerate(doc["cases"], 1):
        label = f"[{i}/{n}] {c['shape']} {c['routing']}"
        want.append(f"{label}: 6 implementation(s), 3 timed iterations after 1 warm-up")
        # in the order run: the Megatron-type layers first (the weights come from them), then the peers
        timed = {r["impl"]: r for r in c["rows"]}
        skipped = {s["impl"]: s["reason"] for s in c["skipped"]}
        for impl in ("mok", "megatron", "megatron-te", "torchtitan", "plain-pytorch", "sonic"):
            if impl in skipped:
                want.append(f"{label} {impl}: skipped ({skipped[impl]})")
            else:
                r = timed[impl]
                want.append(
                    f"{label} {impl}: fwd+bwd {r['fwd_bwd_ms']:.3f} ms ({r['fwd_bwd_min_ms']:.3f}.."
                    f"{r['fwd_bwd_max_ms']:.3f}), rel err out {r['rel_err_out']:.1e} dx {r['rel_err_dx']:.1e}"
                )
        b = c["expert_gemms"]
        want.append(
            f"{label} expert GEMMs alone: fwd+bwd {b['fwd_bwd_ms']:.3f} ms ({b['fwd_bwd_min_ms']:.3f}.."
            f"{b['fwd_bwd_max_ms']:.3f})"
        )
    assert lines == want


def test_spread_of_samples():
    from mok_megatron.bench.timing import spread_ms

    assert spread_ms([0.003, 0.001, 0.002, 0.010]) == pytest.approx(
        {"ms": 2.5, "min_ms": 1.0, "max_ms": 10.0}
    )
    with pytest.raises(ValueError, match="no timed iterations"):
        spread_ms([])


def test_png_written_or_its_absence_explained(bench_run, monkeypatch, tmp_path):
    out, doc, png, _ = bench_run
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"PNG written: {png}" in out
    else:
        assert not png.exists() and "PNG not written: matplotlib is not installed" in out
    from mok_megatron.bench.report import write_png

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now fails: the CI-without-matplotlib path
    msg = write_png(str(tmp_path / "x.png"), doc["cases"])
    assert (
        msg.startswith("PNG not written: matplotlib is not installed") and not (tmp_path / "x.png").exists()
    )


def test_forced_routing_is_exact_and_shaped_as_named():
    t, e, k = 4096, 16, 4
    for routing in ROUTINGS:
        logits = forced_logits(routing, t, e)
        assert torch.equal(logits, logits.bfloat16().float())  # exact in bf16: every router sees the same
        assert all(len(set(row.tolist())) == e for row in logits[:64])  # no ties for top-k to break
        assert torch.equal(torch.topk(logits, k).indices, expert_order(routing, t, e)[:, :k])
    uniform, zipf, hot = (expert_load(r, t, e, k) for r in ROUTINGS)
    assert max(uniform) < 1.15 * t * k / e
    assert zipf[0] > 2 * max(uniform) and zipf[0] > 5 * zipf[-1]
    assert hot[0] == t
    x = routed_input("zipf", 8, 32, 16)
    assert torch.equal(x[:, :16], forced_logits("zipf", 8, 16))


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="routing 'skew': choose one of uniform, zipf, one-hot"):
        expert_order("skew", 4, 4)
    with pytest.raises(ValueError, match="hidden=8 < experts=16"):
        routed_input("uniform", 4, 8, 16)
    from mok_megatron.bench.suite import check_impls

    with pytest.raises(ValueError, match=r"unknown implementation\(s\) \['titan'\]"):
        check_impls(["mok", "titan"])
    with pytest.raises(
        ValueError, match=r"\['mok-tile'\]: choose from mok, .*; opt-in rows: .*\bmok-tiles\b"
    ):
        check_impls(["mok", "mok-tile"])
    with pytest.raises(ValueError, match="include one of mok, megatron, megatron-te"):
        check_impls(["plain-pytorch"])


def test_plain_pytorch_matches_a_per_token_loop():
    from mok_megatron.bench.peers import PlainMoE

    g = torch.Generator().manual_seed(0)
    t, h, f, e, k = 24, 16, 8, 4, 2
    router, fc1, fc2 = (torch.randn(*s, generator=g) for s in ((e, h), (e, 2 * f, h), (e, h, f)))
    x = torch.randn(t, 1, h, generator=g)
    layer = PlainMoE(router, fc1, fc2, topk=k)
    loop = PlainMoE(router, fc1, fc2, topk=k)
    loop.grouped = False
    want = torch.zeros(t, h)
    for i in range(t):
        top, ids = torch.topk(x[i, 0] @ router.t(), k)
        for p, j in zip(torch.softmax(top, -1), ids, strict=True):
            gate, up = (fc1[j] @ x[i, 0]).chunk(2)
            want[i] += p * (fc2[j] @ (torch.nn.functional.silu(gate) * up))
    for impl in (layer, loop):
        torch.testing.assert_close(impl(x)[0][:, 0], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="topk=5 must be between 1 and experts=4"):
        PlainMoE(router, fc1, fc2, topk=5)


FAKE_TORCHTITAN = """
from dataclasses import dataclass
import torch
from torch import nn


@dataclass
class MoEArgs:  # the older torchtitan API's fields the adapter sets
    num_experts: int = 8
    num_shared_experts: int = 1
    score_func: str = "sigmoid"
    route_norm: bool = False
    score_before_experts: bool = True
    top_k: int = 1
    load_balance_coeff: float | None = 1e-3


class _Router(nn.Module):
    def __init__(self, dim, e):
        super().__init__()
        self.gate = nn.Linear(dim, e, bias=False)


class _Experts(nn.Module):
    def __init__(self, dim, hidden, e):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(e, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(e, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(e, hidden, dim))


class MoE(nn.Module):
    def __init__(self, args, dim, hidden_dim):
        super().__init__()
        assert args.score_func == "softmax" and args.route_norm and not args.score_before_experts
        self.k = args.top_k
        self.router = _Router(dim, args.num_experts)
        self.experts = _Experts(dim, hidden_dim, args.num_experts)

    def forward(self, x):
        bs, slen, dim = x.shape
        x = x.reshape(-1, dim)
        scores = torch.softmax(self.router.gate(x).float(), -1)
        top, ids = torch.topk(scores, self.k)
        top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for j in range(self.k):
            w1, w2, w3 = self.experts.w1[ids[:, j]], self.experts.w2[ids[:, j]], self.experts.w3[ids[:, j]]
            h = torch.nn.functional.silu(torch.einsum("th,tfh->tf", x, w1)) * torch.einsum("th,tfh->tf", x, w3)
            out = out + top[:, j, None] * torch.einsum("tf,thf->th", h, w2)
        return out.reshape(bs, slen, dim)
"""


def test_torchtitan_adapter_copies_the_weights_in(tmp_path, monkeypatch):
    """Against a stand-in for torchtitan's older ``models.moe`` API (the real one is installed only on
    the GPU machine): the adapter's output must equal the plain-PyTorch layer's on the same weights."""
    from mok_megatron.bench.peers import PlainMoE
    from mok_megatron.bench.torchtitan import PeerUnavailable, TorchtitanMoE

    (tmp_path / "torchtitan" / "models").mkdir(parents=True)
    (tmp_path / "torchtitan" / "__init__.py").write_text("")
    (tmp_path / "torchtitan" / "models" / "__init__.py").write_text("")
    (tmp_path / "torchtitan" / "models" / "moe.py").write_text(FAKE_TORCHTITAN)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("torchtitan")]:
        monkeypatch.delitem(sys.modules, name)
    g = torch.Generator().manual_seed(1)
    t, h, f, e, k = 20, 12, 6, 4, 2
    router, fc1, fc2 = (torch.randn(*s, generator=g) for s in ((e, h), (e, 2 * f, h), (e, h, f)))
    x = torch.randn(t, 1, h, generator=g)
    titan = TorchtitanMoE(router, fc1, fc2, topk=k)
    torch.testing.assert_close(titan(x)[0], PlainMoE(router, fc1, fc2, topk=k)(x)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(PeerUnavailable, match=r"experts.w1 \(4, 6, 12\) matches no MoK weight \(4, 5, 12\)"):
        TorchtitanMoE(router, torch.randn(e, 10, h), torch.randn(e, h, 6), topk=k)


def test_torchtitan_adapter_against_the_installed_package(monkeypatch):
    """The real torchtitan (0.3.0 on the GPU machine; on CPU put its unzipped wheel on PYTHONPATH): same
    output as the plain-PyTorch layer on the same weights (torchtitan runs its experts in bf16), a working
    backward, and torch.compile failures reported in the note while the layer still runs eager."""
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan not installed (CPU: unzip its wheel and put it on PYTHONPATH)")
    from mok_megatron.bench.peers import PlainMoE
    from mok_megatron.bench.torchtitan import TorchtitanMoE

    g = torch.Generator().manual_seed(1)
    t, h, f, e, k = 24, 16, 8, 4, 2
    router, fc1, fc2 = (torch.randn(*s, generator=g) for s in ((e, h), (e, 2 * f, h), (e, h, f)))
    x = torch.randn(t, 1, h, generator=g)
    titan = TorchtitanMoE(router, fc1, fc2, topk=k)
    want = PlainMoE(router, fc1, fc2, topk=k)(x)[0]
    xi = x.clone().requires_grad_(True)
    got = titan(xi)[0]
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2
    got.square().mean().backward()
    assert xi.grad is not None and torch.isfinite(xi.grad).all()

    def broken_compile(module, **kw):
        def run(*a):
            raise RuntimeError("inductor says no\nsecond line")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    note = titan.compile_moe(x)
    assert note == "eager (torch.compile failed: RuntimeError: inductor says no)"
    torch.testing.assert_close(titan(x)[0], got.detach())


def test_back_to_back_timing_runs_every_step_and_times_each():
    from mok_megatron.bench.timing import _timed_back_to_back

    calls = []
    times = _timed_back_to_back(lambda: calls.append(1), iters=5, warmup=2)
    assert len(calls) == 7 and len(times) == 5 and all(t >= 0 for t in times)


def test_engine_rows_run_mok_on_another_engine(tmp_path):
    """``--impl mok,mok-tiles``: MoK's layer on the tiles engine (its references on CPU) beside the default
    engine, the same weights and input, its output and input gradient within the bf16 tolerance."""
    from mok_megatron.bench.suite import TOLERANCE

    out = tmp_path / "e.json"
    cmd = [sys.executable, "-m", "mok_megatron.cli", "bench", "layer", "--shape", "tiny"]
    cmd += ["--impl", "mok,mok-tiles", "--iters", "2", "--warmup", "1", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    (case,) = json.loads(out.read_text())["cases"]
    rows = {r["impl"]: r for r in case["rows"]}
    assert set(rows) >= {"mok", "mok-tiles"}, (rows.keys(), case["skipped"])
    tiles = rows["mok-tiles"]
    assert tiles["ms"] > 0
    assert tiles["note"] == "--mok-engine tiles: the tile kernels' torch references", tiles["note"]
    assert tiles["rel_err_out"] < TOLERANCE["bf16"] and tiles["rel_err_dx"] < TOLERANCE["bf16"], tiles
