"""Probe: ``torch._scaled_grouped_mm`` (rowwise FP8) vs ``torch._grouped_mm`` (bf16) per GEMM on the
MoE shapes, forward/dgrad layout (x [M, K] row-major, w [G, K, N] column-major), with and without
fast accumulation, and the wgrad layout (2d x 2d, offsets over the contraction). Prints ms and TFLOP/s.

    python benchmarks/fp8_gemm_probe.py            (one GPU, ~20 s)

Legend: G experts, M rows (expert-major, each expert's rows a multiple of 16), K in, N out.
"""

from __future__ import annotations

import torch

SHAPES = {  # name: (G, rows per expert, K, N)
    "qwen3 fc1": (128, 1024, 2048, 1536),
    "qwen3 fc2": (128, 1024, 768, 2048),
    "dsv3 fc1": (8, 4096, 7168, 4096),
    "dsv3 fc2": (8, 4096, 2048, 7168),
}


def _time(fn, iters=20, warmup=5) -> float:
    for _ in range(warmup):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / iters


def _row(name: str, G: int, m: int, K: int, N: int) -> str:
    dev = "cuda"
    f8 = torch.float8_e4m3fn
    M = G * m
    flop = 2.0 * M * K * N
    offs = torch.arange(m, M + 1, m, device=dev, dtype=torch.int32)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(G, N, K, device=dev, dtype=torch.bfloat16) / K**0.5
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    xq, wq = x.to(f8), w.to(f8)
    sa = torch.ones(M, device=dev)
    sb = torch.ones(G, N, device=dev)
    b16 = _time(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
    res = []
    for fast in (True, False):
        res.append(
            _time(
                lambda fast=fast: torch._scaled_grouped_mm(
                    xq,
                    wq.transpose(-2, -1),
                    sa,
                    sb,
                    offs=offs,
                    out_dtype=torch.bfloat16,
                    use_fast_accum=fast,
                )
            )
        )
    # wgrad: dw[g] = dy_g^T @ x_g: A = dy^T [N, M] row-major, B = x [M, K] column-major
    dyq_t = dy.t().contiguous().to(f8)
    xq_cm = x.t().contiguous().to(f8).t()
    swa = torch.ones(G * N, device=dev)
    swb = torch.ones(G * K, device=dev)
    wg8 = _time(
        lambda: torch._scaled_grouped_mm(
            dyq_t, xq_cm, swa, swb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=False
        )
    )
    wg16 = _time(lambda: torch._grouped_mm(dy.t(), x, offs=offs))

    def tf(ms):
        return f"{ms:.3f} ({flop / ms / 1e9:.0f})"

    return f"| {name} | {G} x {m} | {tf(b16)} | {tf(res[0])} | {tf(res[1])} | {tf(wg8)} | {tf(wg16)} |"


def main() -> None:
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(
        "| GEMM | G x rows | bf16 ms (TF/s) | fp8 fast-accum ms (TF/s) | fp8 exact-accum ms (TF/s) "
        "| fp8 wgrad 2d-2d ms (TF/s) | bf16 wgrad ms (TF/s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        print(_row(name, *shape), flush=True)


if __name__ == "__main__":
    main()
