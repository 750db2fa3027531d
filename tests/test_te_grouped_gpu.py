"""The TE expert backend on TE's grouped GEMM, on a GPU (skipped without CUDA, without Transformer Engine, and
where TE's grouped route cannot run the recipe: Hopper needs cuBLASLt 13.4+ for bf16, 13.5+ tensorwise, 13.6+
blockwise, the ``nvidia-cublas`` wheel preloaded; the reason is the build's note).

Each case builds, with the same weights and input: MoK's te layer on the grouped route, MoK's te layer on TE's
per-expert route (``NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM=0`` at build), and Megatron's alltoall layer in
bf16 (SequentialMLP; the reference). Checked: output, input gradient and every expert weight gradient are
finite; grouped vs per-expert within ``SAME_REL`` (the same quantization of the same rows; the GEMMs differ in
accumulation order only); each vs the bf16 reference within ``BF16_REL`` (bf16) or ``FP8_REL`` (FP8); TE's
grouped GEMM ran and its per-expert GEMMs did not. 8 experts (one TE call) and 128 (two calls of 64);
the sync-free pipeline with 64 (one call). With ``--mok-te-single-weight`` (one TE grouped weight per
projection): the same comparisons, one TE call per projection and pass at 8 and 128 experts, the sync-free
pipeline at 128, and checkpoints (plain and dist_checkpointing) moving between the two layouts.

Run on one Hopper GPU:
    LD_PRELOAD="<wheel>/nvidia/cu13/lib/libcublasLt.so.13 <wheel>/nvidia/cu13/lib/libcublas.so.13" \\
        python -m pytest -q tests/test_te_grouped_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from mok_megatron.compat import have_te
from tests.harness.gpu import layer_steps as _layer_steps
from tests.harness.gpu import rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not have_te(), reason="needs Transformer Engine"),
]

FP8_REL = 0.1  # as tests/test_fp8_gpu.py: e4m3 rounding through two chained GEMMs
BF16_REL = 3e-2
SAME_REL = 2e-2
SHAPES = {
    8: dict(hidden=512, ffn=256, experts=8, topk=2, tokens=1024),
    64: dict(hidden=256, ffn=128, experts=64, topk=8, tokens=1024),
    128: dict(hidden=256, ffn=128, experts=128, topk=8, tokens=1024),
}


def _config(experts: int, recipe: str | None):
    from mok_megatron.bench.build import layer_config
    from mok_megatron.bench.fp8_layers import fp8_config

    return fp8_config(layer_config(SHAPES[experts], torch.bfloat16), recipe)


def _grouped_or_skip(cfg, recipe):
    from mok_megatron.bench.fp8_layers import unavailable
    from mok_megatron.experts.te import route_for

    why = unavailable("te", recipe)
    if why:
        pytest.skip(f"{recipe}: {why}")
    route = route_for(cfg)
    if not route.grouped:
        pytest.skip(route.note or f"{recipe or 'bf16'} on TE's per-expert GEMMs: {route.reason}")


def _build(impl, cfg, monkeypatch=None, per_expert=False, options=None, transport=None):
    from mok_megatron.bench.build import build
    from mok_megatron.options import MoKOptions

    torch.manual_seed(0)
    if impl != "mok":
        return build(impl, cfg).cuda()
    with monkeypatch.context() as m:
        if per_expert:
            m.setenv("NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM", "0")
        opts = options or MoKOptions(expert_backend="te")
        return build("mok", cfg, options=opts, transport=transport).cuda()


class _GemmCounter:
    """Calls of TE's grouped GEMM and of its per-expert GEMMs."""

    def __init__(self, monkeypatch):
        import transformer_engine.pytorch.module.grouped_linear as gl

        self.calls = {"grouped": 0, "per_expert": 0}
        names = (
            ("general_grouped_gemm_for_grouped_tensor", "grouped"),
            ("general_grouped_gemm", "per_expert"),
        )
        for attr, key in names:
            real = getattr(gl, attr)

            def counted(*a, _real=real, _key=key, **k):
                self.calls[_key] += 1
                return _real(*a, **k)

            monkeypatch.setattr(gl, attr, counted)


def _expert_grads(layer) -> dict:
    """The experts' weight gradients by parameter name; a single grouped weight's (``linear_fc1.weight``,
    ``[L, N, K]``) under MoK's stacked name (``fc1_weight``)."""
    import re

    grads = {}
    for n, p in layer.named_parameters():
        if p.grad is None or "experts" not in n:
            continue
        g = p.grad
        g = g.rowwise_data.view(p.shape) if hasattr(g, "rowwise_data") else g  # a TE grouped gradient
        # MoK's single grouped weight sits right under ``experts`` (Megatron's are ``local_experts.<i>.*``)
        m = re.fullmatch(r"(.*experts\.)linear_fc([12])\.weight", n)
        grads[f"{m.group(1)}fc{m.group(2)}_weight" if m else n] = g.float()
    return grads


def layer_steps(layer, cfg, x, dout, steps):
    """``tests.harness.gpu.layer_steps`` reading a single grouped weight's gradient as MoK's stacked one."""
    return _layer_steps(layer, cfg, x, dout, steps, grads=_expert_grads)


def _errors(got, want):
    errs = {"out": rel(got[0], want[0]), "dx": rel(got[1], want[1])}
    assert set(got[2]) == set(want[2])
    errs.update({k: rel(got[2][k], want[2][k]) for k in want[2]})
    return errs


def _finite(res, name):
    assert torch.isfinite(res[0]).all() and torch.isfinite(res[1]).all(), f"{name}: non-finite output / dx"
    for k, v in res[2].items():
        assert torch.isfinite(v).all(), f"{name}: non-finite {k}"


def _inputs(experts, seed=0):
    s = SHAPES[experts]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s["tokens"], 1, s["hidden"], generator=g).to("cuda", torch.bfloat16)
    dout = torch.randn(s["tokens"], 1, s["hidden"], generator=g).to("cuda", torch.bfloat16)
    return x, dout


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("experts", [8, 128])
@pytest.mark.parametrize("recipe", [None, "tensorwise", "blockwise"])
def test_grouped_route_matches_per_expert_route_and_megatron(recipe, experts, monkeypatch):
    from mok_megatron.experts.checkpoint import convert_state_dict

    cfg = _config(experts, recipe)
    _grouped_or_skip(cfg, recipe)
    ref_cfg = _config(experts, None)
    ref = _build("megatron", ref_cfg)
    state = convert_state_dict(ref.state_dict(), "mok")
    x, dout = _inputs(experts)
    want = layer_steps(ref, ref_cfg, x, dout, 1)
    per_expert = _build("mok", cfg, monkeypatch, per_expert=True)
    grouped = _build("mok", cfg, monkeypatch)
    for layer in (per_expert, grouped):
        layer.load_state_dict(state, strict=True)
    assert not per_expert.experts.route.grouped and grouped.experts.route.grouped
    assert grouped.experts.linear_fc1.use_grouped_tensor
    assert (grouped.experts._views is not None) == (experts > 64)
    steps = 3 if recipe else 1
    old = layer_steps(per_expert, cfg, x, dout, steps)
    counter = _GemmCounter(monkeypatch)
    new = layer_steps(grouped, cfg, x, dout, steps)
    assert counter.calls["grouped"] > 0 and counter.calls["per_expert"] == 0, counter.calls
    _finite(old, "per-expert")
    _finite(new, "grouped")
    bound = BF16_REL if recipe is None else FP8_REL
    vs_ref, vs_old = _errors(new, want), _errors(new, old)
    assert max(vs_ref.values()) < bound, vs_ref
    assert max(vs_old.values()) < SAME_REL, vs_old
    if recipe is not None:  # FP8 really ran: further from bf16 than bf16's own rounding
        assert vs_ref["out"] > 5e-3, vs_ref


def _sync_free_pipeline_case(experts, recipe, options, monkeypatch):
    """The overlap pipeline (loopback emulating EP=8's traffic) with ``options`` against the EP=1 per-expert TE
    layer and Megatron's bf16 layer, same weights and input: finite, within the recipe's bound of the
    reference, and, where both quantize the same rows the same way (bf16, blockwise: scales per block of
    rows), within ``SAME_REL`` of the EP=1 layer. Tensorwise (current scaling) takes one amax per GEMM
    operand over each call's rows, and the pipeline calls the experts per minibatch and per region (the
    received rows, the local ones): other scales than the EP=1 layer's single call, so the two are two FP8
    roundings of the same layer (on one H200 5.6 % apart after three steps), each held to ``FP8_REL`` of the
    reference. Returns the pipeline layer."""
    from mok_megatron.experts.checkpoint import convert_state_dict
    from mok_megatron.transport.loopback import LoopbackLink, LoopbackTransport

    cfg = _config(experts, recipe)
    _grouped_or_skip(cfg, recipe)
    ref_cfg = _config(experts, None)
    ref = _build("megatron", ref_cfg)
    state = convert_state_dict(ref.state_dict(), "mok")
    x, dout = _inputs(experts, seed=5)
    want = layer_steps(ref, ref_cfg, x, dout, 1)
    ep1 = _build("mok", cfg, monkeypatch, per_expert=True)
    link = LoopbackLink(ep=8, gbps=450.0)
    transport = LoopbackTransport(link, cfg.num_moe_experts, cfg.moe_router_topk)
    pipe = _build("mok", cfg, monkeypatch, options=options, transport=transport)
    for layer in (ep1, pipe):
        layer.load_state_dict(state, strict=True)
    steps = 3 if recipe else 1
    one, got = layer_steps(ep1, cfg, x, dout, steps), layer_steps(pipe, cfg, x, dout, steps)
    _finite(got, "pipeline")
    bound = BF16_REL if recipe is None else FP8_REL
    assert max(_errors(got, want).values()) < bound
    if recipe != "tensorwise":
        assert rel(got[0], one[0]) < SAME_REL
    return pipe


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("recipe", [None, "tensorwise", "blockwise"])
def test_grouped_route_sync_free_pipeline(recipe, monkeypatch):
    """The overlap pipeline (loopback emulating EP=8's traffic) with --mok-sync-free: the loopback's one GPU
    computes every expert, so 64 experts (one TE call: the grouped route takes device counts, and the layer
    builds) against the EP=1 per-expert TE layer and the bf16 reference. 128 experts would need two TE calls
    and a host read, which the layer refuses under --mok-sync-free (``check_grouped_calls``)."""
    from mok_megatron.options import MoKOptions

    opts = MoKOptions(expert_backend="te", minibatch_size=384, sync_free=True)
    pipe = _sync_free_pipeline_case(64, recipe, opts, monkeypatch)
    assert pipe.token_dispatcher.pipelined and pipe.experts.route.grouped
    assert pipe.experts_contract.device_counts


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("recipe", [None, "blockwise"])
def test_grouped_experts_read_nothing_back(recipe, monkeypatch):
    """One TE call (8 experts): the experts' forward and backward on device counts never synchronise."""
    from mok_megatron.compat import quantization_context

    cfg = _config(8, recipe)
    _grouped_or_skip(cfg, recipe)
    experts = _build("mok", cfg, monkeypatch).experts
    experts.aligned_input = 1  # unpadded rows: the experts pad them (device plan)
    counts = torch.tensor([300, 0, 17, 129, 1, 64, 200, 313], device="cuda")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(int(counts.sum()), SHAPES[8]["hidden"], generator=g).to("cuda", torch.bfloat16)
    probs = torch.rand(x.shape[0], generator=g).to("cuda")

    def step():
        xi = x.detach().requires_grad_(True)
        with quantization_context(cfg):
            y, _ = experts(xi, counts, probs)
        y.float().square().sum().backward()
        return xi.grad

    assert torch.isfinite(step()).all()  # warm-up (kernels, TE's workspaces)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("recipe", [None, "tensorwise", "blockwise"])
def test_grouped_calls_with_an_empty_call(recipe, monkeypatch):
    """128 experts, every row on experts 0..63: the second TE call gets no rows; results finite, the
    empty call's experts' weight gradients zero, and the per-expert route's results."""
    from mok_megatron.compat import quantization_context

    cfg = _config(128, recipe)
    _grouped_or_skip(cfg, recipe)
    grouped = _build("mok", cfg, monkeypatch).experts
    per_expert = _build("mok", cfg, monkeypatch, per_expert=True).experts
    per_expert.load_state_dict(grouped.state_dict())
    grouped.aligned_input = per_expert.aligned_input = 1  # unpadded rows: the experts pad them
    counts = torch.zeros(128, dtype=torch.long)
    counts[:64] = torch.randint(0, 40, (64,), generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(int(counts.sum()), SHAPES[128]["hidden"], generator=g).to("cuda", torch.bfloat16)
    probs = torch.rand(x.shape[0], generator=g).to("cuda")

    def run(experts):
        experts.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        with quantization_context(cfg):
            y, _ = experts(xi, counts, probs)
        y.float().square().sum().backward()
        w = [getattr(experts.linear_fc1, f"weight{i}").grad for i in range(128)]
        return y.detach().float(), xi.grad.float(), w

    got, want = run(grouped), run(per_expert)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
    assert all(w is None or float(w.abs().max()) == 0 for w in got[2][64:])
    assert rel(got[0], want[0]) < SAME_REL and rel(got[1], want[1]) < SAME_REL


@pytest.mark.usefixtures("single_rank")
def test_grouped_route_sync_free_refuses_more_experts_than_one_call_with_that_reason(monkeypatch):
    """128 experts on one GPU with --mok-sync-free: two TE calls would read their row boundary on the host,
    so the layer refuses at build, naming the 64-expert call limit (not the per-expert route's reason)."""
    from mok_megatron.errors import MoKConfigError
    from mok_megatron.options import MoKOptions

    cfg = _config(128, None)
    _grouped_or_skip(cfg, None)
    with pytest.raises(MoKConfigError, match="at most 64 experts per call"):
        _build("mok", cfg, monkeypatch, options=MoKOptions(expert_backend="te", sync_free=True))


# ---- --mok-te-single-weight: one TE grouped weight per projection ---------------------------------


def _single(**options):
    """``MoKOptions`` of the te backend with --mok-te-single-weight (and ``options``)."""
    from mok_megatron.options import MoKOptions

    return MoKOptions(expert_backend="te", te_single_weight=True, **options)


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("experts", [8, 128])
@pytest.mark.parametrize("recipe", [None, "tensorwise", "blockwise"])
def test_single_weight_matches_per_expert_route_and_megatron(recipe, experts, monkeypatch):
    """One grouped weight per projection: one TE grouped GEMM call per projection and pass (forward,
    dgrad, wgrad: 6 per step at any expert count), results within SAME_REL of the per-expert route (the
    same per-expert quantization scales) and within the bf16 / FP8 bound of Megatron's bf16 layer."""
    import os

    from mok_megatron.compat import TE_SINGLE_PARAM_ENV
    from mok_megatron.experts.checkpoint import convert_state_dict

    cfg = _config(experts, recipe)
    _grouped_or_skip(cfg, recipe)
    ref_cfg = _config(experts, None)
    ref = _build("megatron", ref_cfg)
    state = convert_state_dict(ref.state_dict(), "mok")
    x, dout = _inputs(experts)
    want = layer_steps(ref, ref_cfg, x, dout, 1)
    per_expert = _build("mok", cfg, monkeypatch, per_expert=True)
    monkeypatch.delenv(TE_SINGLE_PARAM_ENV, raising=False)
    single = _build("mok", cfg, monkeypatch, options=_single())
    assert TE_SINGLE_PARAM_ENV not in os.environ  # TE's gate open only while the linears were built
    for layer in (per_expert, single):
        layer.load_state_dict(state, strict=True)
    fc1 = single.experts.linear_fc1
    assert fc1.single_grouped_weight and fc1.use_grouped_tensor and single.experts._views is None
    assert [n for n, _ in single.experts.named_parameters()] == ["linear_fc1.weight", "linear_fc2.weight"]
    torch.testing.assert_close(single.experts.stacked_fc1_weight, per_expert.experts.stacked_fc1_weight)
    steps = 3 if recipe else 1
    old = layer_steps(per_expert, cfg, x, dout, steps)
    counter = _GemmCounter(monkeypatch)
    new = layer_steps(single, cfg, x, dout, steps)
    assert counter.calls == {"grouped": 6 * steps, "per_expert": 0}, counter.calls
    _finite(new, "single weight")
    bound = BF16_REL if recipe is None else FP8_REL
    vs_ref, vs_old = _errors(new, want), _errors(new, old)
    assert max(vs_ref.values()) < bound, vs_ref
    assert max(vs_old.values()) < SAME_REL, vs_old


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("recipe", [None, "tensorwise", "blockwise"])
def test_single_weight_sync_free_pipeline_at_128_experts(recipe, monkeypatch):
    """--mok-sync-free with 128 local experts builds and runs with the single grouped weight (one TE call,
    device counts), against the EP=1 per-expert TE layer and the bf16 reference."""
    pipe = _sync_free_pipeline_case(128, recipe, _single(minibatch_size=384, sync_free=True), monkeypatch)
    assert pipe.token_dispatcher.pipelined and pipe.experts.route.grouped and pipe.experts._views is None
    assert pipe.experts_contract.device_counts and not pipe.experts_contract.host_counts


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("recipe", [None, "blockwise"])
def test_single_weight_experts_read_nothing_back_at_128_experts(recipe, monkeypatch):
    """128 experts, one TE call: the experts' forward and backward never synchronise."""
    from mok_megatron.compat import quantization_context

    cfg = _config(128, recipe)
    _grouped_or_skip(cfg, recipe)
    experts = _build("mok", cfg, monkeypatch, options=_single()).experts
    experts.aligned_input = 1
    counts = torch.randint(0, 40, (128,), generator=torch.Generator().manual_seed(3)).cuda()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(int(counts.sum()), SHAPES[128]["hidden"], generator=g).to("cuda", torch.bfloat16)
    probs = torch.rand(x.shape[0], generator=g).to("cuda")

    def step():
        xi = x.detach().requires_grad_(True)
        with quantization_context(cfg):
            y, _ = experts(xi, counts, probs)
        y.float().square().sum().backward()
        return xi.grad

    assert torch.isfinite(step()).all()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("experts", [8, 128])
def test_single_weight_checkpoints_move_between_layouts(experts, monkeypatch, tmp_path):
    """The single-weight layer's plain state dict and dist-checkpoint ShardedTensors have exactly the
    per-expert layer's keys and shapes; each layout's checkpoint (plain and dist_checkpointing) loads into
    the other bitwise."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from mok_megatron.experts.te import expert_weights

    cfg = _config(experts, "blockwise")
    _grouped_or_skip(cfg, "blockwise")

    def build(single):
        if single:
            return _build("mok", cfg, monkeypatch, options=_single())
        return _build("mok", cfg, monkeypatch)

    def perturbed(single):
        layer = build(single)
        with torch.no_grad():
            for linear in (layer.experts.linear_fc1, layer.experts.linear_fc2):
                for w in expert_weights(linear, experts):
                    w.add_(torch.randn_like(w) * 0.01)
        return layer

    def weights(layer):
        return layer.experts.stacked_fc1_weight, layer.experts.stacked_fc2_weight

    on, off = build(True), build(False)
    sd_on, sd_off = on.state_dict(), off.state_dict()
    assert {k: tuple(v.shape) for k, v in sd_on.items() if torch.is_tensor(v)} == {
        k: tuple(v.shape) for k, v in sd_off.items() if torch.is_tensor(v)
    }
    sh_on, sh_off = on.sharded_state_dict(prefix="m."), off.sharded_state_dict(prefix="m.")
    assert set(sh_on) == set(sh_off)
    for k, v in sh_off.items():
        if hasattr(v, "global_shape"):
            assert (sh_on[k].key, sh_on[k].global_shape, sh_on[k].global_offset) == (
                v.key,
                v.global_shape,
                v.global_offset,
            ), k
    for src, dst in ((True, False), (False, True)):
        a = perturbed(src)
        b = build(dst)
        b.load_state_dict(a.state_dict(), strict=True)  # plain
        for want, got in zip(weights(a), weights(b), strict=True):
            assert torch.equal(want, got), ("plain", src, dst)
        path = tmp_path / f"{src}-to-{dst}"
        path.mkdir()
        dist_checkpointing.save(a.sharded_state_dict(prefix="m."), str(path))
        dist.barrier()
        c = build(dst)
        state = dist_checkpointing.load(c.sharded_state_dict(prefix="m."), str(path))
        c.load_state_dict({k[2:]: v for k, v in state.items()}, strict=True)
        for want, got in zip(weights(a), weights(c), strict=True):
            assert torch.equal(want, got), ("dist", src, dst)
