"""E4M3 quantize / dequantize with fp32 scales: rowwise, 1x128 blockwise (DeepSeek-V3) and per-segment.

``scale = amax / 448`` (448 = largest e4m3fn value), ``q = e4m3(x / scale)``, ``x ~ q * scale``; an all-zero
group gets scale 1 (its q is 0). torch's float8 dtypes cast on CPU, so all of this runs anywhere.

Error bound (derived; ``tests/test_fp8.py`` checks it). e4m3fn has 3 mantissa bits and rounds to
nearest: a scaled value v with 2^-6 <= |v| <= 448 (normal range) is off by at most half an ulp,
2^(floor(log2|v|) - 4) <= 2^-4 |v|; below 2^-6 (subnormals, spacing 2^-9) by at most 2^-10. Scaling
back by ``scale = amax / 448`` gives, per element,

    |dequant(quant(x))_i - x_i| <= 2^-4 |x_i| + 2^-10 * amax / 448   (<= 2^-4 * amax, i.e. 1/16 of amax)

plus fp32 rounding of the division (relative 2^-24, negligible) and the output dtype's own rounding when
dequantizing to bf16 (2^-9 relative). The bound is per scale group: the row (rowwise), the 1x128 block
(blockwise) or the (column, segment) pair (segments).

Legend: R rows, H hidden (last dim), S scales per row, C columns, M rows split in G segments.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128  # DeepSeek-V3 / TE Float8BlockScaling 1x128 activation blocks
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_input(x: torch.Tensor, what: str) -> None:
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(
            f"{what}: input dtype {x.dtype} is not supported; expected float32, bfloat16 or float16 "
            "(quantize the high-precision tensor, not an already-quantized one)"
        )
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{what}: input shape {tuple(x.shape)} has no last dimension to scale over")


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    amax = amax.float()
    # A tensor divisor: torch divides by a Python scalar through its reciprocal on CUDA (one ulp off the
    # correctly rounded quotient at times); the kernels divide IEEE round-to-nearest (``tl.math.div_rn``).
    return torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))


def _cast(x_scaled: torch.Tensor) -> torch.Tensor:
    return x_scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., H]`` -> (``q [..., H]`` e4m3, ``scale [...]`` fp32): one scale per row (last dim)."""
    _check_input(x, "quantize_rowwise")
    scale = _scale_from_amax(x.abs().amax(-1))
    return _cast(x.float() / scale.unsqueeze(-1)), scale


def dequantize_rowwise(q: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    if q.dtype != E4M3:
        raise TypeError(f"dequantize_rowwise: q dtype {q.dtype}, expected {E4M3}")
    if scale.shape != q.shape[:-1]:
        raise ValueError(
            f"dequantize_rowwise: scale shape {tuple(scale.shape)}, expected {tuple(q.shape[:-1])}"
        )
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def quantize_blockwise(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., H]`` -> (``q [..., H]`` e4m3, ``scale [..., H / block]`` fp32): one scale per 1 x block."""
    _check_input(x, "quantize_blockwise")
    hidden = x.shape[-1]
    if block < 1 or hidden % block:
        raise ValueError(
            f"quantize_blockwise: hidden size {hidden} is not a multiple of the block {block}; "
            f"use a hidden size divisible by {block} or rowwise scaling"
        )
    x_blocks = x.float().reshape(*x.shape[:-1], hidden // block, block)
    scale = _scale_from_amax(x_blocks.abs().amax(-1))
    return _cast(x_blocks / scale.unsqueeze(-1)).reshape(x.shape), scale


def dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    if q.dtype != E4M3:
        raise TypeError(f"dequantize_blockwise: q dtype {q.dtype}, expected {E4M3}")
    hidden, nblk = q.shape[-1], scale.shape[-1]
    if scale.shape[:-1] != q.shape[:-1] or nblk == 0 or hidden % nblk:
        raise ValueError(
            f"dequantize_blockwise: scale shape {tuple(scale.shape)} does not tile q shape {tuple(q.shape)}"
        )
    q_blocks = q.float().reshape(*q.shape[:-1], nblk, hidden // nblk)
    return (q_blocks * scale.float().unsqueeze(-1)).reshape(q.shape).to(dtype)


def segment_ids(offsets_G: torch.Tensor, length: int) -> torch.Tensor:
    """Segment of each of ``length`` positions given inclusive ends ``offsets_G``; positions past the
    last end (spare padding) get G."""
    pos = torch.arange(length, device=offsets_G.device)
    return torch.searchsorted(offsets_G.long(), pos, right=True)


def quantize_segments(x_CM: torch.Tensor, offsets_G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [C, M]`` whose columns split into G segments (inclusive ends ``offsets_G``) -> (``q [C, M]``,
    ``scale [G, C]``): one scale per (row, segment). The wgrad operands of a grouped GEMM need it (the
    contraction runs over each expert's tokens). Device-only: a scatter-amax, no host sync."""
    _check_input(x_CM, "quantize_segments")
    if x_CM.dim() != 2 or offsets_G.dim() != 1:
        raise ValueError(
            f"quantize_segments: x shape {tuple(x_CM.shape)}, offsets shape {tuple(offsets_G.shape)}; "
            "expected [C, M] and [G]"
        )
    cols, length = x_CM.shape
    groups = offsets_G.shape[0]
    seg_M = segment_ids(offsets_G, length)
    amax_CG1 = x_CM.new_zeros(cols, groups + 1, dtype=torch.float32)
    amax_CG1.scatter_reduce_(1, seg_M.expand(cols, length), x_CM.abs().float(), "amax")
    scale_CG1 = _scale_from_amax(amax_CG1)
    q = _cast(x_CM.float() / scale_CG1.gather(1, seg_M.expand(cols, length)))
    return q, scale_CG1[:, :groups].t().contiguous()
