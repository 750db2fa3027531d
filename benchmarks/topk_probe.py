"""Router top-k selection on one GPU: ``torch.topk`` vs the Triton kernel (``kernels.topk``) over its
launch knobs, [T, E] fp32 scores, median of 50 CUDA-event-timed calls.

    python benchmarks/topk_probe.py            (Qwen3-30B-A3B 16384 x 128 top-8; DeepSeek slice 4096 x 8)
"""

from __future__ import annotations

import statistics

import torch

from mok_megatron.bench.layer import time_steps

from mok_megatron.kernels.topk import topk_indices, topk_indices_reference


def _time(fn, iters=50, warmup=5):
    """Median us per call (CUDA events: ``mok_megatron.bench.layer.time_steps``)."""
    return statistics.median(time_steps(fn, iters, warmup)) * 1e6


for t, e, k in ((16384, 128, 8), (4096, 8, 8), (65536, 256, 8)):
    s = torch.randn(t, e, device="cuda")
    ref = topk_indices_reference(s, k)
    print(f"\n== T={t} E={e} K={k}: torch.topk {_time(lambda s=s, k=k: torch.topk(s, k, dim=1)):.1f} us")
    for bt in (1, 2, 4, 8, 16, 32, 64):
        for nw in (1, 2, 4, 8):
            if bt * e > 65536:
                continue
            assert torch.equal(topk_indices(s, k, block_t=bt, num_warps=nw), ref)
            us = _time(lambda s=s, k=k, bt=bt, nw=nw: topk_indices(s, k, block_t=bt, num_warps=nw))
            print(f"block_t {bt:3d} num_warps {nw}: {us:6.1f} us")
