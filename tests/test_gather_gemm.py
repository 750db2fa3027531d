"""``ops.gather_gemm.gathered_grouped_linear``: the grouped GEMM over rows gathered from token order.

Legend: T tokens, K input features, N output features, G groups (local experts), M rows (expert-major).

CPU: the portable path against the plain-torch reference (forward, dx, dW; fp32 and bf16; torch's grouped
kernel and the per-group fallback), bitwise against the unfused path it replaces (permute, then
``grouped_linear``), padding rows (zero output, no gradient), empty groups, no rows, a caller's slot map,
bad inputs; the QuACK wiring through an emulation of QuACK's ``gemm`` / ``gemm_add_inplace`` semantics that
also enforces its layout and index-dtype asserts. GPU (skipped without CUDA sm90+ and QuACK): the QuACK path
against the portable one and the fp64 reference, and its fp32 accumulation.
"""

from __future__ import annotations

import pytest
import torch

from mok_megatron.compat import have_quack
from mok_megatron.kernels import quack_gather
from mok_megatron.ops import gather_gemm as gth
from mok_megatron.ops import grouped_gemm as gg
from mok_megatron.ops.permute import permute_tokens
from mok_megatron.ops.routing import dropless_order, expert_counts, slot_map


def _routing(num_tokens, topk, groups, seed=0, used=None, pad_to=1, device="cpu"):
    """Random distinct top-k experts per token (only the ``used`` ones), expert-major rows.
    Returns (idx_M, offs_G, counts, slots); with ``pad_to`` > 1 every group is padded with -1 rows to a
    multiple of it (the padding after the group's real rows)."""
    g = torch.Generator().manual_seed(seed)
    used = list(range(groups)) if used is None else used
    pick = torch.rand(num_tokens, len(used), generator=g).argsort(1)[:, :topk]
    routing_TE = torch.zeros(num_tokens, groups, dtype=torch.bool)
    routing_TE.scatter_(1, torch.tensor(used)[pick], True)
    tok_N, _ = dropless_order(routing_TE, num_tokens * topk)
    counts = expert_counts(routing_TE).tolist()
    slots = slot_map(tok_N, None, num_tokens, topk)
    if pad_to > 1:
        parts, padded, start = [], [], 0
        for c in counts:
            p = -(-c // pad_to) * pad_to
            parts += [tok_N[start : start + c], torch.full((p - c,), -1, dtype=torch.long)]
            padded.append(p)
            start += c
        tok_N, counts, slots = torch.cat(parts), padded, None
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    return tok_N.to(device), offs.to(device), counts, slots


def _operands(num_tokens, k, n, groups, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(num_tokens, k, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(groups, n, k, generator=g) / k**0.5).to(device, dtype).requires_grad_()
    return x, w


def _run(fn, x, w, dy):
    y = fn(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y.detach(), dx, dw


def _ref(x, idx, w, counts, dy):
    return _run(lambda x, w: gth.gathered_grouped_linear_reference(x, idx, w, counts), x, w, dy)


@pytest.mark.parametrize(
    "dtype,k,n,tol",
    [
        (torch.float32, 16, 24, 1e-5),  # torch's grouped kernel
        (torch.float32, 6, 5, 1e-5),  # rows not 16-byte aligned: the per-group fallback
        (torch.bfloat16, 16, 24, 2e-2),
    ],
)
def test_matches_reference(dtype, k, n, tol):
    idx, offs, counts, slots = _routing(40, 3, 5, seed=1)
    x, w = _operands(40, k, n, 5, dtype)
    dy = torch.randn(idx.shape[0], n).to(dtype)
    got = _run(lambda x, w: gth.gathered_grouped_linear(x, idx, w, offs, slots), x, w, dy)
    for a, b in zip(got, _ref(x, idx, w, counts, dy), strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_portable_is_bitwise_the_permute_then_grouped_linear():
    """The path it replaces: the permuted copy (whose backward is the same slot-map gather-sum), then the GEMM."""
    idx, offs, _, slots = _routing(64, 4, 8, seed=2)
    x, w = _operands(64, 32, 48, 8, torch.float32)
    dy = torch.randn(idx.shape[0], 48)
    got = _run(lambda x, w: gth.gathered_grouped_linear(x, idx, w, offs, slots), x, w, dy)
    want = _run(lambda x, w: gg.grouped_linear(permute_tokens(x, idx, slots), w, offs), x, w, dy)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_built_slots_equal_the_callers():
    idx, offs, _, slots = _routing(30, 2, 4, seed=3)
    x, w = _operands(30, 16, 16, 4, torch.float32)
    dy = torch.randn(idx.shape[0], 16)
    given = _run(lambda x, w: gth.gathered_grouped_linear(x, idx, w, offs, slots), x, w, dy)
    built = _run(lambda x, w: gth.gathered_grouped_linear(x, idx, w, offs), x, w, dy)
    for a, b in zip(given, built, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("k,n", [(16, 24), (6, 5)])
def test_padding_rows_are_zero_and_add_nothing(k, n):
    idx, offs, counts, _ = _routing(37, 3, 5, seed=4, pad_to=4)
    pad = idx < 0
    assert pad.any() and not pad.all()
    x, w = _operands(37, k, n, 5, torch.float32)
    dy = torch.randn(idx.shape[0], n)  # non-zero on the padding rows too: they must still add nothing
    y, dx, dw = _run(lambda x, w: gth.gathered_grouped_linear(x, idx, w, offs), x, w, dy)
    assert torch.equal(y[pad], torch.zeros_like(y[pad]))
    for a, b in zip((y, dx, dw), _ref(x, idx, w, counts, dy), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the same rows without the padding: the same gradients
    live = ~pad
    g = torch.tensor(counts).cumsum(0)
    group_M = torch.searchsorted(g, torch.arange(idx.shape[0]), right=True)
    tight = torch.bincount(group_M[live], minlength=5).cumsum(0).to(torch.int32)
    _, dx2, dw2 = _run(lambda x, w: gth.gathered_grouped_linear(x, idx[live], w, tight), x, w, dy[live])
    torch.testing.assert_close(dx, dx2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, dw2, rtol=1e-5, atol=1e-5)


def test_empty_groups_get_exact_zeros():
    idx, offs, counts, slots = _routing(25, 2, 6, seed=5, used=[0, 2, 3])
    assert [c == 0 for c in counts] == [False, True, False, False, True, True]
    x, w = _operands(25, 16, 8, 6, torch.float32)
    dy = torch.randn(idx.shape[0], 8)
    y, dx, dw = _run(lambda x, w: gth.gathered_grouped_linear(x, idx, w, offs, slots), x, w, dy)
    assert all(torch.equal(dw[g], torch.zeros_like(dw[g])) for g in (1, 4, 5))
    for a, b in zip((y, dx, dw), _ref(x, idx, w, counts, dy), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens", [0, 7])
def test_no_rows(num_tokens):
    x, w = _operands(num_tokens, 16, 8, 3, torch.float32)
    idx, offs = torch.zeros(0, dtype=torch.long), torch.zeros(3, dtype=torch.int32)
    y = gth.gathered_grouped_linear(x, idx, w, offs)
    assert y.shape == (0, 8)
    dx, dw = torch.autograd.grad(y.sum() + 0 * (x.sum() + w.sum()), (x, w))
    assert torch.equal(dx, torch.zeros_like(x)) and torch.equal(dw, torch.zeros_like(w))


def test_only_padding_rows_without_tokens():
    x, w = _operands(0, 16, 8, 2, torch.float32)
    idx, offs = torch.full((4,), -1), torch.tensor([4, 4], dtype=torch.int32)
    y = gth.gathered_grouped_linear(x, idx, w, offs)
    assert torch.equal(y, torch.zeros(4, 8))
    (dw,) = torch.autograd.grad(y.sum(), (w,))
    assert torch.equal(dw, torch.zeros_like(w))


def test_rejects_bad_inputs():
    idx, offs, _, slots = _routing(10, 2, 3)
    x, w = _operands(10, 16, 8, 3, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        gth.gathered_grouped_linear(x[:, :8], idx, w, offs)
    with pytest.raises(ValueError, match="int32/int64"):
        gth.gathered_grouped_linear(x, idx.float(), w, offs)
    with pytest.raises(ValueError, match="one inclusive row offset"):
        gth.gathered_grouped_linear(x, idx, w, offs[:2])
    with pytest.raises(ValueError, match="cast one"):
        gth.gathered_grouped_linear(x, idx, w.double(), offs)
    with pytest.raises(ValueError, match="slots cover"):
        gth.gathered_grouped_linear(x[:5], idx.clamp(max=4), w, offs, slots)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use_quack=True.*mok-megatron\\[quack\\]"):
            gth.gathered_grouped_linear(x, idx, w, offs, slots, use_quack=True)


# ---- the QuACK wiring, on CPU through an emulation of QuACK's semantics --------------------------------


def _quack_gemm_emulated(
    A, B, out=None, *, cu_seqlens_m=None, cu_seqlens_k=None, A_idx=None, tuned=True, C=None
):
    """QuACK's ``gemm`` (``C`` given: ``gemm_add_inplace``, out += A @ B) per its interface, with the asserts
    of ``quack.gemm.gemm`` on layouts and the int32 index: varlen-M ``out[rows of i] = A[A_idx[rows]] @ B[i]``;
    varlen-K ``out[i] (+)= A[:, A_idx[cols of i]] @ B[cols of i]``."""
    assert A_idx is None or A_idx.dtype == torch.int32, "A_idx must be int32"
    assert tuned is False
    if cu_seqlens_m is not None:
        assert A.stride(-1) == 1, "varlen_m requires A to be k-major"
        cu = cu_seqlens_m.tolist()
        out = torch.empty(A_idx.shape[0], B.shape[-1], dtype=A.dtype) if out is None else out
        for i in range(len(cu) - 1):
            out[cu[i] : cu[i + 1]] = A[A_idx[cu[i] : cu[i + 1]].long()] @ B[i]
        assert out.stride(-1) == 1, "varlen_m requires D to be n-major"
        return out
    assert A.stride(-2) == 1, "varlen_k requires A to be m-major"
    assert B.mT.stride(-2) == 1, "varlen_k requires B to be n-major"
    cu = cu_seqlens_k.tolist()
    assert out.shape == (len(cu) - 1, A.shape[0], B.shape[-1])
    for i in range(len(cu) - 1):
        prod = A[:, A_idx[cu[i] : cu[i + 1]].long()] @ B[cu[i] : cu[i + 1]]
        out[i] = prod + out[i] if C is not None else prod
    return out


@pytest.fixture
def emulated_quack(monkeypatch):
    monkeypatch.setattr(quack_gather, "supports", lambda x, w: True)
    monkeypatch.setattr(quack_gather, "quack_gemm", lambda: _quack_gemm_emulated)

    def add_inplace(A, B, out, **kw):
        _quack_gemm_emulated(A, B, out, C=out, **kw)

    monkeypatch.setattr(quack_gather, "quack_gemm_add_inplace", lambda: add_inplace)


@pytest.mark.parametrize("pad_to", [1, 4])
def test_quack_wiring_matches_portable(emulated_quack, pad_to):
    idx, offs, _, slots = _routing(33, 3, 6, seed=6, used=[0, 1, 3, 4, 5], pad_to=pad_to)
    x, w = _operands(33, 16, 24, 6, torch.float32)
    dy = torch.randn(idx.shape[0], 24)
    quack = _run(lambda x, w: gth.gathered_grouped_linear(x, idx, w, offs, slots, use_quack=True), x, w, dy)
    portable = _run(
        lambda x, w: gth.gathered_grouped_linear(x, idx, w, offs, slots, use_quack=False), x, w, dy
    )
    for a, b in zip(quack, portable, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_quack_accumulate_wiring(emulated_quack):
    idx, offs, counts, _ = _routing(20, 2, 4, seed=7)
    x, w = _operands(20, 16, 8, 4, torch.float32)
    dy = torch.randn(idx.shape[0], 8)
    main_grad = torch.randn(4, 8, 16)
    want = main_grad + _ref(x, idx, w, counts, dy)[2]
    quack_gather.accumulate_(
        main_grad, dy, x.detach(), quack_gather.index32(idx), quack_gather.cu_seqlens(offs)
    )
    torch.testing.assert_close(main_grad, want, rtol=1e-5, atol=1e-5)


# ---- GPU: QuACK against the portable path ---------------------------------------------------------------

_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.gpu
@pytest.mark.skipif(not (_HOPPER and have_quack()), reason="needs CUDA sm90+ and quack-kernels>=0.4.1")
@pytest.mark.parametrize("pad_to", [1, 16])
def test_quack_matches_portable_gpu(pad_to):
    # 8 groups, two of them empty, odd group sizes; K and N multiples of 8 (16-byte bf16 rows)
    idx, offs, counts, slots = _routing(
        1000, 4, 8, seed=8, used=[0, 1, 2, 4, 5, 7], pad_to=pad_to, device="cuda"
    )
    slots = None if slots is None else type(slots)(slots.row_TK.cuda())
    x, w = _operands(1000, 256, 384, 8, torch.bfloat16, device="cuda")
    dy = torch.randn(idx.shape[0], 384, device="cuda", dtype=torch.bfloat16)
    op = gth.gathered_grouped_linear
    quack = _run(lambda x, w: op(x, idx, w, offs, slots, use_quack=True), x, w, dy)
    again = _run(lambda x, w: op(x, idx, w, offs, slots, use_quack=True), x, w, dy)
    portable = _run(lambda x, w: op(x, idx, w, offs, slots, use_quack=False), x, w, dy)
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    want = _ref(xd, idx, wd, counts, dy.double())
    for name, q, p, r, a in zip(("y", "dx", "dw"), quack, portable, want, again, strict=True):
        assert torch.equal(q, a), f"{name}: QuACK path not bitwise repeatable"
        assert _rel(q, r) < 1e-2 and _rel(p, r) < 1e-2, (name, _rel(q, r), _rel(p, r))
        torch.testing.assert_close(q.float(), p.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(quack[2][3], torch.zeros_like(quack[2][3]))  # empty group: exact zeros
    pad = idx < 0
    assert torch.equal(quack[0][pad], torch.zeros_like(quack[0][pad]))


@pytest.mark.gpu
@pytest.mark.skipif(not (_HOPPER and have_quack()), reason="needs CUDA sm90+ and quack-kernels>=0.4.1")
def test_quack_accumulates_into_fp32_gpu():
    idx, offs, counts, _ = _routing(700, 4, 8, seed=9, used=[0, 1, 2, 3, 5, 6, 7], device="cuda")
    x, w = _operands(700, 128, 256, 8, torch.bfloat16, device="cuda")
    dy = torch.randn(idx.shape[0], 256, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.randn(8, 256, 128, device="cuda")
    want = main_grad.double()
    start = 0
    for g, c in enumerate(counts):
        rows = idx[start : start + c]
        want[g] += dy[start : start + c].double().t() @ x.detach()[rows].double()
        start += c
    before = main_grad.clone()
    quack_gather.accumulate_(
        main_grad, dy, x.detach(), quack_gather.index32(idx), quack_gather.cu_seqlens(offs)
    )
    assert torch.equal(main_grad[4], before[4])  # a group without rows adds nothing
    torch.testing.assert_close(main_grad.double(), want, rtol=1e-4, atol=1e-3)
