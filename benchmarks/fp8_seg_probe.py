"""The per-(segment, column) FP8 quantization for the weight gradients (``kernels.fp8_quant``:
``quantize_segments_t``): the per-segment loop kernels (``_segment_amax`` / ``_segment_cast``) against the
split kernels (tiles over all rows, amax by atomic max) over their tile sizes and warps, on the DeepSeek-V3
slice's and Qwen3-30B-A3B's wgrad operands (bf16, uniform segments), one GPU. Every configuration's output
is checked bitwise equal to the loop kernels'. Median of 30 CUDA-event-timed calls; GB/s counts the bf16
bytes read twice and the e4m3 bytes written once.

    python benchmarks/fp8_seg_probe.py
"""

from __future__ import annotations

import itertools
import statistics

import torch

import mok_megatron.kernels.fp8_quant as Q


def _time(fn, iters=30, warmup=3):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


CASES = {  # name: (rows M, columns K, segments G)
    "dsv3 x [32768, 7168] G8": (32768, 7168, 8),
    "dsv3 dh [32768, 4096] G8": (32768, 4096, 8),
    "qwen3 x [131072, 2048] G128": (131072, 2048, 128),
}
split_default = (Q.SPLIT_BLOCK_M, Q.SPLIT_BLOCK_K, Q.SPLIT_WARPS)
max_segments = Q.SPLIT_MAX_SEGMENTS
for name, (m, k, g) in CASES.items():
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    offs = (torch.arange(1, g + 1, device="cuda", dtype=torch.int32) * (m // g)).contiguous()
    gbs = (2 * 2 * m * k + m * k) / 1e6
    Q.SPLIT_MAX_SEGMENTS = 0  # the loop kernels
    q0, s0 = Q.quantize_segments_t(x, offs)
    want = (q0.view(torch.uint8).clone(), s0.clone())
    loop_ms = _time(lambda x=x, offs=offs: Q.quantize_segments_t(x, offs))
    Q.SPLIT_MAX_SEGMENTS = max_segments
    rows = []
    for bm, bk, w in itertools.product((32, 64, 128), (64, 128), (2, 4)):
        Q.SPLIT_BLOCK_M, Q.SPLIT_BLOCK_K, Q.SPLIT_WARPS = bm, bk, w
        q, s = Q.quantize_segments_t(x, offs)
        assert torch.equal(q.view(torch.uint8), want[0]) and torch.equal(s, want[1]), (name, bm, bk, w)
        rows.append((_time(lambda x=x, offs=offs: Q.quantize_segments_t(x, offs)), bm, bk, w))
    Q.SPLIT_BLOCK_M, Q.SPLIT_BLOCK_K, Q.SPLIT_WARPS = split_default
    cur = [r for r in rows if r[1:] == split_default][0]
    print(
        f"\n== {name}: loop kernels {loop_ms:.3f} ms ({gbs / loop_ms:.0f} GB/s); split default "
        f"{split_default} {cur[0]:.3f} ms ({gbs / cur[0]:.0f} GB/s); outputs bitwise equal"
    )
    for ms, bm, bk, w in sorted(rows)[:5]:
        print(f"split BLOCK_M {bm:3d} BLOCK_K {bk:3d} warps {w}: {ms:.3f} ms ({gbs / ms:.0f} GB/s)")
