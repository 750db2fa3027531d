"""FP8 expert backends on a GPU (skipped without CUDA; TE cases without Transformer Engine; each recipe
where the GPU cannot run it, with the reason): the MoK layer with ``--mok-expert-backend torch-fp8 | te``
against the same layer in bf16 (same weights, same input), and TE-backend checkpoints against Megatron's
TEGroupedMLP.

Bounds: relative Frobenius error ||fp8 - bf16|| / ||bf16|| of output, input gradient and each expert
weight gradient < ``FP8_REL`` = 0.1 (e4m3 rounding is <= 2^-4 relative per operand, ~0.036 RMS; two
chained GEMMs and the activation give ~0.05-0.07); TE in bf16 < ``BF16_REL`` = 3e-2 (as tests/test_gpu.py).
Each FP8 layer runs 2 warm-up steps first (delayed scaling needs an amax history).
"""

from __future__ import annotations

import pytest
import torch

from mok_megatron.compat import have_te
from mok_megatron.engine.plan import RowLayout
from tests.cases import with_engine
from tests.harness.gpu import layer_steps, rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FP8_REL = 0.1
BF16_REL = 3e-2
# An FP8 output differs from bf16 by ~0.05; two bf16 layers by ~1e-3 (bf16 rounds at 2^-9 relative)
FP8_RAN = 5e-3
SHAPE = dict(hidden=512, ffn=256, experts=8, topk=2, tokens=1024)


def layer_config(recipe: str | None):
    from mok_megatron.bench.build import layer_config
    from mok_megatron.bench.fp8_layers import fp8_config

    return fp8_config(layer_config(SHAPE, torch.bfloat16), recipe)


def _build(backend: str, cfg, impl: str = "mok"):
    from mok_megatron.bench.build import build
    from mok_megatron.bench.fp8_layers import build_mok_layer

    torch.manual_seed(0)
    return (build_mok_layer(backend, cfg) if impl == "mok" else build(impl, cfg)).cuda()


def _compare(backend: str, recipe: str | None, bound: float):
    from mok_megatron.experts.checkpoint import convert_state_dict

    g = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE["tokens"], 1, SHAPE["hidden"], generator=g).to("cuda", torch.bfloat16)
    dout = torch.randn(SHAPE["tokens"], 1, SHAPE["hidden"], generator=g).to("cuda", torch.bfloat16)
    ref = _build("torch", layer_config(None))
    state = ref.state_dict()
    want = layer_steps(ref, layer_config(None), x, dout, 1)
    cfg = layer_config(recipe)
    layer = _build(backend, cfg)
    layer.load_state_dict(convert_state_dict(state, "mok"), strict=True)
    got = layer_steps(layer, cfg, x, dout, 3 if (recipe or backend == "torch-fp8") else 1)
    errs = {"out": rel(got[0], want[0]), "dx": rel(got[1], want[1])}
    errs.update({k: rel(got[2][k], want[2][k]) for k in want[2]})
    assert set(got[2]) == set(want[2])
    assert max(errs.values()) < bound, errs
    if recipe is not None or backend == "torch-fp8":  # FP8 really ran: more than bf16's own rounding
        assert errs["out"] > FP8_RAN, (
            f"output within bf16 rounding of the bf16 layer; FP8 did not run: {errs}"
        )


@pytest.mark.usefixtures("single_rank")
def test_torch_fp8_backend_layer_vs_bf16():
    from mok_megatron.bench.fp8_layers import unavailable

    why = unavailable("torch-fp8", None)
    if why:
        pytest.skip(why)
    _compare("torch-fp8", None, FP8_REL)


def _recipe_skip(recipe):
    from mok_megatron.bench.fp8_layers import unavailable

    return unavailable("te", recipe)


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("recipe", [None, "tensorwise", "blockwise", "delayed", "mxfp8", "nvfp4"])
def test_te_backend_layer_vs_bf16(recipe):
    why = _recipe_skip(recipe)
    if why:
        pytest.skip(f"{recipe}: {why}")
    _compare("te", recipe, BF16_REL if recipe is None else FP8_REL)


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_te_backend_takes_the_aligned_plan_at_ep1(recipe):
    """At EP=1 the dispatcher pads to the recipe's alignment in its permute (exact rows where TE reads the
    counts on the host anyway) and TE's GEMMs run on that buffer; _compare checks the numbers."""
    why = _recipe_skip(recipe)
    if why:
        pytest.skip(f"{recipe}: {why}")
    layer = _build("te", layer_config(recipe))
    align = layer.experts.expert_alignment
    engine = layer.token_dispatcher.engine
    assert align > 1 and engine.row_alignment == align == layer.experts.aligned_input
    # TE's grouped route takes device counts (static buffer); its per-expert route reads them (exact rows)
    grouped = layer.experts.route.grouped
    assert engine.rows is (RowLayout.ALIGNED if grouped else RowLayout.ALIGNED_EXACT)


@pytest.mark.usefixtures("single_rank")
@pytest.mark.skipif(not have_te(), reason="needs Transformer Engine")
def test_te_backend_keys_and_dist_checkpoint_match_te_grouped_mlp(tmp_path):
    """The TE backend's state_dict / sharded_state_dict keys are TEGroupedMLP's; dist checkpoints move
    between the two bitwise (and from the bf16 MoK layer)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from mok_megatron.experts.checkpoint import convert_state_dict
    from mok_megatron.experts.te import MoKTEGroupedMLP

    cfg = layer_config(None)
    te_layer = _build("te", cfg)
    assert isinstance(te_layer.experts, MoKTEGroupedMLP)
    meg = _build("torch", cfg, impl="megatron-te")
    assert set(te_layer.experts.state_dict()) == set(meg.experts.state_dict())

    def expert_keys(layer):
        return {k for k in layer.sharded_state_dict(prefix="m.") if "experts" in k}

    assert expert_keys(te_layer) == expert_keys(meg)

    def experts(layer):
        sd = {
            k: v for k, v in layer.state_dict().items() if torch.is_tensor(v) and v.numel() and "experts" in k
        }
        return convert_state_dict(sd, "mok")

    builders = {
        "megatron-te": lambda: _build("torch", cfg, impl="megatron-te"),
        "mok-te": lambda: _build("te", cfg),
        "mok": lambda: _build("torch", cfg),
    }
    for src, dst in (("megatron-te", "mok-te"), ("mok-te", "megatron-te"), ("mok", "mok-te")):
        torch.manual_seed(1)
        a = builders[src]()
        with torch.no_grad():
            for p in a.parameters():
                p.add_(torch.randn_like(p) * 0.01)  # differ from a fresh build's init
        path = tmp_path / f"{src}-to-{dst}"
        path.mkdir()
        dist_checkpointing.save(a.sharded_state_dict(prefix="m."), str(path))
        dist.barrier()
        b = builders[dst]()
        state = dist_checkpointing.load(b.sharded_state_dict(prefix="m."), str(path))
        b.load_state_dict({k[2:]: v for k, v in state.items()}, strict=True)
        want, got = experts(a), experts(b)
        for k in ("experts.fc1_weight", "experts.fc2_weight"):
            assert torch.equal(want[k], got[k]), (src, dst, k)


# ---- native FP8: quantization kernels and the weight cache -------------------------------------------------------


def _quant_cases():
    from tests.test_fp8_quant_kernels import CASES, GPU_CASES

    return CASES | GPU_CASES


@pytest.mark.parametrize("case", list(_quant_cases()))
def test_fp8_quant_kernel_bitwise_on_gpu(case):
    """kernels.fp8_quant on CUDA (IEEE division, hardware e4m3 cast) bitwise equal to the torch references."""
    _quant_cases()[case](device="cuda")


SAME = 1e-3


def _native_or_skip():
    from mok_megatron.ops.fp8_grouped_gemm import unavailable_reason

    why = unavailable_reason("cuda")
    if why:
        pytest.skip(why)


def _linear_inputs(counts=(48, 0, 112, 96), k=256, n=384):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), k, generator=g).to("cuda", torch.bfloat16)
    w = torch.nn.Parameter((torch.randn(len(counts), n, k, generator=g) / 16).to("cuda", torch.bfloat16))
    dy = torch.randn(sum(counts), n, generator=g).to("cuda", torch.bfloat16)
    offs = torch.tensor(counts).cumsum(0).to("cuda", torch.int32)
    return x, w, dy, offs


def _fwd_bwd(x, w, dy, offs, cache=None):
    from mok_megatron.ops.fp8_grouped_gemm import fp8_grouped_linear

    w.grad = None
    xi = x.detach().requires_grad_(True)
    y = fp8_grouped_linear(xi, w, offs, cache)
    y.backward(dy)
    return y.detach(), xi.grad, w.grad


def test_native_fp8_weight_cache_follows_weight_updates():
    """Cached quantized weights give the uncached results, and an in-place update (optimizer-style) or a
    .data write followed by an optimizer step is seen by the next call. (Same results: relative difference
    < ``SAME`` -- exact unless the GEMM is run-to-run nondeterministic; a stale weight is off by O(1).)"""
    from mok_megatron.ops import fp8_grouped_gemm as native

    _native_or_skip()
    cache = native.FP8WeightCache()
    x, w, dy, offs = _linear_inputs()
    first = _fwd_bwd(x, w, dy, offs, cache)
    again = _fwd_bwd(x, w, dy, offs, cache)  # cache hit
    assert all(rel(a.float(), b.float()) < SAME for a, b in zip(first, again, strict=True))
    with torch.no_grad():
        w.mul_(-0.5)
    updated = _fwd_bwd(x, w, dy, offs, cache)
    cache.invalidate()
    fresh = _fwd_bwd(x, w, dy, offs, cache)
    assert all(rel(a.float(), b.float()) < SAME for a, b in zip(updated, fresh, strict=True))
    assert not torch.equal(updated[0], first[0])
    version = w._version
    w.data.copy_(w.detach() * 3)  # invisible to _version ...
    other = torch.nn.Parameter(torch.zeros(1, device="cuda"))
    other.grad = torch.zeros_like(other)
    torch.optim.SGD([other], lr=0.1).step()  # ... but every optimizer step drops the cache
    assert w._version == version
    stepped = _fwd_bwd(x, w, dy, offs, cache)
    cache.invalidate()
    fresh = _fwd_bwd(x, w, dy, offs, cache)
    assert all(rel(a.float(), b.float()) < SAME for a, b in zip(stepped, fresh, strict=True))
    # FP8 close to bf16 (bound as the layer test)
    ref = torch.cat(
        [
            x[s:e].float() @ w[i].detach().float().t()
            for i, (s, e) in enumerate(((0, 48), (48, 48), (48, 160), (160, 256)))
        ]
    )
    assert rel(stepped[0].float(), ref) < FP8_REL


def test_fp8_wgrad_scales_from_rowwise_partials_change_nothing(monkeypatch):
    """With an FP8 weight gradient (>= WGRAD_FP8_MIN_ROWS rows per expert) the rowwise passes over x and
    dy keep 16-row block amaxes and the wgrad quantization takes its scales from them: output and
    gradients those of the separate amax pass (same operands bitwise: GPU_CASES "partials_*"; here within
    ``SAME``, the GEMMs' run-to-run bound)."""
    from mok_megatron.ops import fp8_grouped_gemm as native

    _native_or_skip()
    rows = native.WGRAD_FP8_MIN_ROWS
    x, w, dy, offs = _linear_inputs(counts=(2 * rows, rows - 16, 0, rows + 16), k=512, n=256)
    calls = []
    real = native.quantize_rowwise_partials
    monkeypatch.setattr(native, "quantize_rowwise_partials", lambda t: calls.append(1) or real(t))
    fused = _fwd_bwd(x, w, dy, offs)
    assert len(calls) == 2, "x (forward) and dy (backward) must take the one-pass partials"
    monkeypatch.setattr(native, "quantize_rowwise_partials", lambda t: (*native.quantize_rowwise(t), None))
    plain = _fwd_bwd(x, w, dy, offs)
    assert all(rel(a.float(), b.float()) < SAME for a, b in zip(fused, plain, strict=True))


def test_native_fp8_linear_needs_no_host_sync():
    from mok_megatron.ops import fp8_grouped_gemm as native

    _native_or_skip()
    cache = native.FP8WeightCache()
    x, w, dy, offs = _linear_inputs()
    _fwd_bwd(x, w, dy, offs, cache)  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _fwd_bwd(x, w, dy, offs, cache)
        cache.invalidate()
        _fwd_bwd(x, w, dy, offs, cache)  # with weight quantization
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_native_mlp_quantized_into_padding_matches_pad_path_on_gpu():
    """The native MLP (fc1 input and fc2 output gradient quantized straight into the padded layout) gives
    the pad -> fp8_grouped_linear x2 -> unpad composition's output and gradients (same FP8 operands)."""
    from mok_megatron.ops import fp8_grouped_gemm as native
    from mok_megatron.experts import common, fp8_mlp as pe
    from mok_megatron.ops.activation import Activation, ActivationSpec

    _native_or_skip()
    counts = torch.tensor([37, 0, 130, 5, 64, 1], device="cuda")
    g = torch.Generator().manual_seed(4)
    R, H, F, L = int(counts.sum()), 256, 128, counts.numel()
    leaves0 = [
        torch.randn(R, H, generator=g).to("cuda", torch.bfloat16),
        torch.rand(R, generator=g).to("cuda"),
        (torch.randn(L, 2 * F, H, generator=g) / 16).to("cuda", torch.bfloat16),
        (torch.randn(L, H, F, generator=g) / 16).to("cuda", torch.bfloat16),
    ]
    dy = torch.randn(R, H, generator=g).to("cuda", torch.bfloat16)
    act = ActivationSpec(kind=Activation.SILU, gated=True)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in leaves0]
        y = fn(*leaves)
        y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves]

    def old(x, p, w1, w2):
        def fc(w):
            return lambda x_PK, plan: native.fp8_grouped_linear(x_PK, w, pe.native_offsets(plan))

        P = pe.native_num_rows(R, L, native.ALIGNMENT)
        return common.padded_expert_mlp(x, p, counts, fc(w1), fc(w2), act, native.ALIGNMENT, num_rows=P)

    want = run(old)
    got = run(lambda x, p, w1, w2: pe.native_expert_mlp(x, p, counts, w1, w2, act))
    errs = {
        n: rel(a.float(), b.float())
        for n, a, b in zip(("y", "dx", "dp", "dw1", "dw2"), got, want, strict=True)
    }
    assert max(errs.values()) < SAME, errs


@pytest.mark.usefixtures("single_rank")
def test_torch_fp8_layer_runs_on_the_aligned_plan_and_matches_the_pad_path():
    """At EP=1 the torch-fp8 layer's permute writes the padded layout (no pad/unpad copies); the
    result equals the padding experts' path (the same rows quantized the same way) closely."""
    from mok_megatron.experts.checkpoint import convert_state_dict

    _native_or_skip()
    cfg = layer_config(None)
    aligned = _build("torch-fp8", cfg)
    assert aligned.token_dispatcher.engine.row_alignment == 16 and aligned.experts.aligned_input == 16
    padding = _build("torch-fp8", cfg)
    padding.load_state_dict(convert_state_dict(aligned.state_dict(), "mok"), strict=True)
    # the sort-based plan; the experts pad
    with_engine(padding, rows=RowLayout.SORTED, row_alignment=1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SHAPE["tokens"], 1, SHAPE["hidden"], generator=g).to("cuda", torch.bfloat16)
    dout = torch.randn(SHAPE["tokens"], 1, SHAPE["hidden"], generator=g).to("cuda", torch.bfloat16)
    got, want = layer_steps(aligned, cfg, x, dout, 2), layer_steps(padding, cfg, x, dout, 2)
    errs = {"out": rel(got[0], want[0]), "dx": rel(got[1], want[1])}
    errs.update({k: rel(got[2][k], want[2][k]) for k in want[2]})
    assert max(errs.values()) < 1e-2, errs


@pytest.mark.usefixtures("single_rank")
def test_torch_fp8_layer_fused_permute_equals_unfused_bitwise():
    """At EP=1 the torch-fp8 layer hands token rows to the experts (``experts.fp8_mlp``: each token
    quantized once into fc1's operand, the output gradient into fc2's, the weight gradients' operands read
    through the token map): output and every gradient equal the unfused aligned path's bitwise."""
    from mok_megatron.experts.checkpoint import convert_state_dict

    _native_or_skip()
    cfg = layer_config(None)
    fused = _build("torch-fp8", cfg)
    assert fused.token_dispatcher.engine.rows is RowLayout.FUSED
    unfused = _build("torch-fp8", cfg)
    unfused.load_state_dict(convert_state_dict(fused.state_dict(), "mok"), strict=True)
    with_engine(unfused, rows=RowLayout.ALIGNED)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SHAPE["tokens"], 1, SHAPE["hidden"], generator=g).to("cuda", torch.bfloat16)
    dout = torch.randn(SHAPE["tokens"], 1, SHAPE["hidden"], generator=g).to("cuda", torch.bfloat16)
    got, want = layer_steps(fused, cfg, x, dout, 2), layer_steps(unfused, cfg, x, dout, 2)
    diffs = {"out": (got[0] - want[0]).abs().max().item(), "dx": (got[1] - want[1]).abs().max().item()}
    diffs.update({k: (got[2][k] - want[2][k]).abs().max().item() for k in want[2]})
    assert set(got[2]) == set(want[2]) and max(diffs.values()) == 0, diffs


@pytest.mark.parametrize("wgrad", ["fp8", "bf16"])
def test_fp8_token_mlp_needs_no_host_sync(wgrad, monkeypatch):
    """The fused FP8 experts (permute, GEMMs, combine, both weight-gradient policies) read nothing back."""
    from mok_megatron.ops import fp8_grouped_gemm as native
    from mok_megatron.experts.fp8_mlp import fp8_token_mlp
    from mok_megatron.engine.plan import static_aligned_rows
    from mok_megatron.kernels.routing import routing_metadata
    from mok_megatron.ops.activation import Activation, ActivationSpec

    _native_or_skip()
    monkeypatch.setattr(native, "WGRAD_FP8_MIN_ROWS", 1 if wgrad == "fp8" else 10**9)
    T, K, E, H, F = 256, 4, 8, 256, 128
    g = torch.Generator().manual_seed(2)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to("cuda")
    meta, counts = static_aligned_rows(routing_metadata(ids, E, native.ALIGNMENT), T * K)
    x = torch.randn(T, H, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    p = torch.rand(T, K, generator=g).to("cuda").requires_grad_()
    w1 = (torch.randn(E, 2 * F, H, generator=g) / 16).to("cuda", torch.bfloat16).requires_grad_()
    w2 = (torch.randn(E, H, F, generator=g) / 16).to("cuda", torch.bfloat16).requires_grad_()
    act = ActivationSpec(kind=Activation.SILU, gated=True)

    def step():
        fp8_token_mlp(x, p, meta, counts, w1, w2, act).float().square().sum().backward()

    step()  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(bool(t.grad.abs().sum() > 0) for t in (x, p, w1, w2))


@pytest.mark.usefixtures("single_rank")
@pytest.mark.parametrize("sync_free", [False, True])
def test_torch_fp8_pipeline_expert_calls_take_padded_rows(sync_free):
    """The overlap pipeline (loopback, emulated EP=8) with torch-fp8 experts: every expert call gets its
    rows padded by the permute; the output matches the EP=1 torch-fp8 layer row for row (same rowwise
    quantization), the gradients the bf16 layer within the FP8 bound."""
    from mok_megatron.bench.build import build
    from mok_megatron.experts.checkpoint import convert_state_dict
    from mok_megatron.options import MoKOptions
    from mok_megatron.transport.loopback import LoopbackLink, LoopbackTransport

    _native_or_skip()
    cfg = layer_config(None)
    ref = _build("torch", cfg)
    ep1 = _build("torch-fp8", cfg)
    link = LoopbackLink(ep=8, gbps=450.0 if sync_free else 0.0)
    opts = MoKOptions(expert_backend="torch-fp8", minibatch_size=384, sync_free=sync_free)
    transport = LoopbackTransport(link, cfg.num_moe_experts, cfg.moe_router_topk)
    pipe = build("mok", cfg, options=opts, transport=transport).cuda()
    state = ref.state_dict()
    for layer in (ep1, pipe):
        layer.load_state_dict(convert_state_dict(state, "mok"), strict=True)
    assert pipe.token_dispatcher.pipelined and pipe.token_dispatcher.engine.row_alignment == 16
    assert pipe.experts.aligned_input == 16
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SHAPE["tokens"], 1, SHAPE["hidden"], generator=g).to("cuda", torch.bfloat16)
    dout = torch.randn(SHAPE["tokens"], 1, SHAPE["hidden"], generator=g).to("cuda", torch.bfloat16)
    want, one, got = (layer_steps(m, cfg, x, dout, 1) for m in (ref, ep1, pipe))
    assert rel(got[0], one[0]) < 2e-2, rel(got[0], one[0])
    errs = {"out": rel(got[0], want[0]), "dx": rel(got[1], want[1])}
    errs.update({k: rel(got[2][k], want[2][k]) for k in want[2]})
    assert max(errs.values()) < FP8_REL and errs["out"] > FP8_RAN, errs
