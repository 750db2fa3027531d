"""MXFP8 (``ops.mxfp8``) on CPU: the quantizer against an fp64 formula and torch's own reference
quantizer, its error bound on random and adversarial blocks, the 128x4-tile scale layout (a hand-worked
tile, tile order, padding, torch's test helpers), the grouped A-scale layout, the operands against
torch's meta checks, and the emulated GEMM against the dequantize-then-matmul reference, forward and
backward. The MXFP8 GEMM itself needs compute capability 10.x: ``test_gpu_matches_emulation`` is marked
``gpu`` and skips everywhere else (it has not run on hardware).

Torch's reference helpers (``to_blocked``, ``from_blocked``, ``to_mxfp`` in
``torch/testing/_internal/common_quantized.py``) are loaded from the installed torch by parsing that
file, since importing the module needs test-only packages.
"""

from __future__ import annotations

import ast
import math
import pathlib

import pytest
import torch

from mok_megatron.config import MoKConfigError
from mok_megatron.ops import mxfp8 as mx

E8M0 = torch.float8_e8m0fnu


def _exponent_fp64(amax: torch.Tensor) -> torch.Tensor:
    """ceil(log2(amax / 448)) + 127 clamped to [0, 254] in float64 (an independent formula)."""
    a = amax.double()
    e = torch.ceil(torch.log2(a / 448.0)).clamp(-127, 127) + 127
    return torch.where(a == 0, torch.zeros_like(e), e).to(torch.int32)


def _bytes(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(torch.uint8).to(torch.int32)


@pytest.fixture(scope="module")
def torch_ref():
    path = pathlib.Path(torch.__file__).parent / "testing" / "_internal" / "common_quantized.py"
    wanted = {"ceil_div", "to_blocked", "from_blocked", "to_mxfp"}
    if not path.exists():
        pytest.skip(f"{path} is not in this torch build")
    tree = ast.parse(path.read_text())
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    if {n.name for n in nodes} != wanted:
        pytest.skip(f"{path} lacks {sorted(wanted - {n.name for n in nodes})}")
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def _wide_range(shape, seed=0, dtype=torch.float32):
    """Normal values times per-block magnitudes spread over 2^-120 .. 2^100."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    mag = torch.randint(-120, 100, (*shape[:-1], shape[-1] // 32, 1), generator=g).float()
    return (x.reshape(*shape[:-1], -1, 32) * torch.exp2(mag)).reshape(shape).to(dtype)


# ---- quantizer ------------------------------------------------------------------------------------------------


def test_dtypes_and_shapes_along_any_dim():
    x = torch.randn(3, 64, 5)
    q, s = mx.quantize_mxfp8(x, dim=1)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == E8M0 and s.shape == (3, 2, 5)
    q_t, s_t = mx.quantize_mxfp8(x.transpose(1, 2).contiguous())
    assert torch.equal(q.float(), q_t.transpose(1, 2).float())
    assert torch.equal(_bytes(s), _bytes(s_t.transpose(1, 2)))
    back = mx.dequantize_mxfp8(q, s, dim=1)
    assert torch.equal(back, mx.dequantize_mxfp8(q_t, s_t).transpose(1, 2))


def test_exponent_exact_at_and_around_powers_of_two():
    k = torch.arange(-120, 120, dtype=torch.float32)
    at = 448.0 * torch.exp2(k)  # amax / 448 exactly 2^k: scale 2^k, and the amax maps to 448 exactly
    above = torch.nextafter(at, torch.full_like(at, math.inf))
    below = torch.nextafter(at, torch.zeros_like(at))
    assert torch.equal(mx.e8m0_exponent(at), (k + 127).int())
    assert torch.equal(mx.e8m0_exponent(above), (k + 128).int())
    assert torch.equal(mx.e8m0_exponent(below), (k + 127).int())
    g = torch.Generator().manual_seed(1)
    amax = torch.exp2(torch.rand(20000, generator=g) * 300 - 160).float()  # includes fp32 subnormals
    amax = torch.cat([amax, torch.tensor([0.0, 1e-45, 1.1754942e-38, 448 * 2.0**-127, 3.4e38])])
    assert torch.equal(mx.e8m0_exponent(amax), _exponent_fp64(amax))


def test_matches_torch_reference_quantizer(torch_ref):
    for dtype in (torch.float32, torch.bfloat16):
        x = _wide_range((64, 256), seed=2, dtype=dtype)
        x[0, :32] = 0.0
        q, s = mx.quantize_mxfp8(x)
        s_ref, q_ref = torch_ref["to_mxfp"](x, format="mxfp8")
        assert s_ref.dtype == s.dtype and s_ref.shape == s.shape
        assert torch.equal(_bytes(s), _bytes(s_ref))
        normal = (_bytes(s) > 0).repeat_interleave(32, 1)  # torch's reference flushes e = 0 blocks
        assert normal.float().mean() > 0.5
        assert torch.equal(q.view(torch.uint8)[normal], q_ref.view(torch.uint8)[normal])
        assert (q_ref.float()[~normal] == 0).all()


def test_tiny_blocks_keep_precision_where_torch_reference_flushes(torch_ref):
    x = torch.linspace(-1, 1, 64).reshape(2, 32) * torch.tensor([[1e-37], [1e-40]])  # amax < 448 * 2^-127
    q, s = mx.quantize_mxfp8(x)
    assert (_bytes(s) == 0).all()
    assert (torch_ref["to_mxfp"](x, format="mxfp8")[1].float() == 0).all()
    err = (mx.dequantize_mxfp8(q, s).double() - x.double()).abs()
    assert (err <= torch.maximum(2.0**-4 * x.double().abs(), torch.tensor(2.0**-137))).all()
    assert (q.float() != 0).sum() >= 60


def _check_bound(x: torch.Tensor):
    """The derived per-element bound and the no-saturation property, block by block (fp64 arithmetic)."""
    q, s = mx.quantize_mxfp8(x)
    deq = mx.dequantize_mxfp8(q, s).double()
    xd = x.double()
    scale = mx.scale_to_float(s).double().repeat_interleave(32, -1)
    err = (deq - xd).abs()
    assert (err <= torch.maximum(2.0**-4 * xd.abs(), 2.0**-10 * scale)).all()
    amax = xd.reshape(*x.shape[:-1], -1, 32).abs().amax(-1)
    unclamped = (_bytes(s) > 0).repeat_interleave(32, -1)  # e = 0 blocks: s > amax / 448, first bound only
    assert (err <= 2.0**-4 * amax.repeat_interleave(32, -1))[unclamped].all()
    ratio = amax / mx.scale_to_float(s).double()  # amax / scale: (224, 448] unless the scale is clamped
    assert (ratio <= 448).all()
    assert ((ratio > 224) | (_bytes(s) == 0) | (amax == 0)).all()
    assert (q.float().abs() <= 448).all()
    return err, amax


def test_error_bound_random_blocks():
    for seed, dtype in ((3, torch.float32), (4, torch.bfloat16), (5, torch.float16)):
        x = _wide_range((128, 512), seed=seed) if dtype != torch.float16 else torch.randn(128, 512) * 100
        err, amax = _check_bound(x.to(dtype))
        rel = err / amax.repeat_interleave(32, -1).clamp_min(1e-300)
        assert 0 < rel.max() <= 2.0**-4


def test_error_bound_adversarial_blocks():
    blocks = {
        "all equal": torch.full((32,), 3.0),
        "all equal negative": torch.full((32,), -1e-3),
        "one huge outlier": torch.cat([torch.ones(31), torch.tensor([2.0**100])]),
        "one huge inexact outlier": torch.cat([torch.ones(31), torch.tensor([1e30])]),
        "outlier negative": torch.cat([torch.tensor([-7e5]), torch.rand(31) * 1e-3]),
        "zeros": torch.zeros(32),
        "fp32 subnormals": torch.linspace(1, 32, 32) * 1e-44,
        "bf16 smallest normals": torch.linspace(-1, 1, 32) * 1.2e-38,
        "amax at 448": torch.cat([torch.tensor([448.0]), torch.linspace(-447, 447, 31)]),
        "just above 448": torch.cat(
            [torch.tensor([torch.nextafter(torch.tensor(448.0), torch.tensor(1e9))]), torch.ones(31)]
        ),
        "alternating sign": torch.tensor([(-1.0) ** i * (i + 1) for i in range(32)]),
        "e4m3 subnormal range after scaling": torch.cat(
            [torch.tensor([448.0]), torch.full((31,), 448 * 2.0**-12)]
        ),
    }
    x = torch.stack(list(blocks.values()))
    err, amax = _check_bound(x)
    q, s = mx.quantize_mxfp8(x)
    row = {name: i for i, name in enumerate(blocks)}
    assert (err[row["all equal"]] == 0).all() and (err[row["zeros"]] == 0).all()
    assert _bytes(s)[row["zeros"]].item() == 0 and (q.float()[row["zeros"]] == 0).all()
    assert _bytes(s)[row["amax at 448"]].item() == 127 and q.float()[row["amax at 448"], 0] == 448
    assert _bytes(s)[row["just above 448"]].item() == 128
    assert err[row["one huge outlier"], 31] == 0 and (err[row["one huge outlier"], :31] == 1).all()  # flushed


def test_nan_and_inf_blocks():
    x = torch.randn(3, 64)
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    x[2, 0] = float("-inf")
    q, s = mx.quantize_mxfp8(x)
    e = _bytes(s)
    assert [e[0, 0].item(), e[1, 1].item(), e[2, 0].item()] == [255, 254, 254]
    assert max(e[0, 1].item(), e[1, 0].item(), e[2, 1].item()) < 140  # the finite blocks: scales near 2^-7
    deq = mx.dequantize_mxfp8(q, s)
    assert deq[0, :32].isnan().all() and not deq[0, 32:].isnan().any()  # a NaN scale: whole block NaN
    assert q.float()[1, 40] == 448 and deq[1, 40] == math.inf and (deq[1, 32:40] == 0).all()
    assert deq[2, 0] == -math.inf
    assert not deq[1, :32].isnan().any()


def test_representable_values_round_trip_exactly():
    g = torch.Generator().manual_seed(6)
    codes = torch.randint(0, 256, (16, 64), generator=g, dtype=torch.uint8)
    q = codes.view(torch.float8_e4m3fn).float().nan_to_num(0.0)
    q[:, ::32] = 448.0  # every block's amax at 448: scale = the block's power of two
    shift = torch.randint(-60, 60, (16, 2, 1), generator=g).float()
    x = (q.reshape(16, 2, 32) * torch.exp2(shift)).reshape(16, 64)
    assert torch.equal(mx.dequantize_mxfp8(*mx.quantize_mxfp8(x)), x)


def test_input_errors():
    with pytest.raises(ValueError, match=r"48 elements, not a multiple of the block 32"):
        mx.quantize_mxfp8(torch.randn(2, 48))
    with pytest.raises(TypeError, match="torch.int32"):
        mx.quantize_mxfp8(torch.zeros(2, 32, dtype=torch.int32))
    q, s = mx.quantize_mxfp8(torch.randn(2, 64))
    with pytest.raises(ValueError, match=r"scale shape \(2, 1\), expected \(2, 2\)"):
        mx.dequantize_mxfp8(q, s[:, :1])


# ---- scale layout -----------------------------------------------------------------------------------------


def test_hand_worked_tile():
    """One 128x4 tile: byte i holds the scale of row 32 * ((i % 16) // 4) + i // 16, column i % 4."""
    rows = torch.arange(128, dtype=torch.uint8).unsqueeze(1).expand(128, 4).contiguous()
    cols = torch.arange(4, dtype=torch.uint8).expand(128, 4).contiguous()
    b_rows, b_cols = mx.to_blocked(rows).flatten(), mx.to_blocked(cols).flatten()
    assert (
        b_rows[:32].tolist()
        == [0] * 4 + [32] * 4 + [64] * 4 + [96] * 4 + [1] * 4 + [33] * 4 + [65] * 4 + [97] * 4
    )
    assert b_rows[-16:].tolist() == [31] * 4 + [63] * 4 + [95] * 4 + [127] * 4
    assert b_cols[:16].tolist() == [0, 1, 2, 3] * 4 and b_cols.tolist() == [0, 1, 2, 3] * 128
    i = torch.arange(512)
    assert torch.equal(b_rows.long(), 32 * ((i % 16) // 4) + i // 16)


def test_tile_order_and_padding():
    s = torch.zeros(130, 5, dtype=torch.uint8)
    s[:128, :4], s[:128, 4:], s[128:, :4], s[128:, 4:] = 1, 2, 3, 4  # tiles (0,0) (0,1) (1,0) (1,1)
    b = mx.to_blocked(s.view(E8M0))
    assert b.shape == (256, 8) and b.dtype == E8M0
    flat = b.view(torch.uint8).flatten()
    tile = flat.reshape(4, 512)  # tiles in row-major tile order, 512 bytes each
    assert (tile[0] == 1).all()
    assert (
        tile[1].view(32, 4, 4)[:, 0, 0].tolist() == [2] * 32 and (tile[1].view(32, 4, 4)[:, :, 1:] == 0).all()
    )
    assert (tile[1].view(32, 4, 4)[..., 0] == 2).all()  # column 4 of all 128 rows; pad columns 5..7: 0
    assert tile[2].view(32, 4, 4)[:2, 0, :4].tolist() == [[3, 3, 3, 3]] * 2 and tile[2].sum() == 3 * 8
    assert tile[3].view(32, 4, 4)[:2, 0, 0].tolist() == [4, 4] and tile[3].sum() == 4 * 2
    assert torch.equal(mx.from_blocked(b, 130, 5).view(torch.uint8), s)


def test_layout_matches_torch_helpers_and_round_trips(torch_ref):
    g = torch.Generator().manual_seed(7)
    for rows, cols in ((128, 4), (1, 1), (130, 5), (300, 17), (512, 64)):
        s = torch.randint(0, 255, (rows, cols), generator=g, dtype=torch.uint8).view(E8M0)
        b = mx.to_blocked(s)
        assert torch.equal(b.view(torch.uint8).flatten(), torch_ref["to_blocked"](s).view(torch.uint8))
        assert torch.equal(mx.from_blocked(b, rows, cols).view(torch.uint8), s.view(torch.uint8))
        assert torch.equal(mx.from_blocked(b.flatten(), rows, cols), mx.from_blocked(b, rows, cols))
        if rows * cols <= 700:  # torch's loop version
            dummy = torch.empty(rows, cols * 32)
            ref = torch_ref["from_blocked"](dummy, b.view(torch.uint8).flatten(), 32)
            assert torch.equal(ref, s.view(torch.uint8))


def test_batched_layout_is_per_group():
    s = torch.randint(0, 255, (3, 96, 6), dtype=torch.uint8)
    b = mx.to_blocked(s)
    assert b.shape == (3, 128, 8)
    for g in range(3):
        assert torch.equal(b[g], mx.to_blocked(s[g]))
    assert torch.equal(mx.from_blocked(b.reshape(3, -1), 96, 6), s)


GROUPINGS = [[32, 0, 160, 96], [0, 0, 64], [128], [256, 32], [32] * 7, [0, 416, 0]]


@pytest.mark.parametrize("counts", GROUPINGS)
def test_grouped_layout(counts):
    cols = 6
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    rows = sum(counts)
    s = torch.randint(1, 255, (rows, cols), dtype=torch.uint8).view(E8M0)
    b = mx.to_blocked_grouped(s, offs)
    assert b.shape == (rows + 128 * len(counts), 8) and b.dtype == E8M0 and b.shape[0] >= rows
    padded = [-(-c // 128) * 128 for c in counts]
    starts = [sum(padded[:g]) for g in range(len(counts))]
    assert mx.blocked_group_starts(offs).tolist() == starts
    # torch's grouped-GEMM test construction: each group to_blocked on its own, concatenated
    pieces = [mx.to_blocked(part) for part in torch.split(s, counts) if part.shape[0]]
    expected = (
        torch.cat([p.view(torch.uint8).flatten() for p in pieces])
        if pieces
        else torch.zeros(0, dtype=torch.uint8)
    )
    flat = b.view(torch.uint8).flatten()
    assert torch.equal(flat[: expected.numel()], expected)
    assert (flat[expected.numel() :] == 0).all()
    assert torch.equal(mx.from_blocked_grouped(b, offs, cols).view(torch.uint8), s.view(torch.uint8))


# ---- operands, emulation, reference ----------------------------------------------------------------------------


def _problem(counts, n=96, k=128, seed=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (
        _wide_range((sum(counts), k), seed=seed).clamp(-1e6, 1e6).to(dtype)
        if sum(counts)
        else torch.zeros(0, k)
    )
    w = (torch.randn(len(counts), n, k, generator=g) * 0.02).to(dtype)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return x, w, offs


@pytest.mark.parametrize("counts", GROUPINGS)
def test_operands_pass_torch_meta_checks(counts):
    x, w, offs = _problem(counts)
    a, b, sa, sb = mx.mxfp8_operands(x, w, offs)
    assert a.stride() == (128, 1) and b.shape == (len(counts), 128, 96) and b.stride()[-2:] == (1, 128)
    assert sb.shape == (len(counts), 128 * 4) and sa.dtype == sb.dtype == E8M0
    meta = [t.to("meta") for t in (a, b, sa, sb, offs)]
    y = torch._scaled_grouped_mm(*meta[:4], offs=meta[4], out_dtype=torch.bfloat16)
    assert y.shape == (sum(counts), 96) and y.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="MXFP8"):  # the meta check is live: a wrong B-scale size fails
        torch._scaled_grouped_mm(*meta[:3], meta[3][:, :-4], offs=meta[4], out_dtype=torch.bfloat16)


@pytest.mark.parametrize("counts", GROUPINGS)
def test_emulated_gemm_equals_reference(counts):
    x, w, offs = _problem(counts)
    operands = mx.mxfp8_operands(x, w, offs)
    emulated = mx.emulate_scaled_grouped_mm(*operands, offs, out_dtype=torch.float32)
    reference = mx.mxfp8_grouped_linear_reference(x, w, offs)
    assert torch.equal(emulated, reference)
    bounds = [0, *offs.tolist()]
    plain = torch.cat([x[bounds[g] : bounds[g + 1]] @ w[g].t() for g in range(len(counts))])
    scale = plain.abs().amax().clamp_min(1e-30)
    assert ((reference - plain).abs().amax() / scale) < 0.1  # two e4m3 operands: ~2^-4 relative each


def test_emulation_reads_the_kernels_scale_offsets():
    """Group g's scales start at byte sum_{h<g} roundup(M_h, 128) * Cp: the padding bytes are never read,
    and the first byte of the second group's block is the scale of its row 0, k-block 0."""
    _, w, offs = _problem([32, 64])
    x = torch.randn(96, 128, generator=torch.Generator().manual_seed(9))
    a, b, sa, sb = mx.mxfp8_operands(x, w, offs)
    good = mx.emulate_scaled_grouped_mm(a, b, sa, sb, offs, out_dtype=torch.float32)
    real = mx.to_blocked_grouped(torch.ones(96, 4, dtype=torch.uint8), offs).view(-1) == 1
    junk = sa.view(torch.uint8).clone()
    junk.view(-1)[~real] = 200
    assert torch.equal(mx.emulate_scaled_grouped_mm(a, b, junk.view(E8M0), sb, offs, torch.float32), good)
    bumped = sa.view(torch.uint8).clone()
    bumped.view(-1)[128 * sa.shape[1]] += 1  # x2 on k-block 0 of the second group's first row
    out = mx.emulate_scaled_grouped_mm(a, b, bumped.view(E8M0), sb, offs, out_dtype=torch.float32)
    changed = (out != good).any(1).nonzero().flatten().tolist()
    assert changed == [32]
    block0 = (
        mx.dequantize_mxfp8(a[32:33], mx.quantize_mxfp8(x[32:33])[1])[:, :32]
        @ mx.dequantize_mxfp8(*mx.quantize_mxfp8(w[1]))[:, :32].t()
    )
    torch.testing.assert_close(
        out[32] - good[32], block0[0], rtol=1e-5, atol=1e-5 * block0.abs().max().item()
    )


def test_autograd_path_with_emulated_kernel(monkeypatch):
    """Everything up to the kernel call (operands, transposed dgrad operands, bf16 weight gradient) with
    the kernel replaced by its CPU emulation."""
    monkeypatch.setattr(mx, "_scaled_grouped_mm", mx.emulate_scaled_grouped_mm)
    monkeypatch.setattr(mx, "check_mxfp8", lambda device: None)
    counts = [64, 0, 96, 32]
    x, w, offs = _problem(counts, n=64, k=96, dtype=torch.bfloat16)
    x = x.clamp(-100, 100).requires_grad_()
    w = w.requires_grad_()
    y = mx.mxfp8_grouped_linear(x, w, offs)
    assert y.dtype == torch.bfloat16 and y.shape == (192, 64)
    assert torch.equal(y, mx.mxfp8_grouped_linear_reference(x.detach(), w.detach(), offs).to(torch.bfloat16))
    dy = torch.randn(192, 64, dtype=torch.bfloat16)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    dx_ref = mx.mxfp8_grouped_linear_reference(dy, w.detach().transpose(-2, -1).contiguous(), offs)
    assert torch.equal(dx, dx_ref.to(torch.bfloat16))
    bounds = [0, *offs.tolist()]
    for g in range(len(counts)):
        rows = slice(bounds[g], bounds[g + 1])
        expect = dy[rows].float().t() @ x.detach()[rows].float()
        torch.testing.assert_close(dw[g].float(), expect, rtol=2e-2, atol=1e-2)


def test_shape_and_device_errors(monkeypatch):
    x, w, offs = _problem([32, 32])
    with pytest.raises(
        MoKConfigError, match=r"need sm_100 \(Blackwell, compute capability 10.x\); this device is cpu"
    ):
        mx.mxfp8_grouped_linear(x, w, offs)
    monkeypatch.setattr(mx, "check_mxfp8", lambda device: None)
    with pytest.raises(ValueError, match="N=80, K=128; both must be multiples of 32"):
        mx.mxfp8_grouped_linear(x, w[:, :80], offs)
    with pytest.raises(ValueError, match=r"offs \(2,\) torch.int64"):
        mx.mxfp8_grouped_linear(x, w, offs.long())


@pytest.mark.parametrize("cap,ok", [((9, 0), False), ((10, 0), True), ((10, 3), True), ((12, 0), False)])
def test_capability_guard(monkeypatch, cap, ok):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU-under-test")
    reason = mx.unavailable_reason("cuda:0")
    if ok:
        assert reason is None
    else:
        assert f"this device is GPU-under-test (sm_{cap[0]}{cap[1]})" in reason and "sm_100" in reason


# ---- on a Blackwell GPU (not run on hardware yet) ---------------------------------------------------------------


def _is_sm100() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


@pytest.mark.gpu
@pytest.mark.skipif(not _is_sm100(), reason="MXFP8 grouped GEMMs need compute capability 10.x")
@pytest.mark.parametrize("counts", [[256, 0, 160, 96], [2048] * 4])
def test_gpu_matches_emulation(counts):
    x, w, offs = _problem(counts, n=512, k=1024, dtype=torch.bfloat16)
    x, w, offs = x.clamp(-100, 100).cuda().requires_grad_(), w.cuda().requires_grad_(), offs.cuda()
    y = mx.mxfp8_grouped_linear(x, w, offs)
    operands = mx.mxfp8_operands(x.detach(), w.detach(), offs)
    emulated = mx.emulate_scaled_grouped_mm(*operands, offs, out_dtype=torch.float32)
    # same products, the kernel's fp32 accumulation order and bf16 output: bf16 rounding apart
    torch.testing.assert_close(y.float(), emulated, rtol=2**-7, atol=1e-3 * emulated.abs().amax().item())
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, (x,), dy)
    dx_ref = mx.mxfp8_grouped_linear_reference(dy, w.detach().transpose(-2, -1).contiguous(), offs)
    torch.testing.assert_close(dx.float(), dx_ref, rtol=2**-7, atol=1e-3 * dx_ref.abs().amax().item())
