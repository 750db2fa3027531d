"""FP8 token dispatch: quantize the token rows before the exchange, scales travelling with them.

Each row becomes one uint8 row ``[H fp8 bytes | S fp32 scales as 4S bytes | zero pad]``, padded to a
multiple of 16 bytes (aligned rows for the copy engine and NCCL), so one ``transport.move`` moves both
and nothing can pair a row with another row's scale. Bytes per row: ``round_up(H + 4 S, 16)`` vs ``2 H``
in bf16 -- about half (H = 7168 rowwise: 7184 vs 14336 bytes, 0.501x; 1x128 blocks: 7392, 0.516x).

Autograd (``fp8_dispatch``): forward sends FP8 and returns the dequantized rows (plus the raw FP8 rows
and scales for experts that consume FP8 directly, e.g. ``native.fp8_grouped_linear`` with matching
rowwise scales, so nothing is re-quantized); backward sends the incoming gradient back in its own
precision (bf16), not FP8. Why: gradients have a far wider dynamic range than activations and the error
of a quantized combine/backward adds up over the K routes of every token; DeepEP's maintainers declined
an FP8 combine for exactly this accuracy reason, and TE/DeepSeek-V3 keep the combine in bf16 too. The
quantization is treated as identity in backward (straight-through), as every FP8 training recipe does:
the experts' weight gradients see the dequantized activations they actually computed with.

Error of the round trip: ``quantize`` module docstring -- per element at most 2^-4 |x| + 2^-10 amax/448
of its scale group, i.e. <= amax/16.

How it plugs in: with ``--mok-fp8-dispatch`` the overlap pipeline (``engine.pipeline.run_pipeline``)
packs each minibatch's dispatched rows (rowwise scales), moves the packed rows and dequantizes them on
arrival; its late ``_Arrived`` node carries the bf16 gradient back (straight-through). ``fp8_dispatch``
below is the same exchange as one autograd function (tests, and experts that take the FP8 rows as
they are). The combine stays in the rows' precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mok_megatron.kernels.fp8_quant_reference import (
    BLOCK,
    E4M3,
    dequantize_blockwise,
    dequantize_rowwise,
    quantize_blockwise,
)
from mok_megatron.transport.base import Direction
from mok_megatron.kernels.fp8_quant import quantize_rowwise as quantize_rowwise_fast

ROW_ALIGN_BYTES = 16


@dataclass(frozen=True)
class PackLayout:
    """Byte layout of one packed row. ``block`` 0 = one rowwise scale, else one scale per 1 x block."""

    hidden: int
    block: int = 0

    def __post_init__(self):
        if self.hidden < 1:
            raise ValueError(f"PackLayout: hidden={self.hidden}, expected >= 1")
        if self.block < 0 or (self.block and self.hidden % self.block):
            raise ValueError(
                f"PackLayout: hidden={self.hidden} is not a multiple of block={self.block}; "
                "use block=0 (rowwise) or a hidden size divisible by the block"
            )

    @property
    def num_scales(self) -> int:
        return self.hidden // self.block if self.block else 1

    @property
    def row_bytes(self) -> int:
        raw = self.hidden + 4 * self.num_scales
        return (raw + ROW_ALIGN_BYTES - 1) // ROW_ALIGN_BYTES * ROW_ALIGN_BYTES


def _quantize(x_NH: torch.Tensor, layout: PackLayout):
    if layout.block:
        return quantize_blockwise(x_NH, layout.block)
    q, s = quantize_rowwise_fast(x_NH)  # the one-pass Triton kernel on CUDA (bitwise the reference)
    return q, s.unsqueeze(-1)


def pack(x_NH: torch.Tensor, layout: PackLayout) -> torch.Tensor:
    """``[N, H]`` high-precision rows -> ``[N, row_bytes]`` uint8 (fp8 values, then fp32 scales)."""
    if x_NH.dim() != 2 or x_NH.shape[1] != layout.hidden:
        raise ValueError(f"pack: x has shape {tuple(x_NH.shape)}, expected [N, {layout.hidden}]")
    q_NH, scale_NS = _quantize(x_NH, layout)
    return pack_quantized(q_NH, scale_NS, layout)


def pack_quantized(q_NH: torch.Tensor, scale_NS: torch.Tensor, layout: PackLayout) -> torch.Tensor:
    n, h, s = q_NH.shape[0], layout.hidden, layout.num_scales
    buf = q_NH.new_zeros((n, layout.row_bytes), dtype=torch.uint8)
    buf[:, :h] = q_NH.view(torch.uint8)
    buf[:, h : h + 4 * s] = scale_NS.float().contiguous().view(torch.uint8)
    return buf


def unpack(buf_NB: torch.Tensor, layout: PackLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, row_bytes]`` uint8 -> (``q [N, H]`` e4m3, ``scale [N, S]`` fp32)."""
    if buf_NB.dtype != torch.uint8 or buf_NB.dim() != 2 or buf_NB.shape[1] != layout.row_bytes:
        raise ValueError(
            f"unpack: buffer {tuple(buf_NB.shape)} {buf_NB.dtype}, expected [N, {layout.row_bytes}] uint8"
        )
    h, s = layout.hidden, layout.num_scales
    q_NH = buf_NB[:, :h].contiguous().view(E4M3)
    scale_NS = buf_NB[:, h : h + 4 * s].contiguous().view(torch.float32)
    return q_NH, scale_NS


def dequantize(q_NH: torch.Tensor, scale_NS: torch.Tensor, layout: PackLayout, dtype) -> torch.Tensor:
    if layout.block:
        return dequantize_blockwise(q_NH, scale_NS, dtype)
    return dequantize_rowwise(q_NH, scale_NS.squeeze(-1), dtype)


class _FP8Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NH, transport, mb, layout, direction):
        ctx.transport, ctx.mb, ctx.direction = transport, mb, direction
        buf = transport.move(pack(x_NH, layout), mb, direction)
        q_RH, scale_RS = unpack(buf, layout)
        ctx.mark_non_differentiable(q_RH, scale_RS)
        return dequantize(q_RH, scale_RS, layout, x_NH.dtype), q_RH, scale_RS

    @staticmethod
    def backward(ctx, g_RH, _gq, _gs):
        g_NH = ctx.transport.move(g_RH.contiguous(), ctx.mb, ctx.direction.reverse, backward=True)
        return g_NH, None, None, None, None


def fp8_dispatch(x_NH: torch.Tensor, transport, mb, block: int = 0, direction: Direction = Direction.DISPATCH):
    """Exchange ``x [N, H]`` in FP8 (``block`` 0: rowwise scales, 128: 1x128 blocks).

    Returns (``y [R, H]`` dequantized in x's dtype, differentiable; ``q [R, H]`` e4m3 and
    ``scale [R, S]`` fp32, the received FP8 rows for experts that take them as they are)."""
    return _FP8Dispatch.apply(x_NH, transport, mb, PackLayout(x_NH.shape[-1], block), direction)


__all__ = ["BLOCK", "PackLayout", "dequantize", "fp8_dispatch", "pack", "pack_quantized", "unpack"]
