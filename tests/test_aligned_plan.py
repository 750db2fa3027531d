"""The aligned EP=1 plan (``engine.plan.build_aligned_plan``): the permute writes every expert's rows
padded to the experts' alignment (padding rows zero, probability 0), so the native FP8 experts run on the
buffer as it is. On CPU the plan drives Megatron-style bf16/fp32 experts (which accept any layout), so
the layer must equal Megatron's alltoall MoELayer exactly as the unaligned plan does."""

from __future__ import annotations

import pytest
import torch

from mok_megatron.engine.plan import RowLayout
from mok_megatron.options import ExpertBackend
from tests.cases import build_layers, compare, make_config, run_layer, with_engine

pytestmark = pytest.mark.usefixtures("single_rank")


def _inputs(cfg, seq=16, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(seq, batch, cfg.hidden_size, generator=g)
    return x, torch.randn(seq, batch, cfg.hidden_size, generator=g)


@pytest.mark.parametrize("alignment", [1, 4, 16])  # 1: what every EP=1 MoK layer runs by default
@pytest.mark.parametrize("topk,experts", [(2, 8), (1, 5), (4, 6)])
def test_aligned_plan_layer_equals_megatron(alignment, topk, experts, monkeypatch):
    import mok_megatron.adapter.dispatcher as D

    built = []
    real = D.build_aligned_plan
    monkeypatch.setattr(D, "build_aligned_plan", lambda *a, **k: built.append(a[-1]) or real(*a, **k))
    cfg = make_config(topk=topk, num_experts=experts)
    ref, mok = build_layers(cfg)
    with_engine(mok, row_alignment=alignment)
    x, dout = _inputs(cfg)
    d = compare(run_layer(ref, x, dout), run_layer(mok, x, dout))
    assert built == [alignment], "the layer must have run on the aligned plan"
    for key, val in d.items():
        if key.endswith("_scale") or key == "aux_names":
            continue
        scale = d.get(f"{key}_scale", 1.0) or 1.0
        assert val <= 1e-5 * max(scale, 1.0), (key, val, scale)


def test_aligned_plan_layout():
    from mok_megatron.engine.plan import EPGroups, build_aligned_plan
    from mok_megatron.config import MoKConfig
    from mok_megatron.engine import plain as F

    cfg = make_config(topk=2, num_experts=5)
    mc = MoKConfig.from_megatron(cfg, ep_size=1, etp_size=1)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(13, 5, generator=g)
    top = logits.topk(2, dim=1).indices
    rmap = torch.zeros(13, 5, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.where(rmap, torch.rand(13, 5, generator=g) + 0.1, 0.0)
    plan = build_aligned_plan(torch.Size([13, 1, 8]), rmap, probs, mc, EPGroups(), alignment=4)
    counts = rmap.sum(0)
    rows = plan.meta.num_rows
    assert rows % 4 == 0 and rows >= int(((counts + 3) // 4 * 4).sum())
    tpe = plan.tokens_per_expert_L
    assert int(tpe.sum()) == rows and bool((tpe % 4 == 0).all())
    assert torch.equal(tpe[:-1], ((counts + 3) // 4 * 4)[:-1])
    x = torch.randn(13, 8, generator=g)
    x_PH, probs_P = F.dispatch_preprocess(x, probs, plan)
    assert x_PH.shape == (rows, 8) and probs_P.shape == (rows,)
    # Each expert's real rows first (its tokens in ascending order), then zero padding rows.
    start = 0
    for e in range(5):
        toks = rmap[:, e].nonzero().flatten()
        n = len(toks)
        assert torch.equal(x_PH[start : start + n], x[toks])
        assert torch.equal(probs_P[start : start + n], probs[toks, e])
        end = start + int(tpe[e])
        assert not x_PH[start + n : end].any() and not probs_P[start + n : end].any()
        start = end
    # combine undoes it: sum of each token's rows
    out = F.combine_postprocess(x_PH, plan)
    torch.testing.assert_close(out.view(13, 8), x * 2)


def test_exact_rows_size_the_buffer_to_the_padded_total():
    from mok_megatron.config import MoKConfig
    from mok_megatron.engine.plan import EPGroups, build_aligned_plan

    mc = MoKConfig.from_megatron(make_config(topk=2, num_experts=5), ep_size=1, etp_size=1)
    g = torch.Generator().manual_seed(4)
    top = torch.randn(21, 5, generator=g).topk(2, dim=1).indices
    rmap = torch.zeros(21, 5, dtype=torch.bool).scatter_(1, top, True)
    padded = (rmap.sum(0) + 7) // 8 * 8
    plan = build_aligned_plan(torch.Size([21, 1, 4]), rmap, rmap.float(), mc, EPGroups(), 8, exact_rows=True)
    assert plan.meta.num_rows == int(padded.sum())
    assert torch.equal(plan.tokens_per_expert_L, padded)
    assert plan.tokens_per_expert_L.device.type == "cpu"  # host counts for TE's m_splits
    static = build_aligned_plan(torch.Size([21, 1, 4]), rmap, rmap.float(), mc, EPGroups(), 8)
    assert static.meta.num_rows >= plan.meta.num_rows and static.meta.num_rows % 8 == 0


@pytest.mark.parametrize("exact", [False, True])
def test_layer_with_exact_rows_equals_megatron(exact):
    cfg = make_config(topk=2, num_experts=8)
    ref, mok = build_layers(cfg)
    with_engine(mok, rows=RowLayout.ALIGNED_EXACT if exact else RowLayout.ALIGNED, row_alignment=16)
    x, dout = _inputs(cfg, seed=5)
    d = compare(run_layer(ref, x, dout), run_layer(mok, x, dout))
    assert d["out"] <= 1e-5 * max(d["out_scale"], 1.0) and d["dx"] <= 1e-5 * max(d["dx_scale"], 1.0)


def test_aligned_plan_refuses_ep_or_drops():
    from mok_megatron.config import MoKConfig
    from mok_megatron.engine.plan import EPGroups, aligned_plan_applies, build_aligned_plan

    drop = MoKConfig.from_megatron(make_config(mode="drop_probs"), ep_size=1, etp_size=1)
    assert not aligned_plan_applies(drop)
    rmap = torch.ones(4, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="dropless"):
        build_aligned_plan(torch.Size([4, 1, 16]), rmap, rmap.float(), drop, EPGroups(), 16)


def test_fp8_experts_pick_the_mlp_for_their_input(monkeypatch):
    """torch-fp8 experts run the aligned MLP on rows the dispatcher padded, the padding MLP otherwise
    (the FP8 MLPs themselves need a GPU: tests/test_fp8_gpu.py)."""
    import mok_megatron.experts.fp8_mlp as P
    from mok_megatron.ops import fp8_grouped_gemm as native

    calls = []
    for name in ("native_expert_mlp", "native_expert_mlp_aligned"):
        monkeypatch.setattr(P, name, lambda *a, _n=name, **k: calls.append((_n, len(a), k)) or a[0])
    monkeypatch.setattr(native, "check_native_fp8", lambda device: None)  # CPU: no FP8 GEMMs
    _, mok = build_layers(make_config(), opts=dict(expert_backend="torch-fp8"))
    experts = mok.experts
    assert type(experts) is P.MoKFP8GroupedMLP
    x, tpe, probs = torch.randn(8, 16), torch.tensor([8] + [0] * 7), torch.rand(8)
    for aligned, want in ((1, "native_expert_mlp"), (16, "native_expert_mlp_aligned")):
        experts.aligned_input = aligned
        out, bias = experts(x, tpe, probs)
        assert out is x and bias is None
        assert calls[-1] == (want, 6, {"apply_probs_on_input": False, "cache": experts.fp8_weights})


@pytest.mark.parametrize("wgrad", ["fp8", "bf16"])
@pytest.mark.parametrize("topk,experts", [(2, 8), (4, 6)])
def test_fp8_layer_fuses_permute_into_the_experts(wgrad, topk, experts, monkeypatch):
    """With native FP8 experts at EP = 1 the layer hands the token rows and the aligned plan to the
    experts (``MoKTokenDispatcher.run_fused`` -> ``experts.fp8_mlp.fp8_token_mlp``): output, input and
    weight gradients equal the unfused aligned path's bitwise (FP8 GEMM emulated in fp32: CPU has none),
    and stay within FP8's error of Megatron's layer."""
    import mok_megatron.experts.fp8_mlp as TE
    from mok_megatron.experts.checkpoint import convert_state_dict
    from mok_megatron.ops import fp8_grouped_gemm as native
    from tests.test_fp8 import _fake_scaled_grouped_mm

    monkeypatch.setattr(native, "_gemm", _fake_scaled_grouped_mm([]))
    monkeypatch.setattr(native, "check_native_fp8", lambda device: None)
    monkeypatch.setattr(native, "WGRAD_FP8_MIN_ROWS", 1 if wgrad == "fp8" else 10**9)
    calls = []
    real = TE.fp8_token_mlp
    monkeypatch.setattr(TE, "fp8_token_mlp", lambda *a: calls.append(1) or real(*a))
    cfg = make_config(topk=topk, num_experts=experts, ffn=16)
    ref, mok = build_layers(cfg, opts=dict(expert_backend="torch-fp8"))
    engine = mok.token_dispatcher.engine
    assert engine.rows is RowLayout.FUSED and engine.row_alignment == native.ALIGNMENT
    assert mok.experts.expert_backend is ExpertBackend.TORCH_FP8, "the layer's options reach its experts"
    x, dout = _inputs(cfg)
    fused = run_layer(mok, x, dout)
    assert calls == [1], "the fused experts must have run"
    mok.zero_grad(set_to_none=True)
    with_engine(mok, rows=RowLayout.ALIGNED)
    unfused = run_layer(mok, x, dout)
    assert calls == [1]
    d = compare(unfused, fused)
    for key, val in d.items():
        if not key.endswith("_scale") and key != "aux_names":
            assert val == 0, (key, val)
    (o1, dx1, g1, _), (o2, dx2, g2, _) = run_layer(ref, x, dout), fused
    g1 = convert_state_dict(g1, "mok")

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    pairs = [("out", o2, o1), ("dx", dx2, dx1)] + [(k, g2[k], g1[k]) for k in g2 if "experts" in k]
    for name, a, b in pairs:  # e4m3 rounding (2^-4) on both GEMM operands: ~0.07 on the H200
        assert rel(a, b) < 0.1, (name, rel(a, b))
