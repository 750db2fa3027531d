"""Grouped bf16 GEMMs of the expert MLP, one by one, in our operand layouts and the alternatives
(``torch._grouped_mm``, uniform routing, one H200): which layouts run at what TFLOP/s.

    python benchmarks/gemm_layout_probe.py [--shapes qwen3-30b-a3b,deepseek-v3-ep32]

For fc1 (N = 2F, K = H) and fc2 (N = H, K = F), per expert M rows:
    fwd    x[M,K] @ w[G,N,K]^T   (ours: transposed weight view)  | x @ wT where wT[G,K,N] contiguous
    dgrad  dy[M,N] @ w[G,N,K]    (ours)                          | dy @ (wT)^T view
    wgrad  dy^T @ x -> [G,N,K]   (ours)                          | x^T @ dy -> [G,K,N] (transposed result)
Median of 20 CUDA-event-timed calls after 3 warm-up calls.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from mok_megatron.bench.layer import SHAPES, time_steps
from mok_megatron.compat import grouped_mm_fn


def _time(fn, iters=20, warmup=3):
    """Median ms per call (CUDA events: ``mok_megatron.bench.layer.time_steps``)."""
    return statistics.median(time_steps(fn, iters, warmup)) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3-ep32")
    ns = p.parse_args()
    gmm = grouped_mm_fn()
    dev, dt = torch.device("cuda"), torch.bfloat16
    for name in ns.shapes.split(","):
        s = SHAPES[name]
        g, h, f = s["experts"], s["hidden"], s["ffn"]
        m = s["tokens"] * s["topk"]
        counts = torch.full((g,), m // g, dtype=torch.int32)
        counts[: m - int(counts.sum())] += 1
        offs = torch.cumsum(counts, 0, dtype=torch.int32).to(dev)
        print(f"\n== {name}: G={g} M={m} H={h} F={f}")
        for fc, n, k in (("fc1", 2 * f, h), ("fc2", h, f)):
            x = torch.randn(m, k, device=dev, dtype=dt)
            dy = torch.randn(m, n, device=dev, dtype=dt)
            w = torch.randn(g, n, k, device=dev, dtype=dt) * 0.02
            wt = w.transpose(-2, -1).contiguous()  # [G, K, N]
            flops = 2 * m * n * k
            cases = {
                "fwd  x @ w^T (ours)": lambda x=x, w=w, o=offs: gmm(x, w.transpose(-2, -1), offs=o),
                "fwd  x @ wT": lambda x=x, wt=wt, o=offs: gmm(x, wt, offs=o),
                "dgrad dy @ w (ours)": lambda dy=dy, w=w, o=offs: gmm(dy, w, offs=o),
                "dgrad dy @ wT^T": lambda dy=dy, wt=wt, o=offs: gmm(dy, wt.transpose(-2, -1), offs=o),
                "wgrad dy^T @ x (ours)": lambda dy=dy, x=x, o=offs: gmm(dy.t(), x, offs=o),
                "wgrad x^T @ dy": lambda dy=dy, x=x, o=offs: gmm(x.t(), dy, offs=o),
            }
            for label, fn in cases.items():
                try:
                    ms = _time(fn)
                    print(f"{fc} {label:24s} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s")
                except Exception as e:  # a layout the kernel refuses
                    print(f"{fc} {label:24s} refused: {type(e).__name__}: {str(e)[:100]}")
            dense_a = torch.randn(m, k, device=dev, dtype=dt)
            dense_b = torch.randn(k, n, device=dev, dtype=dt)
            ms = _time(lambda a=dense_a, b=dense_b: a @ b)
            print(f"{fc} {'dense mm (same FLOPs)':24s} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s")


if __name__ == "__main__":
    main()
