"""MXFP8 (OCP Microscaling, e4m3 elements + E8M0 block scales) for Blackwell grouped expert GEMMs.

Status: the quantizer, the scale layouts and a CPU emulation of the grouped GEMM's contract are tested
on CPU (``tests/test_mxfp8.py``); the GEMM call itself (``mxfp8_grouped_linear``) needs compute
capability 10.x and has not run on hardware. Its GPU test is marked ``gpu`` and skips elsewhere.

Legend (shape suffixes): M rows (tokens grouped by expert), K contraction, N output features,
G groups (experts), C = K / 32 scale blocks per row, Rp / Cp the 128-row / 4-column padded sizes.

Format. Every 32 consecutive elements along the contraction dimension share one scale 2^(e - 127),
stored as its biased 8-bit exponent e (E8M0: no sign, no mantissa; e = 255 is NaN); the elements are
``e4m3fn(x / 2^(e - 127))``. Scales come back as ``torch.float8_e8m0fnu`` (the dtype torch's MX GEMMs
take), or uint8 holding the same bytes on a torch without it.

Scale exponent (the round-up rule cuBLAS / Transformer Engine MXFP8 quantizers use, NVIDIA's
"RCEIL"): e - 127 = ceil(log2(amax / 448)), the smallest power of two with amax / 2^(e-127) <= 448,
so no element saturates. Computed exactly from the fp32 bits: amax = m * 2^E with m in [0.5, 1)
(``torch.frexp``) gives e - 127 = E - 9 + (m > 0.875), since 448 = 0.875 * 2^9. Clamped to
[-127, 127], i.e. e in [0, 254]. Special blocks:
    all zeros     e = 0 (2^-127; a zero amax gives log2 = -inf, clamped: what torch's e8m0 cast and
                  its MX reference quantizer produce); the elements are 0.
    amax <= 448 * 2^-127 (~2.6e-36, e.g. fp32 subnormals)
                  e = 0, and the elements are scaled by exactly 2^127. (Transformer Engine's
                  ``exp2f_rcp`` and torch's test reference ``to_mxfp`` use a factor of 1 for e = 0,
                  which flushes such blocks to zero; every other block is bitwise the same.)
    NaN anywhere  e = 255: the E8M0 NaN, which makes the whole block decode as NaN (OCP MX spec).
    +-inf, no NaN e = 254 (the largest scale, as torch's reference quantizer gives), the
                  inf elements saturate to +-448 (decoding to +-448 * 2^127, beyond fp32: +-inf
                  again in fp32), the block's finite elements round to 0 at that scale.

Error bound (derived; the tests check it on random and adversarial blocks). With s = 2^(e - 127) and
v = x / s (exact: a power-of-two scaling), |v| <= 448 and e4m3fn rounds to nearest even: a normal
v (|v| >= 2^-6) is off by at most half an ulp, 2^(floor(log2|v|) - 4) <= 2^-4 |v|; a subnormal one
(spacing 2^-9) by at most 2^-10. So per element

    |dequant(quant(x))_i - x_i| <= max(2^-4 |x_i|, 2^-10 s)
                                <= 2^-4 amax          when e >= 1 (then s < amax / 224: 1/16 of amax)

(dequantizing in fp32 is exact: q * 2^(e-127) never rounds short of fp32 overflow, which only a
block amax within 2^-4 of fp32's maximum can reach). A block with e = 0 (amax <= 448 * 2^-127) has
s = 2^-127 > amax / 448 and only the first bound: its elements below 2^-137 round to 0.

Scale layout (``to_blocked``): cuBLAS's "block scaling factors layout" for 1x32 (and 1x16) scales on
sm_100 (``SwizzleType.SWIZZLE_32_4_4`` in torch): the [R, C] scale matrix is padded with zeros to
Rp = roundup(R, 128) rows and Cp = roundup(C, 4) columns and cut in 128 x 4 tiles, stored tile after
tile in row-major tile order (tile (i, j) at byte 512 * (i * Cp/4 + j)); inside a tile the scale of
(row r, column c) sits at byte (r % 32) * 16 + (r // 32) * 4 + c, i.e. the tile [128, 4] viewed as
[4, 32, 4] is transposed to [32, 4, 4]. Sources: the cuBLAS documentation, section "1D block scaling
factors layout" (docs.nvidia.com/cuda/cublas, #d-block-scaling-factors-layout), and torch's own test
helpers ``to_blocked`` / ``from_blocked`` in ``torch/testing/_internal/common_quantized.py``.

Grouped GEMM operands (``torch._scaled_grouped_mm`` 2d x 3d with e8m0 scales, which torch hands to
the MSLK / fbgemm ``mx8mx8bf16_grouped_mm`` CUTLASS kernel; torch checks in ``_check_scales_blocked``,
the kernel's pointer arithmetic in ``set_stacked_kernel_args_kernel``):
    A  x [M, K] e4m3 row-major, groups of rows given by the inclusive offsets ``offs_G``
       scale_a 2-D [rows >= M, Cp] e8m0: group g's [M_g, C] scales, each to_blocked on its own
       (padded to roundup(M_g, 128) rows), placed one after another: group g starts at row
       sum_{h<g} roundup(M_h, 128) (byte offset that * Cp). Empty groups take no rows. The buffer
       has M + 128 G rows (a static bound, so nothing is read on the host).
    B  w^T [G, K, N] e4m3 column-major (a transposed view of w [G, N, K] row-major)
       scale_b [G, Rp(N) * Cp] e8m0: to_blocked of each expert's [N, C] scales, flattened.
    out bf16 [M, N]. torch also wants K and N multiples of 16 and int32 offsets; here K must be a
    multiple of 32 (whole blocks). Callers pad every group's rows to a multiple of ``ALIGNMENT`` = 32:
    what Megatron pads MXFP8 experts to and the only group sizes torch's MXFP8 grouped tests use (the
    kernel's 2d x 3d pointer arithmetic takes any size; not checked here, that would read offs on
    the host).

Gradients (``mxfp8_grouped_linear`` is differentiable): dx = dy @ w_g is the same 2d x 3d GEMM with
dy quantized along N and w^T [G, K, N] quantized along N (so N must be a multiple of 32 too); the
weight gradient runs in bf16 (``ops.grouped_gemm``): its MXFP8 form would need 1x32 blocks along the
tokens of each expert (the 2d x 2d layout), which is not built here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mok_megatron.config import MoKConfigError
from mok_megatron.ops.grouped_gemm import _wgrad as _unquantized_wgrad

BLOCK = 32
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255
SCALE_DTYPE = getattr(torch, "float8_e8m0fnu", torch.uint8)
TILE_ROWS, TILE_COLS = 128, 4  # one swizzled scale tile: 128 rows x 4 scale columns = 512 bytes
ALIGNMENT = 32  # rows per expert: a multiple of this
MIN_CAPABILITY = (10, 0)
OUT_DTYPE = torch.bfloat16
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _round_up(x, m: int):
    return (x + m - 1) // m * m


# ---- quantize / dequantize -----------------------------------------------------------------------------------


def e8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponent (int32, 0..255) of the scale for blocks of absolute maximum ``amax``:
    ceil(log2(amax / 448)) + 127, clamped to [0, 254]; 255 (NaN) for a NaN amax (module docstring)."""
    amax = amax.float()
    mant, exp = torch.frexp(amax)
    unbiased = exp - 9 + (mant > 0.875).to(torch.int32)
    unbiased = torch.where(amax > 0, unbiased, torch.full_like(unbiased, -E8M0_BIAS))  # zero amax
    unbiased = torch.where(torch.isinf(amax), torch.full_like(unbiased, E8M0_BIAS), unbiased)
    biased = unbiased.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    return torch.where(torch.isnan(amax), torch.full_like(biased, E8M0_NAN), biased)


def _as_scale_dtype(biased: torch.Tensor) -> torch.Tensor:
    return biased.to(torch.uint8).view(SCALE_DTYPE)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """fp32 value 2^(e - 127) of E8M0 scales (``float8_e8m0fnu`` or uint8 bytes); NaN for e = 255."""
    e = scale.view(torch.uint8).to(torch.int32)
    value = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - E8M0_BIAS)
    return torch.where(e == E8M0_NAN, torch.full_like(value, float("nan")), value)


def _check_blocks(x: torch.Tensor, block: int, dim: int, what: str) -> int:
    if x.dim() == 0:
        raise ValueError(
            f"{what}: a 0-d tensor has no dimension to scale along; pass a tensor with dim {dim}"
        )
    length = x.shape[dim]
    if block < 1 or length % block:
        raise ValueError(
            f"{what}: dimension {dim} of shape {tuple(x.shape)} has {length} elements, not a multiple of the "
            f"block {block}; pad it to a multiple of {block} (MX scales cover whole blocks)"
        )
    return length


def quantize_mxfp8(x: torch.Tensor, block: int = BLOCK, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` -> (``q`` e4m3fn, x's shape; ``scale`` E8M0, x's shape with ``dim`` divided by ``block``):
    one power-of-two scale per ``block`` consecutive elements along ``dim`` (module docstring)."""
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(
            f"quantize_mxfp8: input dtype {x.dtype} is not supported; expected float32, bfloat16 or float16"
        )
    _check_blocks(x, block, dim, "quantize_mxfp8")
    x_last = x.movedim(dim, -1).float()
    x_blocks = x_last.reshape(*x_last.shape[:-1], x_last.shape[-1] // block, block)
    biased = e8m0_exponent(x_blocks.abs().amax(-1))
    # 1 / scale = 2^(127 - e) exactly (2^-127 .. 2^127 are fp32 values); a NaN block keeps its elements
    # unscaled (the NaN scale decodes the whole block as NaN).
    inv_exp = torch.where(biased == E8M0_NAN, torch.zeros_like(biased), E8M0_BIAS - biased)
    inv_scale = torch.ldexp(torch.ones_like(x_blocks[..., 0]), inv_exp)
    q_blocks = (x_blocks * inv_scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    q = q_blocks.reshape(x_last.shape).movedim(-1, dim)
    return q, _as_scale_dtype(biased).movedim(-1, dim)


def dequantize_mxfp8(
    q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK, dim: int = -1, dtype=torch.float32
) -> torch.Tensor:
    """``q * 2^(e - 127)`` per block along ``dim`` (exact in fp32), in ``dtype``."""
    if q.dtype != E4M3:
        raise TypeError(f"dequantize_mxfp8: q dtype {q.dtype}, expected {E4M3}")
    length = _check_blocks(q, block, dim, "dequantize_mxfp8")
    expected = list(q.shape)
    expected[dim] = length // block
    if list(scale.shape) != expected:
        raise ValueError(
            f"dequantize_mxfp8: scale shape {tuple(scale.shape)}, expected {tuple(expected)} "
            f"(q {tuple(q.shape)} with dimension {dim} in blocks of {block})"
        )
    q_last = q.movedim(dim, -1).float()
    s_last = scale_to_float(scale.movedim(dim, -1))
    x_blocks = q_last.reshape(*s_last.shape, block) * s_last.unsqueeze(-1)
    return x_blocks.reshape(q_last.shape).movedim(-1, dim).to(dtype)


# ---- swizzled scale layout -----------------------------------------------------------------------------------


def to_blocked(scale_RC: torch.Tensor) -> torch.Tensor:
    """Scales ``[..., R, C]`` -> ``[..., Rp, Cp]`` whose memory is cuBLAS's 128x4-tile layout (module
    docstring); row r of the result is NOT scale row r (the 2-D shape only sizes the buffer)."""
    if scale_RC.dim() < 2:
        raise ValueError(f"to_blocked: scales of shape {tuple(scale_RC.shape)}; expected [..., rows, cols]")
    *lead, rows, cols = scale_RC.shape
    rp, cp = _round_up(rows, TILE_ROWS), _round_up(cols, TILE_COLS)
    raw = scale_RC.view(torch.uint8)
    padded = raw.new_zeros((*lead, rp, cp))
    padded[..., :rows, :cols] = raw
    rb, cb = rp // TILE_ROWS, cp // TILE_COLS
    # row r = 32 a + b of a tile, column c: [.., rb, a, b, cb, c] -> [.., rb, cb, b, a, c]
    tiles = padded.reshape(*lead, rb, 4, 32, cb, TILE_COLS)
    n = len(lead)
    order = [*range(n), n, n + 3, n + 2, n + 1, n + 4]
    return tiles.permute(order).reshape(*lead, rp, cp).view(scale_RC.dtype)


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``to_blocked``: ``[..., Rp, Cp]`` (or ``[..., Rp * Cp]``) -> the ``[..., rows, cols]`` scales."""
    rp, cp = _round_up(rows, TILE_ROWS), _round_up(cols, TILE_COLS)
    lead = blocked.shape[:-2] if blocked.shape[-2:] == (rp, cp) else blocked.shape[:-1]
    if tuple(blocked.shape) not in ((*lead, rp, cp), (*lead, rp * cp)):
        raise ValueError(
            f"from_blocked: blocked shape {tuple(blocked.shape)} does not hold {rows} x {cols} scales; "
            f"expected [..., {rp}, {cp}] or [..., {rp * cp}]"
        )
    rb, cb = rp // TILE_ROWS, cp // TILE_COLS
    tiles = blocked.view(torch.uint8).reshape(*lead, rb, cb, 32, 4, TILE_COLS)
    n = len(lead)
    order = [*range(n), n, n + 3, n + 2, n + 1, n + 4]  # [.., rb, cb, b, a, c] -> [.., rb, a, b, cb, c]
    rows_cols = tiles.permute(order).reshape(*lead, rp, cp)
    return rows_cols[..., :rows, :cols].contiguous().view(blocked.dtype)


def group_counts(offs_G: torch.Tensor) -> torch.Tensor:
    """Rows per group (int64) from inclusive end offsets."""
    offs = offs_G.long()
    return torch.diff(offs, prepend=offs.new_zeros(1))


def blocked_group_starts(offs_G: torch.Tensor) -> torch.Tensor:
    """First scale row of each group in the grouped A-operand layout: sum_{h<g} roundup(M_h, 128)."""
    padded = _round_up(group_counts(offs_G), TILE_ROWS)
    return torch.cumsum(padded, 0) - padded


def _grouped_tile_index(offs_G: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Byte offset in the grouped layout of every scale (row m, column c) of a ``[rows, cols]`` matrix
    whose rows are grouped by ``offs_G``: computed on the device, no host read."""
    cp = _round_up(cols, TILE_COLS)
    m = torch.arange(rows, device=offs_G.device)
    c = torch.arange(cols, device=offs_G.device)
    offs = offs_G.long()
    group = torch.searchsorted(offs, m, right=True)  # the group holding row m
    group_start = (offs - group_counts(offs_G))[group]
    r = m - group_start  # row inside its group
    base = blocked_group_starts(offs_G)[group] * cp + (r // TILE_ROWS) * (TILE_ROWS * cp)
    within = (r % 32) * 16 + ((r % TILE_ROWS) // 32) * 4
    col = (c // TILE_COLS) * (TILE_ROWS * TILE_COLS) + c % TILE_COLS
    return (base + within).unsqueeze(1) + col.unsqueeze(0)


def grouped_buffer_rows(rows: int, groups: int) -> int:
    """Rows of the grouped A-scale buffer: M + 128 G, a static bound on sum_g roundup(M_g, 128)."""
    return rows + TILE_ROWS * groups


def to_blocked_grouped(scale_MC: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """Scales ``[M, C]`` of a row-grouped A operand -> ``[M + 128 G, Cp]``: each group's scales
    ``to_blocked`` on their own, group g from row ``blocked_group_starts(offs_G)[g]``; zeros elsewhere."""
    if scale_MC.dim() != 2:
        raise ValueError(f"to_blocked_grouped: scales of shape {tuple(scale_MC.shape)}; expected [M, C]")
    rows, cols = scale_MC.shape
    out = scale_MC.new_zeros(
        (grouped_buffer_rows(rows, offs_G.numel()), _round_up(cols, TILE_COLS)), dtype=torch.uint8
    )
    index = _grouped_tile_index(offs_G, rows, cols)
    out.view(-1).index_copy_(0, index.reshape(-1), scale_MC.view(torch.uint8).reshape(-1))
    return out.view(scale_MC.dtype)


def from_blocked_grouped(blocked: torch.Tensor, offs_G: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of ``to_blocked_grouped``: the ``[M, cols]`` scales, M = ``offs_G[-1]``."""
    rows = int(offs_G[-1]) if offs_G.numel() else 0
    index = _grouped_tile_index(offs_G, rows, cols)
    flat = blocked.view(torch.uint8).reshape(-1)
    return flat[index.reshape(-1)].reshape(rows, cols).view(blocked.dtype)


# ---- grouped GEMM operands, emulation, reference --------------------------------------------------------------


def quantize_weight(w_GNK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``wq_GNK`` e4m3 row-major, ``scale_b`` [G, Rp(N) * Cp] swizzled): the B operand's data and scales."""
    wq_GNK, ws_GNC = quantize_mxfp8(w_GNK.contiguous())
    return wq_GNK, to_blocked(ws_GNC).reshape(w_GNK.shape[0], -1)


def mxfp8_operands(x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor):
    """(A, B, scale_a, scale_b) of ``y[rows of g] = x[rows of g] @ w[g]^T`` in the layouts
    ``torch._scaled_grouped_mm`` takes for MXFP8 (module docstring)."""
    xq_MK, xs_MC = quantize_mxfp8(x_MK.contiguous())
    wq_GNK, scale_b = quantize_weight(w_GNK)
    return xq_MK, wq_GNK.transpose(-2, -1), to_blocked_grouped(xs_MC, offs_G), scale_b


def _decode_tiles(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """fp32 scales ``[rows, cols]`` read from one 128x4-tiled buffer by the cuBLAS byte formula."""
    cp = _round_up(cols, TILE_COLS)
    r = torch.arange(rows, device=flat.device).unsqueeze(1)
    c = torch.arange(cols, device=flat.device).unsqueeze(0)
    tile = (r // TILE_ROWS) * (cp // TILE_COLS) + c // TILE_COLS
    byte = tile * 512 + (r % 32) * 16 + ((r % TILE_ROWS) // 32) * 4 + c % TILE_COLS
    return scale_to_float(flat.view(torch.uint8)[byte])


def emulate_scaled_grouped_mm(a_MK, b_GKN, scale_a, scale_b, offs_G, out_dtype=OUT_DTYPE) -> torch.Tensor:
    """What the MXFP8 2d x 3d grouped GEMM computes, in fp32 on any device: each group's scales are
    found the way the kernel finds them (group g's A scales at byte sum_{h<g} roundup(M_h, 128) * Cp,
    B scales at byte g * Rp(N) * Cp) and decoded with the cuBLAS tile formula; one host read of offs."""
    rows, k = a_MK.shape
    groups, _, n = b_GKN.shape
    cols, cp = k // BLOCK, _round_up(k // BLOCK, TILE_COLS)
    flat_a = scale_a.view(torch.uint8).reshape(-1)
    flat_b = scale_b.view(torch.uint8).reshape(groups, -1)
    out = torch.zeros((rows, n), dtype=torch.float32, device=a_MK.device)
    ends = offs_G.tolist()
    start = start_scale_row = 0
    for g, end in enumerate(ends):
        m_g = end - start
        if m_g > 0:
            s_a = _decode_tiles(flat_a[start_scale_row * cp :], m_g, cols)
            s_b = _decode_tiles(flat_b[g], n, cols)
            a = a_MK[start:end].float() * s_a.repeat_interleave(BLOCK, 1)
            b = b_GKN[g].t().float() * s_b.repeat_interleave(BLOCK, 1)  # [N, K]
            out[start:end] = a @ b.t()
        start_scale_row += _round_up(m_g, TILE_ROWS)
        start = end
    return out.to(out_dtype)


def mxfp8_grouped_linear_reference(
    x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor
) -> torch.Tensor:
    """fp32 ``dequant(quant(x))[rows of g] @ dequant(quant(w[g]))^T``: the MXFP8 GEMM's exact value before
    its bf16 output rounding (and before the order of its fp32 accumulation)."""
    x_deq = dequantize_mxfp8(*quantize_mxfp8(x_MK))
    w_deq = dequantize_mxfp8(*quantize_mxfp8(w_GNK))
    out = x_MK.new_zeros((x_MK.shape[0], w_GNK.shape[1]), dtype=torch.float32)
    start = 0
    for g, end in enumerate(offs_G.tolist()):
        out[start:end] = x_deq[start:end] @ w_deq[g].t()
        start = end
    return out


# ---- the GEMM ------------------------------------------------------------------------------------------------


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why torch cannot run an MXFP8 grouped GEMM on ``device`` (None: it should, untested on hardware)."""
    device = torch.device(device)
    if not hasattr(torch, "_scaled_grouped_mm") or SCALE_DTYPE is torch.uint8:
        return (
            f"needs torch._scaled_grouped_mm and torch.float8_e8m0fnu, which torch {torch.__version__} lacks"
        )
    if device.type != "cuda":
        return f"MXFP8 grouped GEMMs need sm_100 (Blackwell, compute capability 10.x); this device is {device.type}"
    cap = torch.cuda.get_device_capability(device)
    if cap[0] != MIN_CAPABILITY[0]:
        return (
            "MXFP8 grouped GEMMs need sm_100 (Blackwell, compute capability 10.x: torch's MXFP8 grouped kernel "
            f"is built for it only); this device is {torch.cuda.get_device_name(device)} (sm_{cap[0]}{cap[1]})"
        )
    return None


def check_mxfp8(device: torch.device | str) -> None:
    """Raise MoKConfigError unless ``device`` can run ``mxfp8_grouped_linear``."""
    reason = unavailable_reason(device)
    if reason is not None:
        raise MoKConfigError(f"{reason}. Use the bf16 or torch-fp8 expert backend (Hopper+) on this device.")


def _scaled_grouped_mm(a_MK, b_GKN, scale_a, scale_b, offs_G) -> torch.Tensor:
    """The kernel call: torch's MXFP8 recipe (1x32 blocks, 32_4_4-swizzled e8m0 scales), bf16 out."""
    if hasattr(F, "scaled_grouped_mm"):
        blockwise, swizzle = F.ScalingType.BlockWise1x32, F.SwizzleType.SWIZZLE_32_4_4
        return F.scaled_grouped_mm(
            a_MK,
            b_GKN,
            scale_a,
            blockwise,
            scale_b,
            blockwise,
            swizzle,
            swizzle,
            offs=offs_G,
            output_dtype=OUT_DTYPE,
        )
    return torch._scaled_grouped_mm(a_MK, b_GKN, scale_a, scale_b, offs=offs_G, out_dtype=OUT_DTYPE)


def _check_shapes(x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> None:
    if x_MK.dim() != 2 or w_GNK.dim() != 3 or x_MK.shape[1] != w_GNK.shape[2]:
        raise ValueError(
            f"mxfp8_grouped_linear: x {tuple(x_MK.shape)} and w {tuple(w_GNK.shape)} do not fit; "
            "expected x [M, K] and w [G, N, K]"
        )
    _, n, k = w_GNK.shape
    if n % BLOCK or k % BLOCK:
        raise ValueError(
            f"mxfp8_grouped_linear: N={n}, K={k}; both must be multiples of {BLOCK} (the forward's and the "
            "input gradient's contraction run in whole 1x32 blocks)"
        )
    if offs_G.shape != (w_GNK.shape[0],) or offs_G.dtype != torch.int32:
        raise ValueError(
            f"mxfp8_grouped_linear: offs {tuple(offs_G.shape)} {offs_G.dtype}; expected ({w_GNK.shape[0]},) "
            f"int32 inclusive row offsets, each expert padded to a multiple of {ALIGNMENT} (ops.align)"
        )


class _MXFP8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_GNK, offs_G):
        ctx.save_for_backward(x_MK, w_GNK, offs_G)
        return _scaled_grouped_mm(*mxfp8_operands(x_MK, w_GNK, offs_G), offs_G).to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_GNK, offs_G = ctx.saved_tensors
        dx_MK = dw_GNK = None
        if ctx.needs_input_grad[0]:  # dx = dy @ w_g: contraction over N, B = w^T [G, K, N]
            operands = mxfp8_operands(dy_MN.contiguous(), w_GNK.transpose(-2, -1), offs_G)
            dx_MK = _scaled_grouped_mm(*operands, offs_G).to(x_MK.dtype)
        if ctx.needs_input_grad[1]:
            dw_GNK = _unquantized_wgrad(dy_MN.contiguous().to(w_GNK.dtype), x_MK.to(w_GNK.dtype), offs_G)
        return dx_MK, dw_GNK, None


def mxfp8_grouped_linear(x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """``y_MN[rows of g] = x_MK[rows of g] @ w_GNK[g].T`` through the MXFP8 grouped GEMM (with autograd:
    MXFP8 input gradient, bf16 weight gradient). Needs compute capability 10.x; NOT YET RUN ON HARDWARE.

    Inputs: x_MK [M, K], w_GNK [G, N, K] (bf16/fp16/fp32), offs_G [G] int32 inclusive offsets with every
    group a multiple of ``ALIGNMENT`` rows; K and N multiples of 32. Output: [M, N] in x's dtype (the
    kernel writes bf16)."""
    check_mxfp8(x_MK.device)
    _check_shapes(x_MK, w_GNK, offs_G)
    return _MXFP8GroupedLinear.apply(x_MK, w_GNK, offs_G)
