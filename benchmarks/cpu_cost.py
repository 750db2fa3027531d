"""The research sweeps time GPU kernels and streams: without a CUDA GPU each refuses in one line
(``cpu_refusal``) unless ``--allow-cpu`` is given; the loopback sweep's line carries its estimated cost
on this CPU (``cpu_estimate``).

A layer step (forward + backward) is dominated by its expert GEMMs: ``3 x 2 x T x K x 3 x H x F`` FLOPs
(fc1 is 2F wide, fc2 F; backward twice the forward), plus a shared expert's ``3 x 2 x T x 3 x H x S``.
Measured on a shared 2-core CPU (torch 2.14, fp32): the MoK layer ran at 0.26-0.46 of the rate of a
1024^3 fp32 matmul on the same cores (H 1024-2048, F 512-768, 8-16 experts, top-8, 2048 tokens; and
dsv3-4k's H 7168, F 2048 at 256 tokens: 44-56 s a step where this estimate says 67 s), plain and
loopback, and the tiny shape's step took 11-19 ms. So a step is estimated at its FLOPs over a quarter of
the measured matmul rate, plus 20 ms: a rough guide (within ~1.5x there), meant to tell minutes from days.

Legend: T tokens, K top-k, H hidden, F expert FFN width, S shared-expert FFN width.
"""

from __future__ import annotations

import time

LAYER_EFFICIENCY = 0.25  # layer FLOP rate / 1024^3 fp32 matmul rate (measured 0.26-0.46)
STEP_OVERHEAD_S = 0.02  # the rest of a step (tiny shape: 11-19 ms)


def matmul_gflops(n: int = 1024, repeats: int = 3) -> float:
    """This CPU's fp32 ``n^3`` matmul rate (GFLOP/s), best of ``repeats``."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def step_flops(shape: dict) -> float:
    """Expert-GEMM FLOPs of one forward + backward of an ``OVERLAP_SHAPES`` entry."""
    rows = shape["tokens"] * shape["topk"]
    flops = 3 * 2 * rows * 3 * shape["hidden"] * shape["ffn"]
    if shape.get("shared"):
        flops += 3 * 2 * shape["tokens"] * 3 * shape["hidden"] * shape["shared"]
    return flops


def step_seconds(shape: dict, gflops: float) -> float:
    return step_flops(shape) / (LAYER_EFFICIENCY * gflops * 1e9) + STEP_OVERHEAD_S


def overlap_steps(points: int, iters: int, warmup: int) -> float:
    """Layer steps one shape takes: the no-communication baseline (a checking forward, ~1/3 step, then
    warmup + iters) and per point a checking forward, two byte-counting steps, warmup + iters."""
    return (1 / 3 + warmup + iters) + points * (1 / 3 + 2 + warmup + iters)


def cpu_estimate(shapes: dict[str, dict], points: int, iters: int, warmup: int, gflops: float) -> str:
    """The estimated cost of a loopback sweep on this CPU, one clause."""
    per_shape = {n: step_seconds(s, gflops) * overlap_steps(points, iters, warmup) for n, s in shapes.items()}
    total = sum(per_shape.values())
    each = ", ".join(f"{n} {_duration(t / (points + 1))}" for n, t in per_shape.items())
    return (
        f"{len(shapes)} shape(s) x {points + 1} points (baseline included), {iters} iterations + {warmup} "
        f"warm-up each; estimated {_duration(total)} in all (a point: {each}; from this CPU's {gflops:.0f} "
        "GFLOP/s fp32 matmul)"
    )


def cpu_refusal(prog: str, cost: str | None = None, tiny: str = "--shapes tiny") -> str:
    """One line: ``prog`` needs a CUDA GPU, what a CPU run would cost, and how to run it anyway."""
    cost = f" ({cost})" if cost else ""
    return (
        f"{prog}: no CUDA GPU: this sweep times GPU kernels and streams, so on a CPU it runs long and its "
        f"times say nothing{cost}. Run it on a GPU, or add --allow-cpu to run it here anyway ({tiny} "
        "checks the command in seconds)."
    )


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"~{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"~{seconds / 60:.0f} min"
    return f"~{seconds / 3600:.1f} h"
