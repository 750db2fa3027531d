"""The per-(segment, column) FP8 quantization for the weight gradients (``kernels.fp8_quant``: the
``_segment_amax`` + ``_segment_cast`` pair behind ``quantize_segments_t``) over its tile sizes and warps,
on the DeepSeek-V3 slice's and Qwen3-30B-A3B's wgrad operands (bf16, uniform segments), one GPU.
Median of 30 CUDA-event-timed calls; GB/s counts the bf16 bytes read twice and the e4m3 bytes written once.

    python benchmarks/fp8_seg_probe.py
"""

from __future__ import annotations

import itertools
import statistics

import torch

from mok_megatron.bench.layer import time_steps

import mok_megatron.kernels.fp8_quant as Q


def _time(fn, iters=30, warmup=3):
    """Median ms per call (CUDA events: ``mok_megatron.bench.layer.time_steps``)."""
    return statistics.median(time_steps(fn, iters, warmup)) * 1e3


CASES = {  # name: (rows M, columns K, segments G)
    "dsv3 x [32768, 7168] G8": (32768, 7168, 8),
    "dsv3 dh [32768, 4096] G8": (32768, 4096, 8),
    "qwen3 x [131072, 2048] G128": (131072, 2048, 128),
}
base = Q.PACK_TILE  # swept: the amax and cast passes share each tile (session 6 split them: AMAX_TILE)
saved = (Q.AMAX_TILE, Q.PACK_TILE)
for name, (m, k, g) in CASES.items():
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    offs = (torch.arange(1, g + 1, device="cuda", dtype=torch.int32) * (m // g)).contiguous()
    want = None
    rows = []
    for bm, bk, w in itertools.product((32, 64, 128), (32, 64, 128, 256), (2, 4, 8)):
        if bm * bk > 16384:
            continue
        Q.AMAX_TILE = Q.PACK_TILE = (bm, bk, w)
        q, s = Q.quantize_segments_t(x, offs)
        if want is None:
            want = (q.view(torch.uint8).clone(), s.clone())
        assert torch.equal(q.view(torch.uint8), want[0]) and torch.equal(s, want[1]), (bm, bk, w)
        ms = _time(lambda x=x, offs=offs: Q.quantize_segments_t(x, offs))
        rows.append((ms, bm, bk, w))
    Q.AMAX_TILE, Q.PACK_TILE = saved
    gbs = (2 * 2 * m * k + m * k) / 1e6
    cur = [r for r in rows if r[1:] == base]
    cur_ms = cur[0][0] if cur else float("nan")
    print(f"\n== {name}: current {saved} {cur_ms:.3f} ms ({gbs / cur_ms:.0f} GB/s)")
    for ms, bm, bk, w in sorted(rows)[:6]:
        print(f"BLOCK_M {bm:3d} BLOCK_K {bk:3d} warps {w}: {ms:.3f} ms ({gbs / ms:.0f} GB/s)")
