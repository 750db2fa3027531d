"""Gradient accumulation fusion for the ``torch`` experts: ``ops.wgrad_accumulate`` (``out += dy^T x`` per
expert, QuACK on Hopper, torch elsewhere) and Megatron's ``main_grad`` / dummy-gradient contract
(``experts.main_grad``) through ``MoKGroupedMLP`` under Megatron's own DDP wrapper.

Legend: M rows, N output features, K input features, G local experts, H hidden, L local experts.

CPU: the op against the per-expert loop (fp32 and bf16 operands, empty experts, accumulation onto existing
values, the per-expert fallback); the experts with fusion on and off under Megatron's
``DistributedDataParallel`` (fp32 ``main_grad``): ``main_grad`` bitwise equal with fp32 parameters and
within bf16 rounding with bf16 ones, ``grad_added_to_main_grad`` set, ``param.grad`` dropped by DDP's
hook, two backward passes accumulating, several expert calls in one backward accumulating through the op
with one dummy, and the delayed-wgrad queue, activation recompute and late-wgrad gate paths; a negative
control (the op skipped) that the comparison catches. GPU (skipped without CUDA sm90+ and QuACK): the
QuACK path against the portable path.
"""

from __future__ import annotations

import pytest
import torch

from mok_megatron.compat import have_quack
from mok_megatron.experts import torch_mlp
from mok_megatron.ops.wgrad_accumulate import grouped_wgrad_accumulate_

COUNTS = [5, 0, 9, 0, 2, 16]


def _offs(counts, device="cpu"):
    return torch.cumsum(torch.tensor(counts, device=device), 0, dtype=torch.int32)


def _reference(out, dy, x, counts):
    """``out[g] + dy_g^T x_g`` per expert in fp64 (the exact sums the op must approach)."""
    want = out.double().clone()
    start = 0
    for g, c in enumerate(counts):
        want[g] += dy[start : start + c].double().t() @ x[start : start + c].double()
        start += c
    return want


def _operands(counts, n, k, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    m = sum(counts)
    dy = torch.randn(m, n, generator=g).to(device=device, dtype=dtype)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    out = torch.randn(len(counts), n, k, generator=g).to(device)
    return out, dy, x


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n,k", [(16, 8), (6, 3)])  # 3 and 6: rows not 16-byte aligned -> per-expert loop
def test_op_matches_per_expert_reference_and_accumulates(dtype, tol, n, k):
    out, dy, x = _operands(COUNTS, n, k, dtype)
    before = out.clone()
    grouped_wgrad_accumulate_(out, dy, x, _offs(COUNTS))
    want = _reference(before, dy, x, COUNTS)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    for g, c in enumerate(COUNTS):  # empty experts: bitwise untouched
        if c == 0:
            assert torch.equal(out[g], before[g])
    # a second call adds onto the first: no overwrite
    grouped_wgrad_accumulate_(out, dy, x, _offs(COUNTS))
    torch.testing.assert_close(out.double(), _reference(want, dy, x, COUNTS), rtol=tol, atol=2 * tol)


def test_op_fp32_portable_is_the_grouped_gemm_added():
    out, dy, x = _operands(COUNTS, 16, 8, torch.float32)
    want = out + torch_mlp.gg._wgrad(dy, x, _offs(COUNTS))
    grouped_wgrad_accumulate_(out, dy, x, _offs(COUNTS), use_quack=False)
    assert torch.equal(out, want)


def test_op_without_rows_changes_nothing():
    out, dy, x = _operands([0, 0, 0], 16, 8, torch.bfloat16)
    before = out.clone()
    grouped_wgrad_accumulate_(out, dy, x, _offs([0, 0, 0]))
    assert torch.equal(out, before)


def test_op_rejects_bad_inputs():
    out, dy, x = _operands(COUNTS, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="share a dtype"):
        grouped_wgrad_accumulate_(out, dy.bfloat16(), x, _offs(COUNTS))
    with pytest.raises(ValueError, match="needs dy"):
        grouped_wgrad_accumulate_(out[:, :8], dy, x, _offs(COUNTS))
    with pytest.raises(ValueError, match="offs"):
        grouped_wgrad_accumulate_(out, dy, x, _offs(COUNTS[:-1]))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use_quack=True"):
            grouped_wgrad_accumulate_(out, dy, x, _offs(COUNTS), use_quack=True)


# ---- the experts under Megatron's DDP -------------------------------------------------------------


def _ddp_experts(
    fusion: bool, dtype, *, delay=False, recompute=False, seed=0, options=None, ffn=8, overlap=False
):
    """MoK's experts (4 local experts; the torch backend unless ``options`` name another) wrapped in
    Megatron's DistributedDataParallel with fp32 main_grad buffers; the same weights for every ``seed``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from mok_megatron.experts.grouped_mlp import MoKGroupedMLP
    from mok_megatron.experts.protocol import experts_class
    from mok_megatron.options import MoKOptions
    from tests.cases import make_config, setup_parallel

    setup_parallel(seed=1234 + seed)  # reseeds Megatron's expert-parallel RNG stream: the same weights
    cfg = make_config(num_experts=4, hidden=16, ffn=ffn, params_dtype=dtype)
    # set after Megatron's validation, which ties delay_wgrad_compute to its GPU-only EP overlap
    cfg.delay_wgrad_compute = delay
    if recompute:
        cfg.recompute_granularity, cfg.recompute_modules = "selective", ["moe_act"]
    cfg.gradient_accumulation_fusion = fusion
    experts = experts_class(MoKGroupedMLP, options or MoKOptions())(4, cfg, options=options)
    assert experts.gradient_accumulation_fusion is fusion
    ddp = DistributedDataParallel(
        cfg,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, delay_wgrad_compute=delay, overlap_grad_reduce=overlap
        ),
        experts,
    )
    return ddp, experts


def _inputs(counts, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    m = sum(counts)
    x = torch.randn(m, 16, generator=g).to(dtype).requires_grad_(True)
    probs = torch.rand(m, generator=g)
    dy = torch.randn(m, 16, generator=g).to(dtype)
    return x, torch.tensor(counts), probs, dy


def _step(ddp, experts, counts_list, dtype, seed, calls_per_backward=1):
    """One backward over ``calls_per_backward`` expert calls per entry of ``counts_list``; returns the
    input gradients."""
    dxs = []
    for i, counts in enumerate(counts_list):
        loss = 0
        xs = []
        for c in range(calls_per_backward):
            x, tpe, probs, dy = _inputs(counts, dtype, seed + 100 * i + c)
            out, _ = ddp(x, tpe, probs)
            loss = loss + (out.float() * dy.float()).sum()
            xs.append(x)
        loss.backward()
        if experts.wgrad_queue is not None:
            experts.backward_dw()
        dxs += [x.grad for x in xs]
    return dxs


def _main_grads(experts):
    return [p.main_grad.clone() for p in (experts.fc1_weight, experts.fc2_weight)]


STEPS = [[7, 0, 3, 6], [2, 9, 0, 5]]  # two backward passes (microbatches), empty experts in each


@pytest.mark.parametrize("path", ["plain", "delay", "recompute", "delay+recompute"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_main_grad_matches_unfused(single_rank, path, dtype):
    delay, recompute = "delay" in path, "recompute" in path
    results = {}
    for fusion in (False, True):
        ddp, experts = _ddp_experts(fusion, dtype, delay=delay, recompute=recompute)
        dxs = _step(ddp, experts, STEPS, dtype, seed=1)
        results[fusion] = (_main_grads(experts), dxs, experts)
        for p in (experts.fc1_weight, experts.fc2_weight):
            assert p.grad is None  # DDP's hook dropped the dummy (or the real gradient)
            assert p.grad_added_to_main_grad is fusion
    (g_off, dx_off, _), (g_on, dx_on, _) = results[False], results[True]
    for a, b in zip(dx_off, dx_on, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(g_off, g_on, strict=True):
        assert a.dtype == b.dtype == torch.float32 and a.abs().sum() > 0
        if dtype == torch.float32:
            assert torch.equal(a, b)  # (0 + dW1) + dW2 both ways
        else:  # bf16: the same bf16 products; the unfused path adds them after the same rounding
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


def test_one_backward_over_several_expert_calls_accumulates_without_sums(single_rank, monkeypatch):
    """The overlap pipeline's shape: several expert calls, one backward. Every call's weight gradient goes
    through the op into main_grad; autograd gets one dummy per weight (no sum), DDP's hook adds nothing."""
    calls = []
    real = torch_mlp.grouped_wgrad_accumulate_
    monkeypatch.setattr(torch_mlp, "grouped_wgrad_accumulate_", lambda *a: calls.append(1) or real(*a))
    ref_ddp, ref = _ddp_experts(False, torch.float32)
    _step(ref_ddp, ref, [[3, 4, 0, 5]], torch.float32, seed=2, calls_per_backward=3)
    ddp, experts = _ddp_experts(True, torch.float32)
    returned = []
    real_result = torch_mlp.fused_wgrad_result
    monkeypatch.setattr(
        torch_mlp, "fused_wgrad_result", lambda p: returned.append(real_result(p)) or returned[-1]
    )
    _step(ddp, experts, [[3, 4, 0, 5]], torch.float32, seed=2, calls_per_backward=3)
    assert len(calls) == 6  # fc1 and fc2 of three calls
    # one dummy per weight reaches autograd, the other calls return None: no sum of dummies
    assert len(returned) == 6 and sum(r is not None for r in returned) == 2
    for a, b in zip(_main_grads(ref), _main_grads(experts), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", ["plain", "delay"])
def test_overlap_grad_reduce_hook_sees_a_gradient(single_rank, path):
    """Under ``overlap_grad_reduce`` DDP's hook asserts ``param.grad is not None``: the dummy satisfies it
    (autograd's backward, and ``backward_dw`` for delayed weight gradients)."""
    delay = path == "delay"
    ref_ddp, ref = _ddp_experts(False, torch.float32, delay=delay, overlap=True)
    _step(ref_ddp, ref, STEPS[:1], torch.float32, seed=5)
    ref_ddp.finish_grad_sync()
    ddp, experts = _ddp_experts(True, torch.float32, delay=delay, overlap=True)
    _step(ddp, experts, STEPS[:1], torch.float32, seed=5)
    ddp.finish_grad_sync()
    for a, b in zip(_main_grads(ref), _main_grads(experts), strict=True):
        assert b.abs().sum() > 0 and torch.equal(a, b)


def test_negative_control_skipped_accumulation_is_caught(single_rank, monkeypatch):
    """With the op skipped, fusion leaves main_grad at zero: the comparison above must fail."""
    ref_ddp, ref = _ddp_experts(False, torch.float32)
    _step(ref_ddp, ref, STEPS, torch.float32, seed=1)
    monkeypatch.setattr(torch_mlp, "grouped_wgrad_accumulate_", lambda *a: None)
    ddp, experts = _ddp_experts(True, torch.float32)
    _step(ddp, experts, STEPS, torch.float32, seed=1)
    for a, b in zip(_main_grads(ref), _main_grads(experts), strict=True):
        assert not torch.equal(a, b) and b.abs().sum() == 0


def test_fusion_off_keeps_autograd_path(single_rank, monkeypatch):
    """Without fusion (or without main_grad) the experts never call the op and return real gradients."""
    monkeypatch.setattr(torch_mlp, "grouped_wgrad_accumulate_", lambda *a: pytest.fail("op called"))
    ddp, experts = _ddp_experts(False, torch.float32)
    _step(ddp, experts, STEPS[:1], torch.float32, seed=1)
    from mok_megatron.experts.grouped_mlp import MoKGroupedMLP
    from tests.cases import make_config

    cfg = make_config(num_experts=4, hidden=16, ffn=8)
    cfg.gradient_accumulation_fusion = True
    plain = MoKGroupedMLP(4, cfg)  # fusion on, no DDP: no main_grad, ordinary .grad
    x, tpe, probs, dy = _inputs(STEPS[0], torch.float32, 1)
    (plain(x, tpe, probs)[0] * dy).sum().backward()
    assert plain.fc1_weight.grad is not None and plain.fc1_weight.grad.abs().sum() > 0


def test_zero_out_wgrad_dummy_is_zeros(single_rank):
    """Megatron's ``zero_out_wgrad``: the dummy is zeros and DDP's hook adds it (a no-op on the value)."""
    ddp, experts = _ddp_experts(True, torch.float32)
    ref_ddp, ref = _ddp_experts(False, torch.float32)
    seen = []
    for p in (experts.fc1_weight, experts.fc2_weight):
        p.zero_out_wgrad = True
        p.register_hook(lambda g: seen.append(g.clone()) or g)
    _step(ddp, experts, STEPS, torch.float32, seed=1)
    _step(ref_ddp, ref, STEPS, torch.float32, seed=1)
    assert seen and all(torch.equal(g, torch.zeros_like(g)) for g in seen)
    for a, b in zip(_main_grads(ref), _main_grads(experts), strict=True):
        assert torch.equal(a, b)


def test_late_wgrad_gate_accumulates_into_the_real_parameters(single_rank):
    """The pipeline's late-wgrad gate: the GEMMs use stand-in views; the queued tasks add into the real
    Parameters' main_grad and the gate returns one dummy per weight."""
    results = []
    for fusion in (False, True):
        ddp, experts = _ddp_experts(fusion, torch.bfloat16)
        for counts in STEPS:
            late = experts.late_wgrad()
            assert late is not None
            late.open()
            loss = 0
            for c in range(2):  # two expert calls (minibatches) through the same gate
                x, tpe, probs, dy = _inputs(counts, torch.bfloat16, 7 + c)
                out, _ = experts(x, tpe, probs, late=late)
                loss = loss + (out.float() * dy.float()).sum()
            assert len(late.queue) == 0
            loss.backward()
            assert len(late.queue) == 0
        results.append(_main_grads(experts))
        for p in (experts.fc1_weight, experts.fc2_weight):
            assert p.grad is None and p.grad_added_to_main_grad is fusion
    for a, b in zip(*results, strict=True):
        assert b.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


def test_torch_fp8_backend_with_fusion_on_gets_ordinary_gradients(single_rank, monkeypatch):
    """torch-fp8 ignores the flag: real gradients through autograd, DDP's hook adds them into main_grad,
    the same with fusion on as off (``torch._scaled_grouped_mm`` emulated in fp32: CPU has none)."""
    from mok_megatron.ops import fp8_grouped_gemm as native
    from mok_megatron.options import MoKOptions
    from tests.test_fp8 import _fake_scaled_grouped_mm

    monkeypatch.setattr(native, "_gemm", _fake_scaled_grouped_mm([]))
    monkeypatch.setattr(native, "check_native_fp8", lambda device: None)
    monkeypatch.setattr(torch_mlp, "grouped_wgrad_accumulate_", lambda *a: pytest.fail("op called"))
    grads = []
    for fusion in (False, True):
        ddp, experts = _ddp_experts(
            fusion, torch.bfloat16, options=MoKOptions(expert_backend="torch-fp8"), ffn=16
        )
        _step(ddp, experts, [[16, 0, 32, 16]], torch.bfloat16, seed=4)
        grads.append(_main_grads(experts))
        for p in (experts.fc1_weight, experts.fc2_weight):
            assert p.grad is None and p.grad_added_to_main_grad is False
    for a, b in zip(*grads, strict=True):
        assert a.abs().sum() > 0 and torch.equal(a, b)


# ---- GPU: QuACK against the portable path ---------------------------------------------------------

_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(not (_HOPPER and have_quack()), reason="needs CUDA sm90+ and quack-kernels>=0.4.1")
def test_quack_matches_portable_and_accumulates_gpu():
    counts = [300, 0, 1, 517, 0, 64, 1000, 7]
    out, dy, x = _operands(counts, 256, 128, torch.bfloat16, device="cuda", seed=3)
    offs = _offs(counts, "cuda")
    quack, portable, want = out.clone(), out.clone(), out.double()
    for _ in range(2):  # the second call accumulates onto the first
        grouped_wgrad_accumulate_(quack, dy, x, offs, use_quack=True)
        grouped_wgrad_accumulate_(portable, dy, x, offs, use_quack=False)
        want = _reference(want, dy, x, counts)
    assert torch.equal(quack[1], out[1]) and torch.equal(quack[4], out[4])  # empty experts untouched
    # QuACK adds the fp32 accumulator; the portable path rounds each product to bf16 first
    torch.testing.assert_close(quack.double(), want, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(portable.double(), want, rtol=2e-2, atol=0.5)


def test_cuda_weights_fuse_only_with_an_accumulating_gemm(monkeypatch):
    """On CUDA the fusion needs QuACK (sm90+, bf16/fp16 weights); without it the experts keep ordinary
    gradients, since adding every call's gradient into fp32 costs more than bf16 sums."""
    from types import SimpleNamespace

    from mok_megatron import compat
    from mok_megatron.experts import main_grad

    w = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16, main_grad=None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(compat, "have_quack", lambda: False)
    assert main_grad.main_grad_owner(w, True) is None
    monkeypatch.setattr(compat, "have_quack", lambda: True)
    assert main_grad.main_grad_owner(w, True) is w
    assert main_grad.main_grad_owner(w, False) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert main_grad.main_grad_owner(w, True) is None
    cpu = torch.nn.Parameter(torch.zeros(2))
    cpu.main_grad = torch.zeros(2)
    assert main_grad.main_grad_owner(cpu, True) is cpu
    cpu.__fsdp_param__ = True  # Megatron-FSDP: main_grad is made in backward, so no fusion
    assert main_grad.main_grad_owner(cpu, True) is None
