"""Ops and functional pieces, single process, against their pure-torch references and hand-worked cases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mok_megatron.config import MoKConfig
from mok_megatron.engine.plain import combine, dispatch
from mok_megatron.experts.torch_mlp import expert_mlp
from mok_megatron.engine.plan import EPGroups, _chunk_sort_index, build_plan
from mok_megatron.ops.activation import Activation, ActivationSpec, apply_activation
from mok_megatron.ops.grouped_gemm import grouped_linear, grouped_linear_reference, offsets_from_counts
from mok_megatron.ops.permute import (
    combine_tokens,
    combine_tokens_reference,
    permute_tokens,
    permute_tokens_reference,
    permute_tokens_with_ranges,
)
from mok_megatron.ops.routing import capacity_order, dropless_order, slot_map

FP32 = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=2e-2, atol=2e-2)


def _grouped_case(counts, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g).to(dtype).requires_grad_()
    w = torch.randn(len(counts), n, k, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(sum(counts), n, generator=g).to(dtype)
    return x, w, dy


@pytest.mark.parametrize(
    "counts,k,n",
    [([3, 0, 5], 8, 16), ([0, 0, 0], 8, 8), ([7], 16, 8), ([1, 2, 3, 4, 5, 6, 7, 0], 8, 24), ([0, 9], 32, 8)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_matches_reference(counts, k, n, dtype):
    x, w, dy = _grouped_case(counts, k, n, dtype)
    offs = offsets_from_counts(torch.tensor(counts), x.device)
    y = grouped_linear(x, w, offs)
    y.backward(dy)
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    y_ref = grouped_linear_reference(x, w, counts)
    y_ref.backward(dy)
    tol = FP32 if dtype == torch.float32 else BF16
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(gx, x.grad, **tol)
    torch.testing.assert_close(gw, w.grad, **tol)
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.count_nonzero(gw[e]) == 0, "an expert without rows must get an exact zero gradient"


def test_grouped_linear_falls_back_where_the_kernel_cannot_run():
    # K = 6 fp32 rows are 24 bytes (not 16-byte aligned) and fp64 is not a kernel dtype.
    for dtype, k in ((torch.float32, 6), (torch.float64, 8)):
        x, w, dy = _grouped_case([2, 3], k, 8, dtype)
        y = grouped_linear(x, w, offsets_from_counts(torch.tensor([2, 3]), x.device))
        ref = torch.cat([x[:2] @ w[0].t(), x[2:] @ w[1].t()])
        torch.testing.assert_close(y, ref)


def test_grouped_linear_rejects_bad_shapes():
    x, w, _ = _grouped_case([2, 3], 8, 8, torch.float32)
    with pytest.raises(ValueError, match=r"x \(5, 8\) and w \(2, 8, 4\) do not fit"):
        grouped_linear(x, w[:, :, :4], torch.tensor([2, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"offs has shape \(3,\), expected \(2,\)"):
        grouped_linear(x, w, torch.tensor([1, 2, 5], dtype=torch.int32))


def test_dropless_order_hand_worked():
    # tokens 0..3, experts 0..2
    rm = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    tok, exp = dropless_order(rm, int(rm.sum()))
    assert tok.tolist() == [0, 2, 1, 2, 0, 1, 3]
    assert exp.tolist() == [0, 0, 1, 1, 2, 2, 2]


def test_capacity_order_pads_with_routed_tokens_first():
    rm = torch.tensor([[1, 0], [0, 0], [1, 1], [0, 1]], dtype=torch.bool)
    tok, exp = capacity_order(rm, 2)
    assert tok.tolist() == [0, 2, 2, 3]
    assert exp.tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"capacity 5 exceeds the 4 local tokens"):
        capacity_order(rm, 5)


def test_slot_map_hand_worked_and_skips_zero_probability_routes():
    rm = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    tok, exp = dropless_order(rm, int(rm.sum()))  # rows: t0e0 t2e0 t1e1 t2e1 t0e2 t1e2 t3e2
    probs = rm.float() * 0.5
    probs[1, 2] = 0.0  # e.g. a router-padding route: routed but weightless
    slots = slot_map(tok, probs[tok, exp] != 0, num_tokens=4, topk=2)
    # token 0 -> rows 0 (e0) and 4 (e2); token 1 -> row 2 (e1) only; token 2 -> 1, 3; token 3 -> 6
    assert slots.row_TK[slots.valid_TK].tolist() == [0, 4, 2, 1, 3, 6]
    assert slots.valid_TK.tolist() == [[True, True], [True, False], [True, True], [True, False]]


def test_slot_map_dropless_fast_path():
    rm = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.bool)
    tok, _ = dropless_order(rm, 6)  # rows: t0e0 t2e0 t1e1 t2e1 t0e2 t1e2
    slots = slot_map(tok, None, num_tokens=3, topk=2)
    assert slots.valid_TK is None and slots.row_TK.tolist() == [[0, 4], [2, 5], [1, 3]]
    with pytest.raises(ValueError, match=r"5 rows for 3 tokens x top-2"):
        slot_map(tok[:5], None, num_tokens=3, topk=2)


def _random_routing(num_tokens, num_experts, topk, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    top = logits.topk(topk, dim=1).indices
    rm = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, top, True)
    probs = torch.softmax(logits, -1) * rm
    return rm, probs


@pytest.mark.parametrize("num_tokens,num_experts,topk", [(1, 4, 1), (17, 8, 2), (64, 16, 8), (5, 3, 3)])
def test_permute_and_combine_match_references(num_tokens, num_experts, topk):
    rm, probs = _random_routing(num_tokens, num_experts, topk, seed=num_tokens)
    n = int(rm.sum())
    tok, exp = dropless_order(rm, n)
    slots = slot_map(tok, probs[tok, exp] != 0, num_tokens, topk)
    x = torch.randn(num_tokens, 8, requires_grad=True)
    y = permute_tokens(x, tok, slots)
    torch.testing.assert_close(y, permute_tokens_reference(x, tok))
    dy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, dy)
    (gx_ref,) = torch.autograd.grad(permute_tokens_reference(x, tok), x, dy)
    torch.testing.assert_close(gx, gx_ref, **FP32)

    rows = torch.randn(n, 8, requires_grad=True)
    out = combine_tokens(rows, slots)
    torch.testing.assert_close(out, combine_tokens_reference(rows, tok, num_tokens), **FP32)
    dout = torch.randn_like(out)
    (gr,) = torch.autograd.grad(out, rows, dout)
    (gr_ref,) = torch.autograd.grad(combine_tokens_reference(rows, tok, num_tokens), rows, dout)
    torch.testing.assert_close(gr, gr_ref)


@pytest.mark.parametrize("ranges", [((0, 5), (5, 17)), ((3, 3), (3, 9)), ((10, 17),)])
def test_permute_with_ranges_equals_permute_and_slices(ranges):
    # The pipeline's pack: the permuted rows plus views of the local regions, one gradient buffer;
    # equal to permute_tokens and plain slices, bitwise (the same adds in the same order per element).
    rm, probs = _random_routing(17, 8, 2, seed=5)
    tok, exp = dropless_order(rm, int(rm.sum()))
    slots = slot_map(tok, probs[tok, exp] != 0, 17, 2)
    x = torch.randn(17, 8, requires_grad=True)
    got = permute_tokens_with_ranges(x, tok, slots, ranges)
    ref = (permute_tokens(x, tok, slots), *(x[lo:hi] for lo, hi in ranges))
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    douts = [torch.randn_like(t) for t in ref]
    (g,) = torch.autograd.grad(sum((t * d).sum() for t, d in zip(got, douts, strict=True)), x)
    (g_ref,) = torch.autograd.grad(sum((t * d).sum() for t, d in zip(ref, douts, strict=True)), x)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-6)
    # Only some outputs used: the unused ones add nothing (the permuted rows unused included).
    for used in ([0], [1], list(range(1, len(got)))):
        outs = permute_tokens_with_ranges(x, tok, slots, ranges)
        ref = (permute_tokens(x, tok, slots), *(x[lo:hi] for lo, hi in ranges))
        (g,) = torch.autograd.grad(sum((outs[i] * douts[i]).sum() for i in used), x)
        (g_ref,) = torch.autograd.grad(sum((ref[i] * douts[i]).sum() for i in used), x)
        torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"range \(4, 18\) is outside the 17 rows"):
        permute_tokens_with_ranges(x, tok, slots, ((4, 18),))


def test_combine_is_deterministic_in_bf16():
    rm, probs = _random_routing(256, 16, 8, seed=3)
    tok, _ = dropless_order(rm, int(rm.sum()))
    slots = slot_map(tok, None, 256, 8)
    rows = torch.randn(int(rm.sum()), 32).bfloat16()
    a, b = combine_tokens(rows, slots), combine_tokens(rows, slots)
    assert torch.equal(a, b)
    # fp32 accumulation: closer to the fp64 truth than a bf16 index_add
    truth = combine_tokens_reference(rows.double(), tok, 256)
    assert (a.double() - truth).abs().max() <= (
        combine_tokens_reference(rows, tok, 256).double() - truth
    ).abs().max()


def test_chunk_sort_index_hand_worked():
    # two sources x two local experts; chunk sizes [[1, 2], [3, 0]] in (source, expert) order:
    # rows: s0e0=[0], s0e1=[1,2], s1e0=[3,4,5]; expert-major order: s0e0, s1e0, s0e1
    sort_idx, unsort_idx = _chunk_sort_index(torch.tensor([[1, 2], [3, 0]]), 6)
    assert sort_idx.tolist() == [0, 3, 4, 5, 1, 2]
    assert torch.equal(sort_idx[unsort_idx], torch.arange(6))


def _megatron_glu(x, fn, clamp=None, offset=0.0):
    x_glu, x_linear = torch.chunk(x, 2, dim=-1)
    if clamp is not None:
        x_glu = x_glu.clamp(min=None, max=clamp)
        x_linear = x_linear.clamp(min=-clamp, max=clamp)
    return fn(x_glu) * (x_linear + offset)


@pytest.mark.parametrize(
    "kind,fn", [(Activation.SILU, F.silu), (Activation.GELU, F.gelu), (Activation.RELU, F.relu)]
)
def test_activation_matches_megatron_formula(kind, fn):
    h = torch.randn(5, 16) * 3
    p = torch.rand(5)
    got = apply_activation(h, ActivationSpec(kind=kind, gated=True, clamp=1.5, glu_linear_offset=1.0), p)
    torch.testing.assert_close(got, _megatron_glu(h, fn, 1.5, 1.0) * p[:, None])
    torch.testing.assert_close(apply_activation(h, ActivationSpec(kind=kind, gated=False), None), fn(h))


def test_glu_interleave_matches_megatron():
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    h = torch.randn(3, 32)
    spec = ActivationSpec(kind=Activation.SILU, gated=True, glu_interleave=4)
    want = _megatron_glu(TEGroupedMLP._remove_glu_interleaving(h, 4), F.silu)
    torch.testing.assert_close(apply_activation(h, spec, None), want)


def test_expert_mlp_matches_per_expert_loop():
    g = torch.Generator().manual_seed(0)
    counts = [4, 0, 3]
    x = torch.randn(7, 16, generator=g)
    p = torch.rand(7, generator=g)
    w1 = torch.randn(3, 16, 16, generator=g)
    w2 = torch.randn(3, 16, 8, generator=g)
    y = expert_mlp(x, p, torch.tensor(counts), w1, w2, ActivationSpec(kind=Activation.SILU, gated=True))
    want = []
    for e, (xe, pe) in enumerate(zip(torch.split(x, counts), torch.split(p, counts), strict=True)):
        want.append((_megatron_glu(xe @ w1[e].t(), F.silu) * pe[:, None]) @ w2[e].t())
    torch.testing.assert_close(y, torch.cat(want), **FP32)


def test_single_rank_plan_dispatch_combine_round_trip():
    """EP=1: dispatch + identity experts + combine with probabilities 1/topk restores the input."""
    cfg = MoKConfig(
        num_experts=4,
        topk=2,
        hidden_size=8,
        ffn_hidden_size=8,
        activation=ActivationSpec(Activation.SILU, True),
    )
    rm, _ = _random_routing(10, 4, 2, seed=1)
    probs = rm.float() / 2
    plan = build_plan(torch.Size([5, 2, 8]), rm, probs, cfg, EPGroups())
    assert plan.tokens_per_expert_L.tolist() == rm.sum(0).tolist()
    x = torch.randn(10, 8)
    rows, tpe, p_rows = dispatch(x, probs, plan)
    assert rows.shape == (20, 8) and torch.equal(tpe, rm.sum(0))
    out = combine(rows * p_rows[:, None], plan)
    torch.testing.assert_close(out, x.view(5, 2, 8))


def test_concat_groups_gathers_every_part_group_by_group():
    """Parts with empty groups, an empty part and rows past the last offset (a sync-free buffer): one
    grouped GEMM over the result equals the parts' GEMMs summed, and each group holds its parts' rows in
    part order."""
    from mok_megatron.ops.grouped_gemm import _wgrad, concat_groups

    g = torch.Generator().manual_seed(0)
    parts = []
    for counts, spare in (([2, 0, 3], 2), ([1, 4, 0], 0), ([0, 0, 0], 3), ([3, 1, 2], 1)):
        m = sum(counts) + spare
        parts.append(
            ([torch.randn(m, 8, generator=g), torch.randn(m, 4, generator=g)], torch.tensor(counts).cumsum(0))
        )
    (dy, x), offs = concat_groups(parts)
    assert offs.tolist() == [6, 11, 16] and offs.dtype == torch.int32 and dy.shape == (22, 8)
    want = sum(_wgrad(p[0], p[1], o.int()) for p, o in parts if o[-1] > 0)
    torch.testing.assert_close(_wgrad(dy, x, offs), want, rtol=1e-5, atol=1e-5)
    # group 1 holds part 1's four rows, then part 3's one row
    assert torch.equal(dy[6:10], parts[1][0][0][1:5]) and torch.equal(dy[10], parts[3][0][0][3])
    with pytest.raises(ValueError, match="every part needs"):
        concat_groups([parts[0], ([torch.zeros(1, 8), torch.zeros(1, 4)], torch.tensor([1, 1]))])


def test_merging_queue_merges_only_where_the_gather_moves_fewer_bytes_than_the_sums():
    from mok_megatron.experts.torch_mlp import WgradQueue, _finish_wgrad

    w = torch.nn.Parameter(torch.randn(2, 8, 4))  # 64 elements; 2 extra calls sum 128
    for rows, merged in ((3, True), (4, False)):  # gathered 3 x 3 x 12 = 108 <= 128; 4 x 3 x 12 = 144
        queue = WgradQueue(merge_calls=True)
        for _ in range(3):
            offs = torch.tensor([1, rows], dtype=torch.int32)
            _finish_wgrad(queue, w, w, torch.randn(rows, 8), torch.randn(rows, 4), offs, True)
        assert len(WgradQueue._merged(queue.tasks)) == (1 if merged else 3), rows


def test_merging_queue_runs_one_gemm_per_weight(monkeypatch):
    """WgradQueue(merge_calls=True): a weight's grouped-GEMM tasks run as one GEMM; a task that is not one
    (operands None) keeps its weight on the per-task path."""
    from mok_megatron.experts.torch_mlp import WgradQueue, _finish_wgrad
    from mok_megatron.ops import grouped_gemm

    calls = []
    real = grouped_gemm._wgrad
    monkeypatch.setattr(grouped_gemm, "_wgrad", lambda *a: calls.append(1) or real(*a))
    w = torch.nn.Parameter(torch.randn(2, 8, 4))
    other = torch.nn.Parameter(torch.randn(2, 8, 4))
    mixed = torch.nn.Parameter(torch.randn(2, 8, 4))
    g = torch.Generator().manual_seed(1)
    per_call = []
    for queue in (WgradQueue(), WgradQueue(merge_calls=True)):
        for _ in range(3):  # 6 rows x (8 + 4) gathered <= 2 sums x 64: merging pays (``_merge_pays``)
            dy, x = torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)
            offs = torch.tensor([1, 2], dtype=torch.int32)
            _finish_wgrad(queue, w, w, dy, x, offs, True)
            per_call.append((dy, x, offs))
        queue.push(other, lambda: torch.ones(2, 8, 4))  # not a grouped GEMM: operands None
        queue.push(other, lambda: torch.ones(2, 8, 4))
        dy, x = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
        _finish_wgrad(queue, mixed, mixed, dy, x, torch.tensor([2, 5], dtype=torch.int32), True)
        queue.push(mixed, lambda: torch.ones(2, 8, 4))  # one of its tasks is no grouped GEMM: per task
        calls.clear()
        sums = queue.sums()
        assert len(calls) == (1 + 1 if queue.merge_calls else 3 + 1)
        torch.testing.assert_close(sums[id(w)][1], sum(real(*c) for c in per_call[-3:]), rtol=1e-5, atol=1e-5)
        assert torch.equal(sums[id(other)][1], torch.full((2, 8, 4), 2.0))
        torch.testing.assert_close(
            sums[id(mixed)][1], real(dy, x, torch.tensor([2, 5], dtype=torch.int32)) + 1
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_concat_groups_never_syncs_the_host():
    """The late-wgrad gate gathers in backward, where the host must keep queueing (and a CUDA graph may be
    capturing): no device-to-host or blocking host-to-device copy."""
    from mok_megatron.ops.grouped_gemm import concat_groups

    parts = []
    for counts, spare in (([2, 0, 3], 2), ([1, 4, 0], 0)):
        m = sum(counts) + spare
        offs = torch.tensor(counts).cumsum(0).to("cuda", torch.int32)
        parts.append(([torch.randn(m, 8, device="cuda"), torch.randn(m, 4, device="cuda")], offs))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        (dy, x), offs = concat_groups(parts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert offs.tolist() == [3, 7, 10] and dy.shape == (12, 8)  # 7 + 5 rows, 2 of them group-less
