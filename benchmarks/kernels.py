"""GPU micro-benchmark: each Triton kernel against its torch reference, on real MoE layer shapes.

    python -m benchmarks.kernels [--shapes qwen3-30b-a3b deepseek-v3-slice] [--alignment 1] [--json OUT]
                                 [--weights] [--weight-plans 1x16,2x32w4]

Legend: T tokens, H hidden, F expert FFN width, E experts, K top-k, N = T*K routes, R permuted rows.

Per (shape, kernel): the Triton op and the reference are first checked against each other, then timed with
CUDA events (warm-up, then the median of ``--iters`` runs, L2 flushed before each run). Backward rows time
``torch.autograd.grad`` on a retained graph, so only the backward kernels are in the window. GB/s counts the
bytes a kernel has to move at least (inputs read once, outputs written once), the same for both columns.
Prints a markdown table; bf16 activations, fp32 router probabilities, int64 top-k ids.

FP8 weights (a second table; ``--weights``: only this one): the dgrad operand of the native FP8 experts,
``kernels.fp8_quant.quantize_weight_t`` of each shape's bf16 expert weights, fc1 w [E, 2F, H] and fc2 w
[E, H, F], by the column-block kernel (its ``weight_t_plan`` launch, and each launch of ``--weight-plans``:
PxK[wW] = P programs per SM, BLOCK_K K, W warps, steps in proportion to the warps; the P programs of an SM
must fit its registers at once), by the generic segment kernels (an amax pass, then a cast pass reading w
again) and by the torch reference. The column-block results are checked bitwise against the segment
kernels' first. GB/s: w read once, q (e4m3) and the scales written once.

``--json``: {"kernels": the first table's rows, "fp8_weights": the second's}.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass

import torch

from mok_megatron.kernels import Impl
from mok_megatron.kernels import fp8_quant as Q
from mok_megatron.kernels.combine import combine
from mok_megatron.kernels.permute import permute
from mok_megatron.kernels.routing import routing_metadata
from mok_megatron.kernels.swiglu import swiglu


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int
    hidden: int
    ffn: int
    experts: int
    topk: int


SHAPES = {
    s.name: s
    for s in (
        Shape("qwen3-30b-a3b", tokens=16384, hidden=2048, ffn=768, experts=128, topk=8),
        Shape("deepseek-v3-slice", tokens=4096, hidden=7168, ffn=2048, experts=8, topk=8),
    )
}

BF16_TOL = dict(rtol=1e-2, atol=1e-2)
_L2_FLUSH_BYTES = 256 << 20


def time_ms(fn, warmup: int, iters: int, flush: torch.Tensor) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs, each after an L2 flush (outside the window)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _check(name: str, got, want) -> None:
    for g, w in zip(got, want, strict=True):
        if g is None and w is None:
            continue
        if g.dtype in (torch.int32, torch.int64):
            if not torch.equal(g, w):
                raise AssertionError(f"{name}: Triton and reference differ")
        else:
            torch.testing.assert_close(g.float(), w.float(), **BF16_TOL, msg=lambda m: f"{name}: {m}")


def _cases(shape: Shape, alignment: int, dev: str = "cuda"):
    """(kernel name, bytes moved, run(impl) -> tuple of tensors) for one shape."""
    T, H, F, E, K = shape.tokens, shape.hidden, shape.ffn, shape.experts, shape.topk
    N = T * K
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
    meta = routing_metadata(ids, E, alignment, impl=Impl.TORCH)
    R = meta.num_rows
    x = torch.randn(T, H, device=dev, generator=g, dtype=torch.bfloat16)
    probs = torch.rand(T, K, device=dev, generator=g)
    y = torch.randn(R, H, device=dev, generator=g, dtype=torch.bfloat16)
    h = torch.randn(R, 2 * F, device=dev, generator=g, dtype=torch.bfloat16)
    probs_R = torch.rand(R, device=dev, generator=g)
    dx_RH = torch.randn(R, H, device=dev, generator=g, dtype=torch.bfloat16)
    dout = torch.randn(T, H, device=dev, generator=g, dtype=torch.bfloat16)
    da = torch.randn(R, F, device=dev, generator=g, dtype=torch.bfloat16)

    def routing(impl):
        m = routing_metadata(ids, E, alignment, impl=impl)
        return m.counts_E, m.offsets_E, m.aligned_offsets_E, m.row_TK

    def graph(impl, op, *inputs):
        """The op's output and its leaf inputs, built once per impl so that runs replay only the backward."""
        leaves = [t.detach().requires_grad_() for t in inputs]
        return op(impl, *leaves), leaves

    def backward(op, inputs, grad):
        built = {}

        def run(impl):
            if impl not in built:
                built[impl] = graph(impl, op, *inputs)
            out, leaves = built[impl]
            return torch.autograd.grad(out, leaves, grad, retain_graph=True)

        return run

    permute_x = lambda impl, x_: permute(x_, meta, probs, impl=impl)[0]  # noqa: E731
    combine_w = lambda impl, y_, p_: combine(y_, meta, p_, impl=impl)  # noqa: E731
    swiglu_p = lambda impl, h_, p_: swiglu(h_, p_, impl=impl)  # noqa: E731
    b, f4, i4 = 2, 4, 4  # bytes per bf16, fp32, int32
    return [
        ("routing metadata", N * 8 + N * i4, routing),
        (
            "permute fwd (+probs)",
            T * H * b + N * (f4 + i4) + R * (H * b + f4),
            lambda i: permute(x, meta, probs, impl=i),
        ),
        ("permute bwd (gather-sum)", R * H * b + N * i4 + T * H * b, backward(permute_x, (x,), dx_RH)),
        ("combine fwd unweighted", N * H * b + N * i4 + T * H * b, lambda i: (combine(y, meta, impl=i),)),
        (
            "combine fwd weighted",
            N * H * b + N * (i4 + f4) + T * H * b,
            lambda i: (combine(y, meta, probs, impl=i),),
        ),
        (
            "combine bwd weighted",
            T * H * b + N * H * b + R * H * b + N * (i4 + 2 * f4),
            backward(combine_w, (y, probs), dout),
        ),
        ("swiglu fwd (x prob)", R * (2 * F * b + f4 + F * b), lambda i: (swiglu(h, probs_R, impl=i),)),
        (
            "swiglu bwd (x prob)",
            R * (2 * F * b + f4 + F * b + 2 * F * b + f4),
            backward(swiglu_p, (h, probs_R), da),
        ),
    ]


def run(shape_names, alignment: int, warmup: int, iters: int) -> list[dict]:
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    rows = []
    for name in shape_names:
        shape = SHAPES[name]
        for kernel, nbytes, fn in _cases(shape, alignment):
            _check(f"{name} {kernel}", fn(Impl.TRITON), fn(Impl.TORCH))
            ms = {
                impl: time_ms(lambda impl=impl, fn=fn: fn(impl), warmup, iters, flush)
                for impl in (Impl.TRITON, Impl.TORCH)
            }
            rows.append(
                dict(
                    shape=name,
                    kernel=kernel,
                    triton_ms=ms[Impl.TRITON],
                    torch_ms=ms[Impl.TORCH],
                    triton_gbps=nbytes / ms[Impl.TRITON] / 1e6,
                    torch_gbps=nbytes / ms[Impl.TORCH] / 1e6,
                )
            )
        torch.cuda.empty_cache()
    return rows


def weight_shapes(shape: Shape) -> list[tuple[str, tuple[int, int, int]]]:
    """The experts' weights as ``quantize_weight_t`` takes them, [G, N, K]."""
    return [
        ("fc1 w", (shape.experts, 2 * shape.ffn, shape.hidden)),
        ("fc2 w", (shape.experts, shape.hidden, shape.ffn)),
    ]


def parse_weight_plans(text: str) -> list[tuple[int, int, int | None]]:
    """``--weight-plans``: comma-separated PxK or PxKwW -> (programs per SM, BLOCK_K, warps or None)."""
    plans = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        m = re.fullmatch(r"(\d+)x(\d+)(?:w(\d+))?", item)
        plan = (int(m[1]), int(m[2]), int(m[3]) if m[3] else None) if m else None
        if plan is None or plan[0] < 1 or plan[1] not in (16, 32, 64, 128) or plan[2] == 0:
            raise ValueError(
                f"--weight-plans: {item!r} is not PxK or PxKwW (P programs per SM >= 1, BLOCK_K one of "
                "16, 32, 64, 128, W warps >= 1)"
            )
        plans.append(plan)
    return plans


def _plan_name(plan: Q.WeightTPlan) -> str:
    return (
        f"column blocks: {plan.programs} programs, BLOCK_K {plan.block_k}, {plan.warps} warps, "
        f"{plan.amax_n} / {plan.block_n} rows per step"
    )


def _weight_cases(shape: Shape, plans=(), dev: str = "cuda"):
    """(weight name, [G, N, K], bytes moved, {path: run() -> (q, scale)}, column-block paths) per weight."""
    g = torch.Generator(device=dev).manual_seed(1)
    cases = []
    for name, dims in weight_shapes(shape):
        w = (torch.randn(dims, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        groups, n, k = dims
        nbytes = groups * n * k * (w.element_size() + 1) + groups * k * 4
        launches = []
        auto = Q.weight_t_plan(w)
        if auto is not None:
            launches.append(auto)
        for per_sm, block_k, warps in plans:
            plan = Q.weight_t_plan(w, per_sm, block_k, warps)
            if plan is not None:
                launches.append(plan)
        paths = {"segment kernels": lambda w=w: Q._weight_t_segments(w)}
        blocks = []
        for plan in dict.fromkeys(launches):  # in order, each launch once
            paths[_plan_name(plan)] = lambda w=w, plan=plan: Q._weight_t_blocks(w, plan)
            blocks.append(_plan_name(plan))
        paths["torch reference"] = lambda w=w: Q.quantize_weight_t(w, Impl.TORCH)
        cases.append((name, dims, nbytes, paths, blocks))
    return cases


def check_weight_paths(label: str, paths: dict, blocks: list[str]) -> None:
    """Each column-block launch bitwise equal to the segment kernels (the same scale and cast code)."""
    q_ref, s_ref = paths["segment kernels"]()
    for name in blocks:
        q, s = paths[name]()
        if not (torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))):
            raise AssertionError(f"{label} {name}: differs from the segment kernels")


def run_weights(shapes, plans, warmup: int, iters: int, dev: str = "cuda", timer=time_ms) -> list[dict]:
    """The FP8 weight table's rows for ``shapes`` (``Shape``s); ``timer(fn, warmup, iters, flush)`` -> ms."""
    flush = torch.empty(_L2_FLUSH_BYTES if dev == "cuda" else 1, dtype=torch.uint8, device=dev)
    rows = []
    for shape in shapes:
        for name, dims, nbytes, paths, blocks in _weight_cases(shape, plans, dev):
            check_weight_paths(f"{shape.name} {name}", paths, blocks)
            ms = {path: timer(fn, warmup, iters, flush) for path, fn in paths.items()}
            for path, t in ms.items():
                rows.append(
                    dict(
                        shape=shape.name,
                        weight=name,
                        dims=list(dims),
                        path=path,
                        ms=t,
                        gbps=nbytes / t / 1e6,
                        vs_segments=ms["segment kernels"] / t,
                    )
                )
            del paths
            if dev == "cuda":
                torch.cuda.empty_cache()
    return rows


def weights_markdown(rows: list[dict]) -> str:
    lines = [
        "| shape | weight [G, N, K] | path | ms | GB/s | speed-up vs segment kernels |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        dims = "x".join(map(str, r["dims"]))
        lines.append(
            f"| {r['shape']} | {r['weight']} {dims} | {r['path']} | {r['ms']:.3f} | {r['gbps']:.0f} | "
            f"{r['vs_segments']:.2f}x |"
        )
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    lines = [
        "| shape | kernel | Triton ms | torch ms | speed-up | Triton GB/s | torch GB/s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['kernel']} | {r['triton_ms']:.3f} | {r['torch_ms']:.3f} | "
            f"{r['torch_ms'] / r['triton_ms']:.2f}x | {r['triton_gbps']:.0f} | {r['torch_gbps']:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels",
        description="Triton kernels vs torch references (needs a CUDA GPU)",
    )
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--alignment", type=int, default=1, help="expert row alignment (1, 16, 32, 128)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--weights", action="store_true", help="only the FP8 weight quantization table")
    parser.add_argument(
        "--weight-plans",
        default="",
        help="also time these column-block launches: comma-separated PxK[wW] (P programs per SM, BLOCK_K K, "
        "W warps), e.g. 1x16,1x32,2x16,2x32w4",
    )
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    try:
        plans = parse_weight_plans(args.weight_plans)
    except ValueError as e:
        parser.error(str(e))
    if not torch.cuda.is_available():
        print("python -m benchmarks.kernels: needs a CUDA GPU (none is visible here)", file=sys.stderr)
        return 2
    rows = [] if args.weights else run(args.shapes, args.alignment, args.warmup, args.iters)
    weight_rows = run_weights([SHAPES[name] for name in args.shapes], plans, args.warmup, args.iters)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, alignment {args.alignment}, "
        f"median of {args.iters} (CUDA events, L2 flushed)\n"
    )
    if rows:
        print(markdown(rows) + "\n")
    print("FP8 weights, quantize_weight_t (bf16 w [G, N, K] -> e4m3 q [G, K, N] + fp32 scales [G, K]):\n")
    print(weights_markdown(weight_rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernels": rows, "fp8_weights": weight_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
